"""PaddleOCR pdserving's result string (docs/PROTOCOLS.md §3).

``value[0]`` is Python ``str()`` of ``[[(text, score), [[x, y] x4]], ...]`` with coordinates as
floats, exactly what deploy/pdserving/web_service.py emits (lines scoring below the drop
score left out), which official clients parse with Python's ``eval``. Scores are plain
floats, so numpy >= 2 reprs (``np.float32(..)``) never leak in.
"""

from __future__ import annotations

import ast

import numpy as np

from app.vocabulary import OcrLine, OcrResult


class _Float32(float):
    """A score printed as upstream's (numpy < 2) float32 scores print: the shortest digits
    that identify the float32 value (``0.99876543``), still a plain float literal."""

    def __repr__(self) -> str:
        return str(np.float32(self))


def result_string(result: OcrResult, min_score: float) -> str:
    return str(
        [
            [(line.text, _Float32(line.score)), [[float(x), float(y)] for x, y in line.box]]
            for line in result.filtered(min_score)
        ]
    )


def parse_result_string(text: str, key: str) -> list[OcrLine]:
    """Lines from a remote pipeline's answer, parsed with ``ast.literal_eval`` (never eval).

    ``result`` holds ``[[(text, score), box], ...]``; the older ``res`` form holds texts only
    (boxes unknown: all-zero, score 1.0 as the remote gave none).
    """
    value = ast.literal_eval(text)
    if not isinstance(value, list):
        raise ValueError("result is not a list")
    lines = []
    for item in value:
        if key == "res":
            if not isinstance(item, str):
                raise ValueError("res items must be strings")
            lines.append(OcrLine(item, 1.0, ((0, 0), (0, 0), (0, 0), (0, 0))))
            continue
        (text, score), box = item
        points = tuple((round(float(x)), round(float(y))) for x, y in box)
        if not isinstance(text, str) or len(points) != 4:
            raise ValueError("malformed result line")
        # float32 digits (as printed) back to the float32 value an in-process engine gives
        lines.append(OcrLine(text, float(np.float32(score)), points))
    return lines
