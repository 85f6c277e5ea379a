"""Paddle Serving pipeline semantics shared by HTTP (``POST /{name}/{method}``) and gRPC
(``PipelineService/inference``): parse (request fields -> images) -> one cache call -> render
(the pdserving answer, docs/PROTOCOLS.md §1-3), with upstream's ``err_no`` codes and messages;
which error gets which ``err_no`` is the two tables below."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from app.protocols import pdserving
from app.protocols.b64 import decode_base64
from app.protocols.errors import BadRequest, lookup
from app.vocabulary import (
    CacheControls,
    ClientError,
    EngineBusy,
    EngineError,
    EngineTimeout,
    OcrCacheError,
    OcrParams,
    Outcome,
    Refused,
    tiers_of,
)

log = logging.getLogger(__name__)

OK = 0
SERVICE_NAME_ERROR = 3002
INPUT_PARAMS_ERROR = 5000
TIMEOUT = 6000
TYPE_ERROR = 7000
PACKING_ERROR = 8000
UNKNOWN_ERROR = 10000

SERVICE_NAME_MESSAGE = "Failed to inference: Service name error."
PROFILE_KEY = "pipeline.profile"
IMAGE_KEY = "image"
TENSOR_STRING = 12
TENSOR_BYTES = 13  # np.load(allow_pickle=True) upstream: refused, never unpickled


class PipelineError(OcrCacheError):
    """An answer with upstream's ``err_no`` (a refused request, or a failed inference)."""

    def __init__(self, err_no: int, message: str) -> None:
        super().__init__(message)
        self.err_no = err_no


# Refusals before the cache (the request's fields, the cache-control headers) -> err_no;
# a PipelineError carries its own.
PARSE_ERRORS: dict[type[Exception], int] = {BadRequest: INPUT_PARAMS_ERROR}
# Failures of the cache call -> (err_no, the op's function its message names). EngineBusy
# (overload) and Refused (a tenant's quota) are not here: the transport answers them (HTTP
# 503/429, gRPC RESOURCE_EXHAUSTED).
CALL_ERRORS: dict[type[Exception], tuple[int, str]] = {
    ClientError: (UNKNOWN_ERROR, "preprocess"),  # base64, InvalidImage, UnsupportedParams
    EngineTimeout: (TIMEOUT, "process"),
    EngineError: (UNKNOWN_ERROR, "process"),
}
_CALL_FAILURES: tuple[type[Exception], ...] = (PipelineError, *CALL_ERRORS)


class Lookup(Protocol):
    """What the pipeline needs of the cache front door (``app.cache.region.OcrCache``)."""

    def get_or_compute_many(
        self, images: Sequence[bytes], params: OcrParams | None = ..., controls: CacheControls = ...
    ) -> list[Outcome]: ...


@dataclass
class PipelineRequest:
    images: list[tuple[str, str]] = field(default_factory=list)  # (key, base64 text)
    logid: int = 0
    clientip: str = ""
    profile: bool = False


@dataclass
class PipelineAnswer:
    err_no: int = OK
    err_msg: str = ""
    keys: list[str] = field(default_factory=list)
    values: list[str] = field(default_factory=list)
    cache_status: str = "none"
    cache_tier: str = ""  # the tiers that answered the hits (``vocabulary.tiers_of``)


@dataclass(frozen=True)
class Tensor:
    """The fields of a pipeline Tensor we read (from JSON or protobuf)."""

    name: Any
    elem_type: Any
    str_data: Any


def op_error(logid: int, message: str, function: str = "preprocess") -> str:
    """An exception message in the form upstream's ops produce."""
    return f"Log_id: {logid}  Raise_msg: {message}  ClassName: DetOp  FunctionName: {function}"


def build_request(
    keys: Any, values: Any, tensors: Iterable[Tensor], logid: Any, clientip: Any
) -> PipelineRequest:
    req = PipelineRequest()
    try:
        req.logid = int(logid or 0)
    except (TypeError, ValueError, OverflowError):  # OverflowError: a float infinity
        raise PipelineError(TYPE_ERROR, "logid must be an integer") from None
    req.clientip = str(clientip or "")[:64]
    if not isinstance(keys, Sequence) or not isinstance(values, Sequence):
        raise PipelineError(TYPE_ERROR, "key and value must be lists of strings")
    if isinstance(keys, str) or isinstance(values, str):
        raise PipelineError(TYPE_ERROR, "key and value must be lists of strings")
    if len(values) < len(keys):
        raise PipelineError(
            PACKING_ERROR, f"Failed to unpack request: {len(keys)} keys but {len(values)} values"
        )
    pairs: list[tuple[Any, Any]] = list(zip(keys, values[: len(keys)], strict=True))
    pairs.extend(_tensor_pairs(tensors))
    for key, value in pairs:
        if not isinstance(key, str) or not isinstance(value, str):
            raise PipelineError(TYPE_ERROR, "key and value must be lists of strings")
        if key == PROFILE_KEY:
            req.profile = value == "1"
        else:
            req.images.append((key, value))
    if any(key == IMAGE_KEY for key, _ in req.images):
        # PaddleOCR's pdserving reads the "image" feed and ignores every other key.
        req.images = [(key, value) for key, value in req.images if key == IMAGE_KEY]
    if not req.images:
        raise PipelineError(
            INPUT_PARAMS_ERROR, op_error(req.logid, "no image in request (key 'image')")
        )
    return req


