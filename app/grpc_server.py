"""gRPC ``baidu.paddle_serving.pipeline_serving.PipelineService/inference``.

Runs inside each front worker, beside HTTP, on the same cache and engine: every worker
binds GRPC_PORT with SO_REUSEPORT (grpcio's default on Linux) and the kernel spreads
connections over them, so gRPC costs no extra engine memory. Stubs: app/protocols/pipeline_stubs.py.
Each call is parse (``pipeline.build_request``) -> the pipeline call shared with HTTP
(``pipeline.answer``: cache, then render) -> the protocol's ``Response``. With ``RATE_LIMIT``
a call over its client's budget (counted in Redis across workers and replicas:
app/cache/rate_limit.py) is refused first: ``RESOURCE_EXHAUSTED`` with ``retry-after``. Then
admission (``app/admission.py``): with ``AUTH=keys`` a call without a known key in its
metadata (``authorization: Bearer``, ``x-api-key``) ends ``UNAUTHENTICATED``; a tenant over a
quota, ``RESOURCE_EXHAUSTED`` with ``retry-after``.
"""

from __future__ import annotations

import logging
import secrets
import time
from concurrent import futures
from typing import Any

import grpc

from app import metrics, tracing
from app.admission import Admission
from app.cache.rate_limit import RateLimiter
from app.cache.region import OcrCache
from app.config import Settings
from app.protocols import controls, pipeline, trust
from app.protocols.errors import BadRequest
from app.protocols.pipeline_stubs import SERVICE, message_size_options, pb2, pb2_grpc
from app.service import OcrService
from app.vocabulary import EngineBusy, EngineUnavailable, Refused, Unauthorized

log = logging.getLogger(__name__)


class Undecodable:
    """A request body protobuf could not parse (bad wire data, invalid UTF-8 in a string)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _deserialize(data: bytes) -> Any:
    """``Request.FromString``, but bad bytes become an answer (err_no 8000), not gRPC INTERNAL."""
    try:
        return pb2.Request.FromString(data)
    except Exception as exc:  # protobuf's DecodeError, or any other parse failure
        return Undecodable(exc.__class__.__name__)


def _tensors(request: Any) -> list[pipeline.Tensor]:
    return [pipeline.Tensor(t.name, t.elem_type, list(t.str_data)) for t in request.tensors]


class Gate:
    """What every call on this server passes before any work, whichever service it is for
    (``PipelineService``, ``GRPCInferenceService``: ``app/grpc_kserve.py``): the deadline,
    ``RATE_LIMIT`` (one budget a client across the services) and admission (the tenant its
    key names); and how a call is refused."""

    def __init__(self, cache: OcrCache, settings: Settings) -> None:
        self._settings = settings
        self._admission = Admission(settings, cache.quotas.book, cache.quotas)
        limit = settings.edge.rate_limit
        self._limiter = (
            RateLimiter(cache.store, cache.keys, limit.rate, limit.burst, "grpc") if limit else None
        )

    def enter(self, context: grpc.ServicerContext, protocol: str) -> str | None:
        """The call's tenant (None: the default one), or the call ends here."""
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before start")
        if self._limiter is not None:
            self._limit(context, protocol)
        try:
            return self._admission.admit(
                metadata(context), trust.grpc_peer_address(context.peer()), self.trusted(context)
            )
        except Refused as exc:
            self.refuse(context, exc, protocol)
            raise  # not reached: abort raised
        except Exception:
            last_resort(context, protocol, f"{protocol} admission")
            raise  # not reached: abort raised

    def _limit(self, context: grpc.ServicerContext, protocol: str) -> None:
        """RATE_LIMIT, before any work (hits and misses alike): over the client's budget, the
        call ends with RESOURCE_EXHAUSTED and ``retry-after`` (seconds) in its trailers."""
        assert self._limiter is not None
        decision = self._limiter.check(trust.grpc_peer_address(context.peer()))
        if decision.allowed:
            return
        metrics.REQUESTS.labels(protocol=protocol, status="RESOURCE_EXHAUSTED").inc()
        context.set_trailing_metadata((("retry-after", str(decision.retry_after)),))
        limit = self._settings.edge.rate_limit
        assert limit is not None  # a limiter exists only with RATE_LIMIT
        context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"rate limit exceeded: at most {limit.rate:g} requests per second per client "
            f"(RATE_LIMIT={limit}); retry after {decision.retry_after} s",
        )

    @staticmethod
    def refuse(
        context: grpc.ServicerContext, exc: EngineBusy | Refused, protocol: str = "grpc"
    ) -> None:
        """Overload or a tenant's quota: RESOURCE_EXHAUSTED with ``retry-after`` (seconds);
        no engine reachable: UNAVAILABLE (with ``retry-after``); a missing or unknown API
        key: UNAUTHENTICATED."""
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
        if isinstance(exc, Unauthorized):
            code = grpc.StatusCode.UNAUTHENTICATED
        else:
            if isinstance(exc, EngineUnavailable):  # no engine at all: not overload
                code = grpc.StatusCode.UNAVAILABLE
            context.set_trailing_metadata((("retry-after", str(exc.retry_after)),))
        metrics.REQUESTS.labels(protocol=protocol, status=code.name).inc()
        context.abort(code, str(exc))

    def trusted(self, context: grpc.ServicerContext) -> bool:
        address = trust.grpc_peer_address(context.peer())
        return trust.is_trusted(address, metadata(context), self._settings.controls)

    def shows_cache_status(self, context: grpc.ServicerContext) -> bool:
        return trust.shows_cache_status(self.trusted(context), self._settings.controls)


def metadata(context: grpc.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}


