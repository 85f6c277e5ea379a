"""glibc malloc settings and the release of freed memory (``app/memory.py``): with the
service's thresholds, freed buffers under 32 MiB stay in the heap until released; an
engine call releases them (the soak's steps, docs/RELIABILITY.md#soak)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.unit


# In a fresh interpreter: a long test process's heap already has free holes of its own.
_HOLES = """
import os
from app import memory

def rss_mb():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

assert memory.keep_large_buffers()
held, pins = [], []
for _ in range(256):  # 256 MiB in the heap, each MiB followed by a page still in use
    held.append(bytearray(1 << 20))
    held[-1][::4096] = b"x" * len(range(0, 1 << 20, 4096))  # touched: resident
    pins.append(bytearray(4096))
del held  # holes between the pins: the heap cannot shrink from its top
before = rss_mb()
memory.release_free_memory()
print(before - rss_mb(), len(pins))
"""


def _glibc() -> bool:
    try:
        ctypes.CDLL(None).malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return False
    return os.path.exists("/proc/self/statm")


@pytest.mark.integration  # a fresh interpreter: a process (tests/conftest.py)
@pytest.mark.skipif(not _glibc(), reason="glibc's malloc and /proc only")
def test_freed_buffers_kept_by_the_thresholds_are_given_back() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _HOLES], capture_output=True, text=True, timeout=60,
        env={**os.environ, "MALLOC_ARENA_MAX": "2"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    released, pins = done.stdout.split()
    assert float(released) > 128, f"of the freed 256 MiB only {released} MiB were given back"
    assert pins == "256"


def test_every_engine_call_releases_what_it_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process engine's calls end with a release, whatever their outcome."""
    from app.engines import paddle
    from app.vocabulary import EngineError

    released: list[int] = []
    monkeypatch.setattr(paddle.memory, "release_free_memory", lambda: released.append(1))
    engine: Any = object.__new__(paddle.PaddleOcrEngine)
    engine._pipeline, engine._lines = object(), None

    def fails(requests: Any) -> Any:
        raise EngineError("paddle inference failed")

    engine._predict_plain = lambda requests: ["result"]
    assert engine._predict_here([object()]) == ["result"]
    engine._predict_plain = fails
    with pytest.raises(EngineError):
        engine._predict_here([object()])
    assert released == [1, 1]
