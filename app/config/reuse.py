"""Answers reused beyond the exact image: near-duplicates (``Settings.similar``) and text lines (``Settings.lines``)."""

from __future__ import annotations

from dataclasses import dataclass

from app import env as e
from app.env import Section, env


@dataclass(frozen=True)
class SimilarSettings(Section):
    TITLE = "Near-duplicates"
    INTRO = "The pixel tier is always on; the similarity tier is opt-in ([ARCHITECTURE.md](ARCHITECTURE.md))."

    enabled: bool = env(
        "CACHE_SIMILAR",
        e.boolean,
        False,
        "the similarity tier: a near-duplicate answered from a verified cached image",
    )
    max_distance: int = env(
        "CACHE_SIMILAR_MAX_DISTANCE",
        e.integer(0, 256),
        40,
        "perceptual-hash distance of the candidates (of 256 bits)",
    )
    max_aspect: float = env(
        "CACHE_SIMILAR_MAX_ASPECT",
        e.number(0.0, 100.0),
        0.6,
        "verification: aspect-ratio difference (%)",
    )
    max_block: float = env(
        "CACHE_SIMILAR_MAX_BLOCK",
        e.number(0.0, 255.0),
        12.0,
        "verification: largest 8 px window difference (grey levels)",
    )
    max_line: float = env(
        "CACHE_SIMILAR_MAX_LINE",
        e.number(0.0, 100.0),
        12.0,
        "verification: largest character-window difference in a line, relative to its contrast (%)",
    )


@dataclass(frozen=True)
class LinesSettings(Section):
    TITLE = "Line reuse"
    INTRO = "The in-process PaddleOCR engine (`OCR_ENGINE=paddle`) with Redis: each text-line crop's reading kept by the exact digest of its pixels, so template documents recognise only their new lines; the answers are those of reuse off ([ARCHITECTURE.md](ARCHITECTURE.md#line-reuse-cache_lines), figures in [PERFORMANCE.md](PERFORMANCE.md#line-reuse-issue-27))."

    enabled: bool = env(
        "CACHE_LINES",
        e.boolean,
        False,
        "reuse recognised text lines across images; needs `OCR_DEVICE=cpu` and `OCR_CPU_THREADS=1`",
    )
    ttl_seconds: int = env(
        "CACHE_LINES_TTL_SECONDS",
        e.integer(0, 10 * 365 * 86400),
        0,
        "how long a line's reading is kept (0: `CACHE_TTL_SECONDS`)",
    )
