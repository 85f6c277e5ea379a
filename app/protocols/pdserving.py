"""PaddleOCR pdserving's result string (PROTOCOLS.md §3).

``value[0]`` is Python ``str()`` of ``[[(text, score), [[x, y] x4]], ...]`` with coordinates as
floats, exactly what deploy/pdserving/web_service.py emits, and what clients ``eval()``.
Scores are plain Python floats, so numpy >= 2 reprs (``np.float32(..)``) never leak in.
"""

from __future__ import annotations

from app.engines.base import OcrResult


def result_string(result: OcrResult) -> str:
    return str(
        [
            [(line.text, float(line.score)), [[float(x), float(y)] for x, y in line.box]]
            for line in result.lines
        ]
    )