def _tensor_pairs(tensors: Iterable[Tensor]) -> list[tuple[Any, Any]]:
    pairs = []
    for tensor in tensors:
        if tensor.elem_type == TENSOR_BYTES:
            raise PipelineError(
                TYPE_ERROR, "elem_type 13 (pickled bytes) is not accepted; send elem_type 12"
            )
        if tensor.elem_type != TENSOR_STRING:
            raise PipelineError(TYPE_ERROR, f"elem_type {tensor.elem_type!r} is not an image")
        pieces = tensor.str_data
        if not isinstance(pieces, Sequence) or not all(isinstance(p, str) for p in pieces):
            raise PipelineError(TYPE_ERROR, "str_data must be a list of strings")
        pairs.append((tensor.name, "".join(pieces)))  # elem_type 12: pieces concatenated
    return pairs


def response_keys(req: PipelineRequest) -> list[str]:
    """One image answers under ``result`` (pdserving); several answer under their own keys."""
    if len(req.images) == 1:
        return ["result"]
    return [key for key, _ in req.images]


def service_name_error() -> PipelineAnswer:
    return PipelineAnswer(err_no=SERVICE_NAME_ERROR, err_msg=SERVICE_NAME_MESSAGE)


def refused(exc: PipelineError | BadRequest) -> PipelineAnswer:
    """The answer to a request refused before the cache (``PARSE_ERRORS``)."""
    if isinstance(exc, PipelineError):
        return PipelineAnswer(err_no=exc.err_no, err_msg=str(exc))
    return PipelineAnswer(err_no=lookup(PARSE_ERRORS, exc) or UNKNOWN_ERROR, err_msg=str(exc))


def answer(
    cache: Lookup,
    req: PipelineRequest,
    min_score: float,
    max_images: int,
    controls: CacheControls = CacheControls(),
) -> PipelineAnswer:
    """Parse -> cache -> render for a parsed request; errors come back as ``err_no``
    (``CALL_ERRORS``), except ``EngineBusy`` and ``Refused``, raised for the transport to
    answer."""
    try:
        images = decode_images(req, max_images)
        started = time.perf_counter()
        outcomes = cache.get_or_compute_many(images, controls=controls_for(req, controls))
    except (EngineBusy, Refused):
        raise
    except _CALL_FAILURES as exc:
        failed = failure(req, exc)
        log.info("pipeline logid=%s clientip=%s err_no=%s", req.logid, req.clientip, failed.err_no)
        return failed
    return render(req, outcomes, min_score, started)


def decode_images(req: PipelineRequest, max_images: int) -> list[bytes]:
    """The request's images as bytes; ``PipelineError`` over the limit, ``BadRequest`` for
    bad base64."""
    if len(req.images) > max_images:
        raise PipelineError(
            INPUT_PARAMS_ERROR,
            op_error(req.logid, f"{len(req.images)} images, over the limit of {max_images}"),
        )
    return [decode_base64(text, strict=False) for _, text in req.images]


def controls_for(req: PipelineRequest, controls: CacheControls) -> CacheControls:
    """``pipeline.profile`` bypasses the cache, for trusted callers (a shared-state control)."""
    profile = req.profile and controls.trusted
    return replace(controls, bypass=controls.bypass or profile)


def failure(req: PipelineRequest, exc: Exception) -> PipelineAnswer:
    """The answer to a failed cache call: a PipelineError's own ``err_no``, else the row of
    ``CALL_ERRORS`` and the message in upstream's op form."""
    if isinstance(exc, PipelineError):
        return PipelineAnswer(err_no=exc.err_no, err_msg=str(exc))
    err_no, function = lookup(CALL_ERRORS, exc) or (UNKNOWN_ERROR, "process")
    return PipelineAnswer(err_no=err_no, err_msg=op_error(req.logid, str(exc), function))


def render(
    req: PipelineRequest, outcomes: Sequence[Outcome], min_score: float, started: float
) -> PipelineAnswer:
    """The pdserving answer: one result string per image (lines at or over ``min_score``),
    plus the time taken when the request asked for ``pipeline.profile``."""
    keys = response_keys(req)
    values = [pdserving.result_string(o.result, min_score) for o in outcomes]
    status = ",".join(sorted({o.status.value for o in outcomes}))
    if req.profile:
        keys.append(PROFILE_KEY)
        values.append(f"total_ms:{(time.perf_counter() - started) * 1000:.3f}")
    log.debug("pipeline logid=%s clientip=%s cache=%s", req.logid, req.clientip, status)
    return PipelineAnswer(
        keys=keys, values=values, cache_status=status, cache_tier=tiers_of(outcomes)
    )
