"""The compact canonical result: what a cache entry stores since envelope version 2.

``[width, height, lines, text, float32]``, each line ``[text, score, [x1, y1, .. x4, y4],
angle]`` plus ``[[word, x1, y1, x2, y2], ...]`` when it has word boxes. Coordinates are
integers (the engines produce whole pixels). When every score is a float32 value - the
local engines' are (Paddle's ``rec_scores`` are float32, and upstream prints that value) -
``float32`` is 1 and each score is stored as the shortest decimal that reads back as the same
float32: 0.9987654 rather than 0.9987654089927673, and reading it back through float32 gives
the exact double the engine returned. Otherwise (e.g. scores parsed from a remote Paddle
Serving answer) ``float32`` is 0 and scores are stored as they are. Either way nothing a
protocol renders is lost: ``unpack(pack(r)) == r`` (tests/test_codec.py,
tests/test_compact_render.py).

``unpack`` is on the L2 hit path: it checks every type it relies on (a forged or damaged
entry raises ``ValueError``, which the codec turns into a miss) with as little per-line
work as it can.
"""

from __future__ import annotations

from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np

from app.vocabulary import OcrLine, OcrResult


def _scores(scores: list[float]) -> tuple[list[float], int]:
    """(the scores to store, 1 when they are float32 values stored short, else 0)."""
    single = np.asarray(scores, dtype=np.float32)
    if single.tolist() != scores:
        return scores, 0
    return [float(str(value)) for value in single], 1  # str(): the shortest float32 decimal


def pack(result: OcrResult) -> list[Any]:
    scores, single = _scores([line.score for line in result.lines])
    lines: list[list[Any]] = []
    for line, score in zip(result.lines, scores, strict=True):
        (x1, y1), (x2, y2), (x3, y3), (x4, y4) = line.box
        row: list[Any] = [line.text, score, [x1, y1, x2, y2, x3, y3, x4, y4], line.angle]
        if line.words:
            row.append([[text, *box] for text, box in line.words])
        lines.append(row)
    return [result.width, result.height, lines, result.text, single]


_INT = {int}
_STR, _LIST, _NUMBER = {str}, {list}, {float, int}
_ROW_LENGTHS, _BOX_LENGTH = {4, 5}, {8}
_COL0, _COL1, _COL2, _COL3 = itemgetter(0), itemgetter(1), itemgetter(2), itemgetter(3)


def _ints(values: list[Any], count: int) -> bool:
    """``count`` values, all of type int (not bool), checked in C: set(map(type, ...))."""
    return len(values) == count and set(map(type, values)) == _INT


def unpack(data: Any) -> OcrResult:
    """The result of ``pack``'s output as parsed JSON; ``ValueError`` on any other shape."""
    if type(data) is not list or len(data) != 5:
        raise ValueError("not a compact result")
    width, height, rows, text, single = data
    if single != 0 and single != 1:
        raise ValueError("malformed score mode")
    if type(width) is not int or type(height) is not int or type(rows) is not list:
        raise ValueError("malformed result")
    if text is not None and type(text) is not str:
        raise ValueError("malformed text")
    # Every check is one C-level pass over a column (map/set), not Python per line.
    if not set(map(type, rows)) <= _LIST or not set(map(len, rows)) <= _ROW_LENGTHS:
        raise ValueError("malformed line")
    texts, scores = list(map(_COL0, rows)), list(map(_COL1, rows))
    boxes, angles = list(map(_COL2, rows)), list(map(_COL3, rows))
    if (
        not set(map(type, texts)) <= _STR
        or not set(map(type, scores)) <= _NUMBER
        or not set(map(type, angles)) <= _INT
        or not set(map(type, boxes)) <= _LIST
        or not set(map(len, boxes)) <= _BOX_LENGTH
        or not set(map(type, chain.from_iterable(boxes))) <= _INT
    ):
        raise ValueError("malformed line")
    # One numpy call for every score: the float32 they were written from, as Python floats.
    exact = np.asarray(scores, dtype=np.float32).tolist() if single else scores
    lines = [
        _line(
            text_,
            score,
            ((b[0], b[1]), (b[2], b[3]), (b[4], b[5]), (b[6], b[7])),
            angle,
            tuple(map(_word, row[4])) if len(row) == 5 else (),
        )
        for row, text_, score, b, angle in zip(rows, texts, exact, boxes, angles, strict=True)
    ]
    return OcrResult(width, height, tuple(lines), text)


def _fast_line(text: str, score: float, box: Any, angle: int, words: Any) -> OcrLine:
    """An ``OcrLine`` with its fields set directly: the frozen dataclass ``__init__`` (one
    ``object.__setattr__`` per field) is three quarters of ``unpack``'s time, and every value
    here was type-checked above. The result is an ordinary, still frozen, ``OcrLine``."""
    line = _NEW(OcrLine)
    line.__dict__.update(text=text, score=score, box=box, angle=angle, words=words)
    return line


def _checked_line_factory() -> Any:
    """``_fast_line`` if it builds what the constructor builds (e.g. not if ``OcrLine``
    gains ``__slots__`` or a field), else the constructor itself."""
    sample = ("t", 0.5, ((0, 1), (2, 3), (4, 5), (6, 7)), 0, (("w", (0, 1, 2, 3)),))
    try:
        same = _fast_line(*sample) == OcrLine(*sample) and vars(_fast_line(*sample)) == vars(
            OcrLine(*sample)
        )
    except (AttributeError, TypeError):
        same = False
    return _fast_line if same else OcrLine


def _word(item: Any) -> tuple[str, tuple[int, int, int, int]]:
    if type(item) is not list or len(item) != 5 or type(item[0]) is not str:
        raise ValueError("malformed word")
    if not _ints(item[1:], 4):
        raise ValueError("malformed word box")
    return item[0], (item[1], item[2], item[3], item[4])


_NEW = object.__new__
_line = _checked_line_factory()
