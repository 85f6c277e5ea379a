"""HunyuanOCR answers -> canonical results, and the output hygiene the model card asks for.

- Repetition: greedy decoding can get stuck repeating its tail; the card trims a suffix
  repeated 10+ times (``clean_repeated_substrings``, applied to long outputs). We do the same,
  and drop exact duplicate spotting lines (same text, same box), which only a loop produces.
- Normalisation: NFC, ``\\n`` line ends, no trailing spaces, no surrounding blank lines. Not
  NFKC: it would rewrite the full-width CJK punctuation the model emits on purpose.
- Code fences around JSON are stripped; anything that then does not parse for its task raises
  ``UnparseableOutput`` (the engine reports an error, nothing is cached).
- Spotting coordinates are normalised to 0..1000 of the image the model saw; they become
  pixels as the card's ``denormalize_coordinates`` does (``int(v * size / 1000)``).
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Sequence
from typing import Any

import orjson

from app.engines.tasks import extraction_text, normalise_key
from app.vocabulary import OcrCacheError, OcrLine

# The model gives no per-line confidence; every spotted line scores 1.0.
SPOTTING_SCORE = 1.0
NORMALISED_MAX = 1000

_NUMBER = r"(-?\d+(?:\.\d+)?)"
# 1.0 form: each text followed by (x1,y1),(x2,y2).
_TEXT_FORM_BOX = re.compile(
    rf"\(\s*{_NUMBER}\s*,\s*{_NUMBER}\s*\)\s*,\s*\(\s*{_NUMBER}\s*,\s*{_NUMBER}\s*\)"
)
_FENCE = re.compile(r"^```(?P<label>[A-Za-z0-9_-]*)[ \t]*\n(?P<body>.*?)\n?```$", re.DOTALL)


class UnparseableOutput(OcrCacheError, ValueError):
    """The model's answer is not what its task asks for."""


def strip_repeated_tail(text: str, min_repeats: int = 10, min_chars: int = 2000) -> str:
    """The card's repetition guard: keep one copy of a suffix repeated ``min_repeats``+ times.

    Like the card, only outputs of ``min_chars`` or more are touched: short outputs cannot
    have looped long, and legitimate short repeats (dot leaders, rules) must survive.
    """
    n = len(text)
    if n < min_chars:
        return text
    for length in range(2, n // min_repeats + 1):
        unit = text[-length:]
        count, i = 0, n - length
        while i >= 0 and text[i : i + length] == unit:
            count += 1
            i -= length
        if count >= min_repeats:
            return text[: n - length * (count - 1)]
    return text


def strip_fence(text: str, labels: frozenset[str] | None = None) -> str:
    """The body of one code fence around the whole text (```json ... ```), else ``text``;
    with ``labels``, only fences labelled one of them."""
    match = _FENCE.match(text.strip())
    if match and (labels is None or match.group("label").lower() in labels):
        return match.group("body").strip()
    return text.strip()


def clean_text(text: str) -> str:
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")
    return strip_repeated_tail(text).strip()


def _coordinate(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UnparseableOutput("spotting coordinate is not a number")
    return min(float(NORMALISED_MAX), max(0.0, float(value)))


def to_pixels(x: float, y: float, width: int, height: int) -> tuple[int, int]:
    """A 0..1000 normalised point in pixels of a ``width`` x ``height`` image."""
    return (
        min(width, max(0, int(x * width / NORMALISED_MAX))),
        min(height, max(0, int(y * height / NORMALISED_MAX))),
    )


def _line(text: str, corners: Sequence[Any], width: int, height: int) -> OcrLine:
    x1, y1, x2, y2 = (_coordinate(v) for v in corners)
    left, right = sorted((x1, x2))
    top, bottom = sorted((y1, y2))
    (px1, py1), (px2, py2) = (
        to_pixels(left, top, width, height),
        to_pixels(right, bottom, width, height),
    )
    box = ((px1, py1), (px2, py1), (px2, py2), (px1, py2))  # clockwise from top-left
    return OcrLine(text, SPOTTING_SCORE, box)


def _json_form(body: str, width: int, height: int) -> list[OcrLine]:
    try:
        items = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise UnparseableOutput("spotting answer is not valid JSON") from None
    if not isinstance(items, list):
        raise UnparseableOutput("spotting answer is not a JSON array")
    lines = []
    for item in items:
        if not isinstance(item, dict):
            raise UnparseableOutput("spotting item is not an object")
        box, text = item.get("box"), item.get("text")
        if not isinstance(text, str) or not isinstance(box, list) or len(box) != 4:
            raise UnparseableOutput("spotting item needs 'box' [4 numbers] and 'text'")
        lines.append(_line(clean_text(text), box, width, height))
    return lines


def _text_form(body: str, width: int, height: int) -> list[OcrLine]:
    lines, start = [], 0
    for match in _TEXT_FORM_BOX.finditer(body):
        text = clean_text(body[start : match.start()])
        start = match.end()
        lines.append(_line(text, [float(v) for v in match.groups()], width, height))
    if body[start:].strip():
        raise UnparseableOutput("spotting answer has text without coordinates")
    return lines


def parse_spotting(raw: str, width: int, height: int) -> tuple[OcrLine, ...]:
    """Lines with pixel boxes from either spotting form (1.5 JSON array or 1.0 text form)."""
    body = strip_fence(clean_text(raw))
    lines = (
        _json_form(body, width, height) if body.startswith("[") else _text_form(body, width, height)
    )
    unique: dict[tuple[str, tuple[tuple[int, int], ...]], OcrLine] = {}
    for line in lines:
        if line.text:
            unique.setdefault((line.text, line.box), line)
    return tuple(sort_lines(list(unique.values())))


def sort_lines(lines: list[OcrLine]) -> list[OcrLine]:
    """PaddleOCR's reading order (``sorted_boxes``): by top-left y then x, and lines whose
    tops are within 10 px are ordered left to right."""
    ordered = sorted(lines, key=lambda line: (line.box[0][1], line.box[0][0]))
    for i in range(len(ordered) - 1):
        for j in range(i, -1, -1):
            a, b = ordered[j].box[0], ordered[j + 1].box[0]
            if abs(b[1] - a[1]) < 10 and b[0] < a[0]:
                ordered[j], ordered[j + 1] = ordered[j + 1], ordered[j]
            else:
                break
    return ordered


def parse_extraction(raw: str, fields: Sequence[str]) -> str:
    """The canonical JSON object of exactly ``fields`` (null where the model gave none)."""
    body = strip_fence(clean_text(raw))
    try:
        found = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise UnparseableOutput("extraction answer is not valid JSON") from None
    if not isinstance(found, dict):
        raise UnparseableOutput("extraction answer is not a JSON object")
    values = {normalise_key(str(key)): _clean_value(value) for key, value in found.items()}
    return extraction_text({field: values.get(field) for field in fields})


def _clean_value(value: Any) -> Any:
    if isinstance(value, str):
        return unicodedata.normalize("NFC", value).strip()
    if isinstance(value, list):
        return [_clean_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _clean_value(v) for k, v in value.items()}
    return value


def parse_text(raw: str) -> str:
    """Markdown or translated text: cleaned; a markdown fence around the whole answer goes
    (a fence of another language is content and stays)."""
    return strip_fence(clean_text(raw), frozenset({"markdown", "md"}))
