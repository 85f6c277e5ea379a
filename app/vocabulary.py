"""The shared vocabulary, at the bottom of the layers: canonical request parameters, the
canonical OCR result every protocol renders from, the cache's per-request controls and
answer, and the exception root. It imports nothing from ``app``; everything else may import it.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

# Bump when the canonical result's shape or meaning changes: it is part of every key.
RESULT_SCHEMA_VERSION = 1

Point = tuple[int, int]
Word = tuple[str, tuple[int, int, int, int]]  # text, [x1, y1, x2, y2]


@dataclass(frozen=True)
class OcrParams:
    """Inference parameters that change the engine's output; they are part of the key.

    The recognition score threshold is not here: engines return every recognized line with
    its score and each protocol filters at render time, so one entry serves all thresholds.

    ``task`` names what the engine is asked for ("ocr": lines with boxes, PaddleOCR's only
    task); ``task_args`` are its normalised, sorted arguments (see ``app.engines.tasks``).
    """

    det_limit_side_len: int = 960
    det_limit_type: str = "max"
    det_thresh: float = 0.3
    det_box_thresh: float = 0.6
    det_unclip_ratio: float = 1.5
    textline_orientation: bool = False
    return_word_box: bool = False  # PaddleOCR's return_word_box: lines carry their words
    task: str = "ocr"
    task_args: tuple[tuple[str, str], ...] = ()

    def digest(self) -> str:
        return _params_digest(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe fields (a queued ticket's, a direct call's)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> OcrParams:
        """Back from ``to_dict``; ``TypeError``/``ValueError`` on another shape."""
        raw = dict(raw)
        raw["task_args"] = tuple(tuple(pair) for pair in raw.get("task_args", ()))
        return cls(**raw)

    def arg_values(self, name: str) -> tuple[str, ...]:
        """Every value of task argument ``name``, in order."""
        return tuple(value for key, value in self.task_args if key == name)


# The six detection parameters, one table: ``OcrParams`` field -> PaddleOCR's ``predict()``
# keyword. The other spellings derive from it: ``OCR_`` + the field upper-cased is the
# setting that gives its default (app/config.py), the keyword in camelCase is the PaddleX
# request field, and without ``text_det_`` it is the key PaddleX answers in
# ``text_det_params`` (app/protocols/paddlex.py).
DETECTION_PARAMS: dict[str, str] = {
    "det_limit_side_len": "text_det_limit_side_len",
    "det_limit_type": "text_det_limit_type",
    "det_thresh": "text_det_thresh",
    "det_box_thresh": "text_det_box_thresh",
    "det_unclip_ratio": "text_det_unclip_ratio",
    "textline_orientation": "use_textline_orientation",
}


@functools.lru_cache(maxsize=1024)
def _params_digest(params: OcrParams) -> str:
    """Memoized: it is on every request's path, and a handful of param sets recur."""
    items = asdict(params)
    if not params.return_word_box:  # hash as before the field existed
        del items["return_word_box"]
    if params.task == "ocr" and not params.task_args:
        # Hash exactly as before the task fields existed: existing entries stay valid.
        del items["task"], items["task_args"]
    canonical = repr(sorted(items.items()))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class OcrLine:
    text: str
    score: float
    box: tuple[Point, Point, Point, Point]  # clockwise from top-left, pixels
    angle: int = -1  # textline orientation class (0: 0°, 1: 180°), -1 when not classified
    words: tuple[Word, ...] = ()  # only when asked for (OcrParams.return_word_box)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "text": self.text,
            "score": self.score,
            "box": [list(p) for p in self.box],
            "angle": self.angle,
        }
        if self.words:
            data["words"] = [[text, list(box)] for text, box in self.words]
        return data


@dataclass(frozen=True)
class OcrResult:
    """Every detected line in reading order (top-to-bottom, left-to-right), unfiltered.

    ``text`` is the payload of text tasks (markdown, extraction JSON, translation); it is
    None for line tasks, whose answer is ``lines``.
    """

    width: int
    height: int
    lines: tuple[OcrLine, ...] = field(default_factory=tuple)
    text: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "width": self.width,
            "height": self.height,
            "lines": [line.to_dict() for line in self.lines],
        }
        if self.text is not None:
            data["text"] = self.text
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OcrResult:
        """Rebuild from ``to_dict`` output; raises on any shape it does not expect."""
        lines = []
        for raw in data["lines"]:
            (x1, y1), (x2, y2), (x3, y3), (x4, y4) = raw["box"]
            box = ((int(x1), int(y1)), (int(x2), int(y2)), (int(x3), int(y3)), (int(x4), int(y4)))
            if not isinstance(raw["text"], str):
                raise ValueError("malformed line")
            words = tuple(_word(item) for item in raw.get("words", ()))
            lines.append(OcrLine(raw["text"], float(raw["score"]), box, int(raw["angle"]), words))
        text = data.get("text")
        if text is not None and not isinstance(text, str):
            raise ValueError("malformed text")
        return cls(
            width=int(data["width"]), height=int(data["height"]), lines=tuple(lines), text=text
        )

    def filtered(self, min_score: float) -> tuple[OcrLine, ...]:
        return tuple(line for line in self.lines if line.score >= min_score)


