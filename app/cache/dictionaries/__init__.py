"""The zstd dictionaries entries are compressed with, shipped as package data.

Each ``*.zdict`` file is a dictionary trained at development time by
``python -m bench.train_dictionary`` from the engine's results on corpus images (never at
run time, never from network data). An entry names its dictionary by the zstd dictionary id
in its header; every shipped dictionary stays readable, and the newest (highest file number)
is the one written with. A new dictionary is therefore a new file, not a replaced one:
entries written with the old one stay hits until they expire. Imported by every process
(the codec: fronts read entries, engine processes write them).
"""

from __future__ import annotations

import functools
from pathlib import Path

import zstandard

_HERE = Path(__file__).resolve().parent


@functools.cache
def _shipped() -> tuple[dict[int, zstandard.ZstdCompressionDict], int]:
    """(dictionary id -> dictionary, the newest one's id or 0 when none is shipped)."""
    found: dict[int, zstandard.ZstdCompressionDict] = {}
    newest = 0
    for path in sorted(_HERE.glob("ocr-*.zdict"), key=lambda p: int(p.stem.split("-")[1])):
        data = zstandard.ZstdCompressionDict(
            path.read_bytes(), dict_type=zstandard.DICT_TYPE_FULLDICT
        )
        found[data.dict_id()] = data
        newest = data.dict_id()
    return found, newest


def current_id() -> int:
    return _shipped()[1]


def get(dict_id: int) -> zstandard.ZstdCompressionDict | None:
    """The shipped dictionary with this id (None for 0 or an unknown id)."""
    return _shipped()[0].get(dict_id) if dict_id else None
