"""The engine contract and the canonical OCR result every protocol renders from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

# Bump when the canonical result's shape or meaning changes: it is part of every key.
RESULT_SCHEMA_VERSION = 1

Point = tuple[int, int]


@dataclass(frozen=True)
class OcrLine:
    text: str
    score: float
    box: tuple[Point, Point, Point, Point]  # clockwise from top-left, pixels

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "score": self.score, "box": [list(p) for p in self.box]}


@dataclass(frozen=True)
class OcrResult:
    """One image's recognized lines, in reading order (top-to-bottom, left-to-right)."""

    width: int
    height: int
    lines: tuple[OcrLine, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "width": self.width,
            "height": self.height,
            "lines": [line.to_dict() for line in self.lines],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OcrResult:
        """Rebuild from ``to_dict`` output; raises on any shape it does not expect."""
        lines = []
        for raw in data["lines"]:
            box = tuple((int(p[0]), int(p[1])) for p in raw["box"])
            if len(box) != 4 or not isinstance(raw["text"], str):
                raise ValueError("malformed line")
            lines.append(OcrLine(text=raw["text"], score=float(raw["score"]), box=box))  # type: ignore[arg-type]
        return cls(width=int(data["width"]), height=int(data["height"]), lines=tuple(lines))


class EngineError(RuntimeError):
    """The engine could not produce a result for a valid image (never cached)."""


class Engine(Protocol):
    """What the cache needs from an OCR engine."""

    kind: str

    @property
    def fingerprint(self) -> str:
        """Short digest of everything that changes the output (models, params, schema)."""

    def describe(self) -> dict[str, Any]:
        """Public, JSON-safe description (kind, models, params, fingerprint)."""

    def prepare(self) -> None:
        """Cheap set-up that must run in the main thread (e.g. runtime imports)."""

    def load(self) -> None:
        """Load models and run one warm-up inference; idempotent."""

    def recognize(self, image: Any) -> OcrResult:
        """OCR one decoded RGB image (a ``DecodedImage``)."""
