"""The engine contract (``Engine``, ``EngineBase``, ``OcrRequest``); the parameters, the
result and the errors it speaks in are the shared vocabulary (``app.vocabulary``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Protocol

from app.imaging import DecodedImage
from app.vocabulary import OcrParams, OcrResult


@dataclass(frozen=True)
class LineUse:
    """What one request lets line reuse (``CACHE_LINES``) do, from its cache controls
    (``app/cache/compute.py``): ``read`` stored readings (not with ``no-cache``, nor when the
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
    """What every engine shares: ``__init__`` sets ``_fingerprint`` and ``_default_params``."""

    kind: str
    _fingerprint: str
    _default_params: OcrParams

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def default_params(self) -> OcrParams:
        return self._default_params

    def prepare(self) -> None:
        """Nothing to do in the main thread unless an engine says otherwise."""


class Engine(Protocol):
    """What the cache needs from an OCR engine."""

    kind: str

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
