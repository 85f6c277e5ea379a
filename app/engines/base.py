"""The engine contract (``Engine``, ``EngineBase``, ``OcrRequest``); the parameters, the
result and the errors it speaks in are the shared vocabulary (``app.vocabulary``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from app.imaging import DecodedImage
from app.vocabulary import OcrParams, OcrResult

if TYPE_CHECKING:
    from app.engines.lines import LineStore

T = TypeVar("T")


@dataclass(frozen=True)
class LineUse:
    """What one request lets line reuse (``CACHE_LINES``) do, from its cache controls
    (``app/engine_calls/compute.py``): ``read`` stored readings (not with ``no-cache``, nor when the
    cache is bypassed), ``write`` new ones (not with ``no-store``, nor when bypassed), and
    keep them at most ``ttl`` seconds (``X-Cache-TTL``; None: the line TTL)."""

    read: bool = True
    write: bool = True
    ttl: int | None = None

    @property
    def off(self) -> bool:
        return not (self.read or self.write)


@dataclass(frozen=True)
class OcrRequest:
    """One image to recognize: its original bytes (what remote engines send on) and pixels;
    ``namespace``, its tenant's (line reuse keeps each tenant's crops apart); ``lines``,
    what line reuse may do for it (engines without line reuse ignore both)."""

    data: bytes
    image: DecodedImage
    params: OcrParams
    namespace: str = ""
    lines: LineUse = LineUse()


def fingerprint_of(identity: dict[str, Any]) -> str:
    """16 hex digits of SHA-256 over the canonical JSON of what shapes an engine's output."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


class EngineBase:
    """What every engine shares: ``__init__`` sets ``_fingerprint`` and ``_default_params``;
    the capabilities default to the plainest engine's (one call at a time per caller, no
    batching, no pausing, no line reuse)."""

    kind: str
    _fingerprint: str
    _default_params: OcrParams
    slots: int | None = None
    batching = False
    reads_decoded_pixels = False
    can_interject = False
    reuses_lines = False
    line_schema = ""

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def default_params(self) -> OcrParams:
        return self._default_params

    def prepare(self) -> None:
        """Nothing to do in the main thread unless an engine says otherwise."""

    def recognize(self, request: OcrRequest) -> OcrResult:
        raise NotImplementedError

    def recognize_many(self, requests: list[OcrRequest]) -> list[OcrResult]:
        """One call per image (an engine that is ``batching`` makes it one call)."""
        return [self.recognize(request) for request in requests]

    def interject(self, call: Callable[[], T]) -> Future[T]:
        """``call()`` now, on the caller's thread: an engine that cannot pause its calls."""
        future: Future[T] = Future()
        try:
            future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - the future carries it to its reader
            future.set_exception(exc)
        return future

    def use_line_store(
        self, store: LineStore | None, storable: Callable[[str], bool] = lambda text: True
    ) -> None:
        """Nothing: an engine that ``reuses_lines`` takes the store."""


class Engine(Protocol):
    """What the cache needs from an OCR engine: one contract every engine implements
    (``EngineBase`` gives the defaults). The capabilities are read, never probed."""

    kind: str
    slots: int | None  # calls that run at once (1: serialised on one thread; None: callers')
    batching: bool  # ``recognize_many`` is one call over the list (``ENGINE_BATCH_MAX``)
    reads_decoded_pixels: bool  # recognizes the decoded pixels: the pixel tier is exact
    can_interject: bool  # ``interject`` runs a call inside a pause of the call in progress
    reuses_lines: bool  # ``use_line_store`` turns line reuse on (``CACHE_LINES``)
    line_schema: str  # part of every line key besides the fingerprint ("": no line reuse)

    @property
    def fingerprint(self) -> str:
        """Short digest of everything besides the params that changes the output."""

    @property
    def default_params(self) -> OcrParams:
        """The parameters used when a request names none."""

    def describe(self) -> dict[str, Any]:
        """Public, JSON-safe description (kind, models, params, fingerprint)."""

    def check_params(self, params: OcrParams) -> None:
        """Raise ``UnsupportedParams`` if this engine cannot honour ``params``."""

    def prepare(self) -> None:
        """Cheap set-up that must run in the main thread (e.g. runtime imports)."""

    def load(self) -> None:
        """Load models and run one warm-up inference; idempotent."""

    def recognize(self, request: OcrRequest) -> OcrResult:
        """OCR one image."""

    def recognize_many(self, requests: list[OcrRequest]) -> list[OcrResult]:
        """OCR several images with one set of parameters; results in order."""

    def interject(self, call: Callable[[], T]) -> Future[T]:
        """``call()`` at the next pause of the call in progress (at once when idle)."""

    def use_line_store(
        self, store: LineStore | None, storable: Callable[[str], bool] = ...
    ) -> None:
        """Line reuse on (a store) or off (None); ``storable``: which texts may be kept."""
