"""Line reuse (``CACHE_LINES``): the small interface through which an engine asks a store for
the readings of text-line crops it has seen before, and the reading's stored form.

The interface lives here, below the cache, so the engines stay below the cache layer: the
engine knows crops, their digests and what else reaches its recognizer (the ``context``);
the store (``app/cache/lines.py``, wired in ``app/cache/assembly.py``) knows Redis, the
key space (prefix, tenant namespace, engine fingerprint with the redaction policy) and the
sealing. A reading is JSON; anything that does not decode to exactly the reading's shape,
with every part consistent with the others, is a miss (``decode_reading`` answers None),
never an error. A store that raises is a miss too: the engine guards every store call.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import orjson

# The format of a line's context and reading (``paddle_lines``, below): part of every line
# key, so a change of either never serves a reading stored in the old one. Bump it then.
LINE_FORMAT = "line1"


@dataclass(frozen=True)
class LineId:
    """One crop as the recognizer receives it: ``digest``, the SHA-256 (hex) of its shape,
    type and pixels; ``context``, everything else that reaches recognition (the output form
    and the padded batch width; ``app/engines/paddle_lines.py``)."""

    digest: str
    context: str


class LineStore(Protocol):
    """Where readings are kept (the cache's side: ``app/cache/lines.py``). Any method may
    raise: the engine takes a failed ``fetch`` for misses and a failed ``keep`` for nothing
    stored, and counts it (``fault``)."""

    def fetch(self, namespace: str, lines: Sequence[LineId]) -> list[bytes | None]:
        """The stored reading of each line (verified and opened), or None."""

    def keep(
        self, namespace: str, lines: Sequence[tuple[LineId, bytes]], ttl: int | None = None
    ) -> None:
        """Store readings, each for the line TTL or ``ttl`` if shorter (best effort: a
        failure costs a later recognition, nothing else)."""

    def count(self, reused: int, recognized: int) -> None:
        """One page's crops: answered from the store, sent to the recognizer."""

    def fault(self, what: str) -> None:
        """Something failed and was worked around: ``fetch`` (its lines recognised),
        ``keep`` (nothing stored), ``page`` (the page computed again with reuse off)."""


def crop_digest(crop: np.ndarray) -> str:
    """SHA-256 of a crop's shape, element type and pixels: one pixel differs, it differs."""
    crop = np.ascontiguousarray(crop)
    head = f"{'x'.join(map(str, crop.shape))}:{crop.dtype.str}:".encode()
    return hashlib.sha256(head + crop.tobytes()).hexdigest()


# A reading is what the recognizer answers for one crop: its text, its score and, when word
# boxes are asked for, PaddleX's word information for that crop ([column count, words as
# lists of characters, their column positions, their kinds]).
Reading = tuple[str, float, list[Any] | None]

# The kinds of word PaddleX's CTC decode groups characters into (``get_word_info``).
_KINDS = frozenset(("cn", "en&num", "symbol"))


def encode_reading(reading: Reading) -> bytes:
    text, score, words = reading
    return orjson.dumps([text, score] if words is None else [text, score, words])


def decode_reading(value: Any, with_words: bool) -> Reading | None:
    """The reading, or None when ``value`` is not exactly one (damaged, forged, other form).

    Checked strictly, since a reading goes on into PaddleX's own code (word boxes divide by
    the column count and index each word's positions): a score in [0, 1]; with word boxes a
    column count above 0, words of one or more characters whose concatenation is the text,
    one position per character, ascending from 0 or more, and known kinds (every reading of
    the corpus is of this form: ``make lines-exact`` finds each again)."""
    if not isinstance(value, bytes):
        return None
    try:
        item = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(item, list) or len(item) != (3 if with_words else 2):
        return None
    text, score = item[0], item[1]
    if not isinstance(text, str) or type(score) is not float or not 0.0 <= score <= 1.0:
        return None
    if not with_words:
        return text, score, None
    words = item[2]
    return (text, score, words) if _is_word_info(words, text) else None


def _is_word_info(words: Any, text: str) -> bool:
    if not isinstance(words, list) or len(words) != 4:
        return False
    columns, groups, positions, kinds = words
    if type(columns) is not float or not math.isfinite(columns) or columns <= 0.0:
        return False
    if not (
        _list_of(groups, lambda g: _list_of(g, lambda c: isinstance(c, str) and len(c) == 1))
        and _list_of(positions, lambda p: _list_of(p, lambda c: type(c) is int))
        and _list_of(kinds, lambda k: isinstance(k, str) and k in _KINDS)
        and len(groups) == len(positions) == len(kinds)
        and all(g and len(g) == len(p) for g, p in zip(groups, positions, strict=True))
    ):
        return False
    if "".join(c for group in groups for c in group) != text:
        return False
    # Positions are columns of the padded batch, so a character decoded in a crop's padding
    # lies past its own (scaled) column count (2 crops of donut_cord_receipt_00004.png with
    # word boxes): ascending and not negative, no upper bound (PaddleX only multiplies them).
    flat = [p for group in positions for p in group]
    ascending = all(a < b for a, b in zip(flat, flat[1:], strict=False))
    return ascending and (not flat or flat[0] >= 0)


def _list_of(value: Any, check: Any) -> bool:
    return isinstance(value, list) and all(check(item) for item in value)


def texts_of(reading: Reading) -> list[str]:
    """Every string a reading holds (what a redaction policy must leave unchanged)."""
    text, _, words = reading
    found = [text]
    if words is not None:
        found += ["".join(group) for group in words[1]] + [c for g in words[1] for c in g]
    return found