def _word(item: Any) -> Word:
    text, (x1, y1, x2, y2) = item
    if not isinstance(text, str):
        raise ValueError("malformed word")
    return text, (int(x1), int(y1), int(x2), int(y2))


class OcrCacheError(Exception):
    """The root of this service's own errors: a handler catches this, then maps the class
    (a client error, an engine failure, load) to its protocol's answer through that
    protocol's error table. ``code`` is the short machine-readable reason the REST API
    answers with (its ``error.code``)."""

    code = "internal_error"


class ClientError(OcrCacheError, ValueError):
    """The request cannot be served as asked (a 4xx in every protocol); never cached."""

    code = "bad_request"


class EngineError(OcrCacheError, RuntimeError):
    """The engine could not produce a result for a valid image (never cached). HTTP answers
    carry ``Retry-After: retry_after`` (a failing engine is probed again within seconds)."""

    code = "engine_error"
    retry_after = 5


class EngineTimeout(EngineError):
    """The engine did not answer in time (never cached; 504, no Retry-After)."""

    code = "engine_timeout"
    retry_after = 0


class EngineBusy(EngineError):
    """The engine's queue is full: retry after ``retry_after`` seconds (never cached; load,
    not an engine failure). Raised by ``app.engine_calls.engine_runner``; here so that protocols
    can name it without importing the cache."""

    code = "engine_busy"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnavailable(EngineBusy):
    """A direct call (Redis down, ``no-cache``/``no-store``) found no engine process
    answering (within ``ENGINE_WAIT_SECONDS``, 0 by default): 503 + ``Retry-After`` in every
    HTTP protocol, gRPC UNAVAILABLE. A queued miss instead waits for an engine to start."""

    code = "engine_unavailable"


class Refused(OcrCacheError):
    """Who is asking, or how much they may ask, refuses the request before any work (4xx in
    every protocol's own form, never cached): ``status`` is its HTTP status."""

    status = 400
    retry_after = 0


class Unauthorized(Refused):
    """``AUTH=keys``: no API key, or one no tenant holds (401; gRPC UNAUTHENTICATED)."""

    code = "unauthorized"
    status = 401


class QuotaExceeded(Refused):
    """A tenant over one of its quotas (request rate, misses in flight, engine seconds per
    minute), or an address past its failed-key budget: 429 + ``Retry-After`` (gRPC
    RESOURCE_EXHAUSTED with ``retry-after``)."""

    code = "quota_exceeded"
    status = 429

    def __init__(self, message: str, retry_after: int, reason: str) -> None:
        super().__init__(message)
        self.retry_after = max(1, retry_after)
        self.reason = reason  # the rejections metric's label


class UnsupportedParams(ClientError):
    """The request asks for parameters this engine cannot honour (a client error)."""

    code = "unsupported_params"


# A tenant namespace's name (the tenant header, the admin purge's ``namespace``).
TENANT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class CacheStatus(StrEnum):
    HIT = "HIT"
    MISS = "MISS"
    COALESCED = "COALESCED"
    BYPASS = "BYPASS"


@dataclass(frozen=True)
class CacheControls:
    """Per-request controls (from ``Cache-Control``, ``X-Cache-TTL``, the tenant header or
    the protocol)."""

    bypass: bool = False  # neither read nor write (e.g. pipeline.profile)
    no_cache: bool = False  # do not read; recompute and refresh
    no_store: bool = False  # do not write
    ttl: int | None = None  # TTL override for writes, already bounded by the caller
    namespace: str = ""  # tenant namespace: its own keys, never shared
    trusted: bool = True  # may use shared-state controls (app/protocols/trust.py)
    similar: bool = True  # may be answered by the similarity tier (X-Cache-Similar: off)
    background: bool = False  # a document job's page: queued in its tenant's job lane


@dataclass(frozen=True)
class Outcome:
    result: OcrResult
    status: CacheStatus
    # Which tier answered a HIT ("l1", "l2"; later tiers add their own names), "" otherwise.
    # Rendered as ``X-Cache-Tier`` / gRPC ``x-cache-tier`` / the REST ``cache_tier`` field.
    tier: str = ""
    # What a "similar" hit adds: (header name, value) pairs, e.g. the source image's digest
    # and the similarity figures (app/cache/similarity.py).
    details: tuple[tuple[str, str], ...] = ()


def tiers_of(outcomes: Sequence[Outcome]) -> str:
    """The ``X-Cache-Tier`` value of a multi-image answer: the tiers that answered, sorted."""
    return ",".join(sorted({o.tier for o in outcomes if o.tier}))
