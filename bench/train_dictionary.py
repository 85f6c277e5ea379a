"""Train the zstd dictionary cache entries are compressed with (a development-time step).

    python -m bench.train_dictionary [size_bytes]

Runs the real engine over the training part of the corpus (``bench/corpus_results.split``;
the held-out part is what ``make bench`` measures), packs each result the way the codec
stores it (``app.cache.compact``) and trains a zstd dictionary on them. It is written as the
next ``app/cache/dictionaries/ocr-<n>.zdict``: shipped dictionaries are never replaced, so
entries written with an older one stay readable (the entry header carries the id).
"""

from __future__ import annotations

import sys

import orjson
import zstandard

from app.cache import compact, dictionaries
from bench.corpus_results import results, split

DEFAULT_SIZE = 16 * 1024


def samples() -> list[bytes]:
    training, _ = split()
    packed = [compact.pack(r) for r in results(training).values()]
    packed += [compact.pack(r) for r in results(training[::2], word_boxes=True).values()]
    out = [orjson.dumps(p) for p in packed]
    # Line runs as samples too: the trainer needs many samples, and a result is a run of lines.
    for width, height, lines, text, single in packed:
        out += [
            orjson.dumps([width, height, lines[i : i + 4], text, single])
            for i in range(0, len(lines), 4)
        ]
    return out


def main() -> int:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_SIZE
    data = zstandard.train_dictionary(size, samples(), level=19, threads=-1)
    folder = dictionaries.__path__[0]  # type: ignore[attr-defined]
    numbers = [int(p.rsplit("-", 1)[1].split(".")[0]) for p in _existing(folder)]
    path = f"{folder}/ocr-{max(numbers, default=0) + 1}.zdict"
    with open(path, "wb") as out:
        out.write(data.as_bytes())
    print(f"dictionary {data.dict_id()} ({len(data.as_bytes())} bytes) written to {path}")
    return 0


def _existing(folder: str) -> list[str]:
    from pathlib import Path

    return [str(p) for p in Path(folder).glob("ocr-*.zdict")]


if __name__ == "__main__":
    sys.exit(main())
