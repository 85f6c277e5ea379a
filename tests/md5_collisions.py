"""New MD5-colliding JPEG pairs from any two JPEGs, built on the shared UniColl prefix pair.

``../shared/testdata/md5-collision/md5-1.jpg`` and ``md5-2.jpg`` differ only inside their
first 128 bytes (two MD5 blocks): byte 9 is the low byte of a JPEG comment's length, so the
parser of the first file finds its next marker at offset 128 and the parser of the second at
offset 384. After those 128 bytes both MD5 states are equal, so any common tail keeps the
digests equal. The tail built here is::

    128: FF FE <len>   a comment (first file only) that hides the second image
    132: nonce + padding
    384: the second JPEG without its SOI (the second file's parser starts here, ends at EOI)
    ...: the first JPEG without its SOI

so the first file decodes as ``first`` and the second as ``second``, with the same MD5 and
different SHA-256. A different nonce gives a fresh pair (fresh cache keys) every time.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from tests.conftest import SHARED

PAIR = SHARED / "testdata" / "md5-collision"
_SPLIT = 128  # end of the collision blocks: the MD5 states agree from here on
_SECOND_START = 384  # where the second file's parser looks for its next marker
_SOI = b"\xff\xd8"
T = TypeVar("T")


def _prefixes() -> tuple[bytes, bytes]:
    a = (PAIR / "md5-1.jpg").read_bytes()[:_SPLIT]
    b = (PAIR / "md5-2.jpg").read_bytes()[:_SPLIT]
    assert a != b and hashlib.md5(a).digest() == hashlib.md5(b).digest()
    return a, b


def colliding_jpegs(first: bytes, second: bytes, nonce: bytes = b"") -> tuple[bytes, bytes]:
    """Two different files with one MD5: the first decodes as ``first``, the second as
    ``second`` (both JPEG; ``second`` under ~64 KiB so one comment can hide it)."""
    assert first[:2] == _SOI and second[:2] == _SOI, "JPEG inputs only"
    pad = _SECOND_START - _SPLIT - 4
    assert len(nonce) <= pad
    hidden = nonce + b"\0" * (pad - len(nonce)) + second[2:]
    length = 2 + len(hidden)
    assert length <= 0xFFFF, "the second image must fit in one JPEG comment"
    tail = b"\xff\xfe" + length.to_bytes(2, "big") + hidden + first[2:]
    prefix_a, prefix_b = _prefixes()
    a, b = prefix_a + tail, prefix_b + tail
    assert a != b and hashlib.md5(a).digest() == hashlib.md5(b).digest()
    return a, b


def shared_pairs() -> list[tuple[Path, Path]]:
    return [
        (PAIR / "md5-1.jpg", PAIR / "md5-2.jpg"),
        (PAIR / "md5-1fc.jpg", PAIR / "md5-2fc.jpg"),
    ]


def at_once(check: Callable[[T], bool], items: Sequence[T]) -> int:
    """Run ``check`` on every item in its own thread, all released together; the number of
    items whose check failed."""
    barrier = threading.Barrier(len(items))

    def one(item: T) -> bool:
        barrier.wait()
        return check(item)

    with ThreadPoolExecutor(len(items)) as pool:
        return sum(not ok for ok in pool.map(one, items))
