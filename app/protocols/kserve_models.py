"""The Open Inference Protocol's models at work (``app/protocols/kserve.py``), for both
transports (HTTP: ``app/routes/kserve.py``; gRPC: ``app/grpc_kserve.py``).

``ocr`` runs each body through ``POST /ocr``'s own call (``paddlex_serve.serve``), so its
answer is that endpoint's, byte for byte but the ``logId``; ``ocr-image`` runs its images
through the cache as ``POST /v1/ocr`` does and renders each as that endpoint does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from app.engines.tasks import task_params
from app.imaging import decode_image
from app.protocols import kserve, paddlex_serve, rest
from app.protocols.errors import lookup
from app.protocols.kserve import Model, Tensor, V2Error
from app.vocabulary import (
    CacheControls,
    ClientError,
    EngineBusy,
    EngineError,
    EngineTimeout,
    OcrCacheError,
    QuotaExceeded,
    Refused,
    Unauthorized,
    tiers_of,
)

if TYPE_CHECKING:
    from app.service import OcrService

# What the cache raises -> the protocol's status (``kserve.GRPC_CODES`` for gRPC).
ERRORS: dict[type[OcrCacheError], int] = {
    ClientError: 400,
    Unauthorized: 401,
    QuotaExceeded: 429,
    Refused: 400,
    EngineBusy: 503,
    EngineTimeout: 504,
    EngineError: 503,
}


def protocol_error(exc: OcrCacheError) -> V2Error:
    """A cache error as the protocol's, with its ``Retry-After`` where it has one."""
    if isinstance(exc, V2Error):
        return exc
    status = lookup(ERRORS, exc) or 500
    retry = exc.retry_after if isinstance(exc, EngineError | Refused) else 0
    return V2Error(str(exc), status, retry)


class Inferred:
    """A model's answer: its output tensor, the cache status (``hit``, ``miss``, a comma
    list for several images) and tiers."""

    def __init__(self, output: Tensor, cache_status: str, tiers: str) -> None:
        self.output = output
        self.cache_status = cache_status
        self.tiers = tiers


def infer(
    service: OcrService,
    model: Model,
    tensor: Tensor,
    controls: Callable[[], CacheControls],
    show_cache: bool,
) -> Inferred:
    """Run ``model`` on its checked input; raises ``V2Error`` for what the protocol answers
    itself (bad input for ``ocr-image``, load, quotas, keys)."""
    if model is kserve.PADDLEX_OCR:
        return _paddlex(service, model, tensor, controls)
    return _images(service, model, tensor, controls, show_cache)


def _paddlex(
    service: OcrService, model: Model, tensor: Tensor, controls: Callable[[], CacheControls]
) -> Inferred:
    """Each element a basic-serving body; its envelope whatever its ``errorCode`` (422 for
    a request that fails validation, 500 inside), as PaddleX's HPS server answers; what the
    service refuses before any work (keys, quotas, load) is the protocol's error."""
    bodies, statuses, tiers = [], set(), []
    for index, element in enumerate(tensor.elements):
        try:
            element.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise V2Error(f"input '{tensor.name}' element {index}: not UTF-8 ({exc})") from None
        served = paddlex_serve.serve(service, element, controls)
        if isinstance(served.error, EngineBusy | Refused):
            raise protocol_error(served.error)
        bodies.append(served.body)
        statuses.update(served.cache_status.split(","))
        tiers.append(served.tiers)
    status = ",".join(sorted(statuses - {"none"})) or "none"
    return Inferred(
        kserve.output(model, tensor.shape, bodies), status, ",".join(filter(None, tiers))
    )


def _images(
    service: OcrService,
    model: Model,
    tensor: Tensor,
    controls: Callable[[], CacheControls],
    show_cache: bool,
) -> Inferred:
    """Each element an encoded image and its own cache entry; one that cannot be read fails
    the request, naming its index."""
    settings = service.settings
    images = tensor.elements
    if len(images) > settings.protocols.max_images_per_request:
        raise V2Error(
            f"input '{tensor.name}': {len(images)} images, at most "
            f"{settings.protocols.max_images_per_request} a request (MAX_IMAGES_PER_REQUEST)"
        )
    for index, image in enumerate(images):
        if not image:
            raise V2Error(f"input '{tensor.name}' element {index}: empty, not an image")
    try:
        asked = controls()  # a bad control header is not an image's fault
        params = task_params(
            service.default_params, service.default_task, None, None,
            settings.hunyuan.target_language,
        )  # fmt: skip
    except OcrCacheError as exc:
        raise protocol_error(exc) from None
    try:
        outcomes = service.cache.get_or_compute_many(images, params, asked)
    except ClientError as exc:
        raise _which_image(tensor, exc, settings.server.max_image_pixels) from None
    except OcrCacheError as exc:
        raise protocol_error(exc) from None
    rendered = [
        rest.render(o, service.engine_description, service.min_score, params.task, show_cache)
        for o in outcomes
    ]
    status = ",".join(sorted({o.status.value for o in outcomes}))
    return Inferred(kserve.output(model, tensor.shape, rendered), status, tiers_of(outcomes))


def _which_image(tensor: Tensor, exc: ClientError, max_pixels: int) -> V2Error:
    """The request's error names the first element that cannot be read (only this error
    path decodes the images again)."""
    for index, image in enumerate(tensor.elements):
        try:
            decode_image(image, max_pixels)
        except ClientError as found:
            return V2Error(f"input '{tensor.name}' element {index}: {found}")
    return V2Error(f"input '{tensor.name}': {exc}")
