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
    scores: list[float] = []
    for row in rows:
        if type(row) is not list or not 4 <= len(row) <= 5:
            raise ValueError("malformed line")
        score = row[1]
        if type(score) is not float and type(score) is not int:
            raise ValueError("malformed score")
        scores.append(score)
    # One numpy call for every score: the float32 they were written from, as Python floats.
    exact = np.asarray(scores, dtype=np.float32).tolist() if single else scores
    lines = []
    for row, score in zip(rows, exact, strict=True):
        line_text, box, angle = row[0], row[2], row[3]
        if type(line_text) is not str or type(angle) is not int or type(box) is not list:
            raise ValueError("malformed line")
        if not _ints(box, 8):
            raise ValueError("malformed box")
        words: tuple[Any, ...] = ()
        if len(row) == 5:
            words = tuple(_word(item) for item in row[4])
        x1, y1, x2, y2, x3, y3, x4, y4 = box
        lines.append(
            OcrLine(line_text, score, ((x1, y1), (x2, y2), (x3, y3), (x4, y4)), angle, words)
        )
    return OcrResult(width, height, tuple(lines), text)


def _word(item: Any) -> tuple[str, tuple[int, int, int, int]]:
    if type(item) is not list or len(item) != 5 or type(item[0]) is not str:
        raise ValueError("malformed word")
    if not _ints(item[1:], 4):
        raise ValueError("malformed word box")
    return item[0], (item[1], item[2], item[3], item[4])