def last_resort(context: grpc.ServicerContext, protocol: str, what: str) -> None:
    """A bug, never the client's fault: INTERNAL, logged with a request id."""
    request_id = secrets.token_hex(8)
    log.exception("unexpected error request_id=%s %s", request_id, what)
    metrics.UNEXPECTED_ERRORS.labels(protocol=protocol).inc()
    metrics.REQUESTS.labels(protocol=protocol, status="INTERNAL").inc()
    context.abort(grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})")


class PipelineServicer(pb2_grpc.PipelineServiceServicer):
    def __init__(self, cache: OcrCache, settings: Settings, gate: Gate) -> None:
        self._cache = cache
        self._settings = settings
        self._gate = gate

    def inference(self, request: Any, context: grpc.ServicerContext) -> Any:
        """A server span (``app.tracing``) continuing the ``traceparent`` in the metadata."""
        with tracing.TRACER.server("PipelineService/inference", metadata(context)) as span:
            return self._inference(request, context, span)

    def _inference(self, request: Any, context: grpc.ServicerContext, span: tracing.Span) -> Any:
        started = time.perf_counter()
        tenant = self._gate.enter(context, "grpc")
        try:
            answer = self._answer(request, context, tenant)
        except (EngineBusy, Refused) as exc:
            self._gate.refuse(context, exc)
        except Exception:
            last_resort(context, "grpc", "grpc inference")
        if answer.err_no == 0 and self._gate.shows_cache_status(context):
            trailers = [("x-cache", answer.cache_status)]
            if answer.cache_tier:
                trailers.append(("x-cache-tier", answer.cache_tier))
            context.set_trailing_metadata(tuple(trailers))
        metrics.REQUESTS.labels(protocol="grpc", status=str(answer.err_no)).inc()
        if span.recording:
            span.set("rpc.system", "grpc")
            span.set("ocr.protocol", "grpc")
            span.set("ocr.err_no", answer.err_no)
            if tenant:
                span.set("ocr.tenant", tenant)
            span.set("ocr.cache", answer.cache_status.lower())
            if answer.cache_tier:
                span.set("ocr.cache_tier", answer.cache_tier)
        metrics.REQUEST_SECONDS.labels(protocol="grpc", cache=answer.cache_status).observe(
            time.perf_counter() - started
        )
        return pb2.Response(
            err_no=answer.err_no, err_msg=answer.err_msg, key=answer.keys, value=answer.values
        )

    def _answer(
        self, request: Any, context: grpc.ServicerContext, tenant: str | None
    ) -> pipeline.PipelineAnswer:
        """``tenant``: the one its API key named (``Admission``)."""
        if isinstance(request, Undecodable):
            message = f"Failed to unpack request: not a pipeline Request ({request.reason})"
            return pipeline.PipelineAnswer(err_no=pipeline.PACKING_ERROR, err_msg=message)
        # Upstream checks the name only when the client sets one (PipelineClient does not).
        if request.name and request.name != self._settings.protocols.pipeline_service_name:
            return pipeline.service_name_error()
        try:
            req = pipeline.build_request(
                list(request.key), list(request.value), _tensors(request),
                request.logid, request.clientip,
            )  # fmt: skip
            trusted = self._gate.trusted(context)
            cache_controls = controls.parse(
                metadata(context), self._settings.controls, trusted=trusted, tenant=tenant
            )
        except (pipeline.PipelineError, BadRequest) as exc:
            return pipeline.refused(exc)
        log.debug("grpc logid=%s clientip=%s method=%s", req.logid, req.clientip, request.method)
        return pipeline.answer(
            self._cache, req, self._settings.ocr.rec_score_thresh,
            self._settings.protocols.max_images_per_request, cache_controls,
        )  # fmt: skip


def start(
    cache: OcrCache, settings: Settings, port: int | None = None, service: OcrService | None = None
) -> tuple[grpc.Server, int]:
    """Start serving; returns the server and the bound port (``port=0`` picks a free one).
    With ``service`` (the worker's: a front's always), the Open Inference Protocol's
    ``GRPCInferenceService`` too, on the same port."""
    size = settings.grpc_message_limit()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.grpc.threads, thread_name_prefix="grpc"),
        maximum_concurrent_rpcs=settings.grpc.max_concurrent_rpcs or 4 * settings.grpc.threads,
        # A request is bounded by the limit; an answer may be larger (an ``ocr`` envelope
        # with a PDF's pictures), as Triton's and its clients' 2 GiB.
        options=[
            *message_size_options(size),
            ("grpc.max_send_message_length", 2**31 - 1),
            ("grpc.so_reuseport", 1),
        ],  # fmt: skip
    )
    gate = Gate(cache, settings)
    _add_servicer(server, PipelineServicer(cache, settings, gate))
    if service is not None:
        from app import grpc_kserve  # tritonclient's generated modules: after Paddle, as grpcio

        grpc_kserve.add_to(server, service, gate)
    bind = f"{settings.server.host}:{settings.server.grpc_port if port is None else port}"
    bound = server.add_insecure_port(bind)
    if bound == 0:
        raise RuntimeError(f"gRPC could not bind {bind}")
    server.start()
    services = "PipelineService" + (", GRPCInferenceService" if service is not None else "")
    log.info("gRPC %s on %s:%d", services, settings.server.host, bound)
    return server, bound


def _add_servicer(server: grpc.Server, servicer: PipelineServicer) -> None:
    """What the generated ``add_PipelineServiceServicer_to_server`` does, with ``_deserialize``."""
    handlers = {
        "inference": grpc.unary_unary_rpc_method_handler(
            servicer.inference,
            request_deserializer=_deserialize,
            response_serializer=pb2.Response.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
