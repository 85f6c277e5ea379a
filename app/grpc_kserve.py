"""gRPC ``inference.GRPCInferenceService``: the Open Inference Protocol (KServe v2) as Triton
serves it, on the worker's gRPC server beside ``PipelineService`` (``app/grpc_server.py``),
for ``tritonclient.grpc`` and PaddleX's high-stability clients unchanged.

The messages are the generated modules ``tritonclient`` ships (``service_pb2``,
``model_config_pb2``: the protocol's published definition, never hand-typed). A call passes
the server's ``Gate`` (deadline, rate limit, keys), then runs the model as HTTP does
(``app.protocols.kserve_models.infer``). BYTES inputs are read from ``raw_input_contents`` (what
``tritonclient.grpc`` sends: 4-byte length prefixes) or from ``contents.bytes_contents``;
outputs go in ``raw_output_contents``, as Triton answers. The health, metadata,
configuration and repository index calls answer for the two models; every other method of
the service (streaming, statistics, shared memory, loading) answers ``UNIMPLEMENTED``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
from tritonclient.grpc import model_config_pb2 as config_pb2
from tritonclient.grpc import service_pb2 as pb2

from app import metrics, tracing
from app.grpc_server import Gate, last_resort, metadata
from app.protocols import controls, kserve
from app.protocols import kserve_models as models
from app.protocols.kserve import Model, Tensor, V2Error
from app.service import OcrService
from app.vocabulary import CacheControls, OcrCacheError

SERVICE = "inference.GRPCInferenceService"
PROTOCOL = "kserve_grpc"


class Undecodable:
    """A request protobuf could not parse: INVALID_ARGUMENT, not gRPC's INTERNAL."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _reader(message: Any) -> Callable[[bytes], Any]:
    def read(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except Exception as exc:  # protobuf's DecodeError, or any other parse failure
            return Undecodable(exc.__class__.__name__)

    return read


class InferenceServicer:
    def __init__(self, service: OcrService, gate: Gate) -> None:
        self._service = service
        self._gate = gate

    def _ready(self) -> bool:
        return self._service.engine_state.status == "ready"

    def ServerLive(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb2.ServerReadyResponse(ready=self._ready())

    def ModelReady(self, request: Any, context: grpc.ServicerContext) -> Any:
        """As Triton: an unknown model or version is not ready, not an error."""
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request ({request.reason})")
        known = request.name in kserve.MODELS and request.version in ("", kserve.VERSION)
        return pb2.ModelReadyResponse(ready=known and self._ready())

    def ServerMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb2.ServerMetadataResponse(**kserve.server_metadata())

    def ModelMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        model = self._model(request, context)
        tensor = pb2.ModelMetadataResponse.TensorMetadata
        return pb2.ModelMetadataResponse(
            name=model.name,
            versions=[kserve.VERSION],
            platform=kserve.PLATFORM,
            inputs=[tensor(**model.input.metadata())],
            outputs=[tensor(**model.output.metadata())],
        )

    def ModelConfig(self, request: Any, context: grpc.ServicerContext) -> Any:
        """The configuration's JSON form as its message; the engine's fingerprint among its
        parameters (``ModelMetadataResponse`` has no field for it)."""
        model = self._model(request, context)
        fingerprint = self._service.cache.engine.fingerprint
        config = model.config(fingerprint)
        return pb2.ModelConfigResponse(
            config=config_pb2.ModelConfig(
                name=config["name"],
                platform=config["platform"],
                backend=config["backend"],
                max_batch_size=config["max_batch_size"],
                input=[_io(config_pb2.ModelInput, spec) for spec in config["input"]],
                output=[_io(config_pb2.ModelOutput, spec) for spec in config["output"]],
                parameters={
                    "engine_fingerprint": config_pb2.ModelParameter(string_value=fingerprint)
                },
            )
        )

    def RepositoryIndex(self, request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request ({request.reason})")
        index = pb2.RepositoryIndexResponse.ModelIndex
        return pb2.RepositoryIndexResponse(
            models=[index(**entry) for entry in kserve.repository_index()]
        )

    def ModelInfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        """A server span continuing the ``traceparent`` in the metadata."""
        with tracing.TRACER.server(f"{SERVICE}/ModelInfer", metadata(context)) as span:
            started = time.perf_counter()
            tenant = self._gate.enter(context, PROTOCOL)
            try:
                model, response, inferred = self._infer(request, context, tenant)
            except V2Error as exc:
                self._fail(context, exc, span)
            except Exception:
                last_resort(context, PROTOCOL, "grpc ModelInfer")
            if inferred.cache_status != "none" and self._gate.shows_cache_status(context):
                trailers = [("x-cache", inferred.cache_status)]
                if inferred.tiers:
                    trailers.append(("x-cache-tier", inferred.tiers))
                context.set_trailing_metadata(tuple(trailers))
            metrics.REQUESTS.labels(protocol=PROTOCOL, status="OK").inc()
            metrics.REQUEST_SECONDS.labels(protocol=PROTOCOL, cache=inferred.cache_status).observe(
                time.perf_counter() - started
            )
            if span.recording:
                span.set("rpc.system", "grpc")
                span.set("ocr.protocol", PROTOCOL)
                span.set("ocr.model", model.name)
                if tenant:
                    span.set("ocr.tenant", tenant)
                span.set("ocr.cache", inferred.cache_status.lower())
                if inferred.tiers:
                    span.set("ocr.cache_tier", inferred.tiers)
            return response

    def _infer(
        self, request: Any, context: grpc.ServicerContext, tenant: str | None
    ) -> tuple[Model, Any, models.Inferred]:
        if isinstance(request, Undecodable):
            raise V2Error(f"not a ModelInferRequest ({request.reason})")
        model = kserve.find(request.model_name, request.model_version)
        settings = self._service.settings
        most = model.max_elements(settings.protocols.max_images_per_request)
        tensor = kserve.the_input(model, _inputs(request, most))
        kserve.requested_outputs(model, [o.name for o in request.outputs])

        def asked() -> CacheControls:
            trusted = self._gate.trusted(context)
            return controls.parse(metadata(context), settings.controls, trusted=trusted,
                                  tenant=tenant)  # fmt: skip

        try:
            inferred = models.infer(
                self._service, model, tensor, asked, self._gate.shows_cache_status(context)
            )
        except OcrCacheError as exc:  # a cache control the client got wrong
            raise models.protocol_error(exc) from None
        out = inferred.output
        response = pb2.ModelInferResponse(
            model_name=model.name,
            model_version=kserve.VERSION,
            id=request.id,
            outputs=[
                pb2.ModelInferResponse.InferOutputTensor(
                    name=out.name, datatype=out.datatype, shape=list(out.shape)
                )
            ],
            raw_output_contents=[kserve.encode_bytes(out.elements)],
        )
        return model, response, inferred

    @staticmethod
    def _fail(context: grpc.ServicerContext, exc: V2Error, span: tracing.Span) -> None:
        if exc.retry_after:
            context.set_trailing_metadata((("retry-after", str(exc.retry_after)),))
        metrics.REQUESTS.labels(protocol=PROTOCOL, status=exc.grpc_code).inc()
        if span.recording:
            span.set("ocr.protocol", PROTOCOL)
        context.abort(grpc.StatusCode[exc.grpc_code], str(exc))

    @staticmethod
    def _model(request: Any, context: grpc.ServicerContext) -> Model:
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request ({request.reason})")
        try:
            return kserve.find(request.name, request.version)
        except V2Error as exc:
            context.abort(grpc.StatusCode[exc.grpc_code], str(exc))
            raise  # not reached: abort raised


def _io(message: Any, spec: dict[str, Any]) -> Any:
    return message(
        name=spec["name"], data_type=config_pb2.DataType.Value(spec["data_type"]), dims=spec["dims"]
    )


def _inputs(request: Any, max_elements: int) -> list[Tensor]:
    """The request's tensors: BYTES from ``raw_input_contents`` (one entry an input, in
    order) when the client sent raw contents, else from ``contents.bytes_contents``; a shape
    of more than ``max_elements`` refused before its data is read."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise V2Error(
            f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: one an input"
        )
    tensors = []
    for index, given in enumerate(request.inputs):
        shape = kserve.checked_shape(given.name, list(given.shape))
        count = kserve.element_count(shape)
        if count > max_elements:
            raise V2Error(
                f"input '{given.name}': shape {list(shape)} holds more than {max_elements} elements"
            )
        if raw and given.HasField("contents"):
            raise V2Error(
                f"contents field must not be specified when using raw_input_contents for "
                f"'{given.name}'"
            )
        if given.datatype != kserve.BYTES:
            raise V2Error(
                f"input '{given.name}': datatype {given.datatype!r}; this server's models "
                "take BYTES"
            )
        if raw:
            elements = kserve.decode_bytes(raw[index], count, given.name)
        else:
            elements = list(given.contents.bytes_contents)
            if len(elements) != count:
                raise V2Error(
                    f"input '{given.name}': {len(elements)} bytes_contents, {count} in its "
                    f"shape {list(shape)}"
                )
        tensors.append(Tensor(given.name, given.datatype, shape, elements))
    return tensors


_METHODS: dict[str, tuple[Any, Any]] = {
    "ServerLive": (pb2.ServerLiveRequest, pb2.ServerLiveResponse),
    "ServerReady": (pb2.ServerReadyRequest, pb2.ServerReadyResponse),
    "ModelReady": (pb2.ModelReadyRequest, pb2.ModelReadyResponse),
    "ServerMetadata": (pb2.ServerMetadataRequest, pb2.ServerMetadataResponse),
    "ModelMetadata": (pb2.ModelMetadataRequest, pb2.ModelMetadataResponse),
    "ModelConfig": (pb2.ModelConfigRequest, pb2.ModelConfigResponse),
    "RepositoryIndex": (pb2.RepositoryIndexRequest, pb2.RepositoryIndexResponse),
    "ModelInfer": (pb2.ModelInferRequest, pb2.ModelInferResponse),
}


def add_to(server: grpc.Server, service: OcrService, gate: Gate) -> None:
    """The implemented methods, each request read by ``_reader`` (bad bytes are the client's
    error); a method not here is unknown to the server: ``UNIMPLEMENTED``."""
    servicer = InferenceServicer(service, gate)
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=_reader(request),
            response_serializer=response.SerializeToString,
        )
        for name, (request, response) in _METHODS.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
