"""glibc malloc settings for processes that copy request bodies of hundreds of KB, and the
release of an engine call's freed memory.

With glibc's defaults, a buffer over the mmap threshold (128 KiB at start, adjusted as
blocks are freed) gets fresh pages from the kernel on every allocation and returns them on
free: copying a 416 KB JSON body (a 312 KB image) then cost 0.48 ms instead of 0.03 ms on
this machine (page faults and zeroing), and a request copies its body several times (socket
buffers, the HTTP parser, base64). Raising the mmap and trim thresholds keeps such buffers
in the heap for reuse. Called where requests are served: at the start of each front worker
(``app.front_server.load_worker``, granian's CLI included) and of each engine process; a
no-op off glibc. The same
can be had from the environment: ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...``.

The same thresholds keep an in-process engine's freed activations (each under 32 MiB) in the
heap, where fragmentation holds them: a worker that once read a page-sized image kept about
400 MB more for good, and one that met larger images late in a soak grew 18 % in steps
(docs/RELIABILITY.md#soak). ``release_free_memory`` after each engine call gives the free
pages back (glibc's ``malloc_trim``: 2-3 ms a call on average, measured).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable

# glibc's largest (64-bit): covers MAX_REQUEST_BYTES' default (20 MiB), so bodies stay in the heap.
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 64 * 1024 * 1024  # free heap kept for the next bodies before it is returned
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h

# The front's two allocators, read from the environment when its process starts: glibc's
# (Python's bodies) and the jemalloc inside granian (its Rust side: each connection's request
# bodies). Their defaults keep what a phase of large bodies freed: a front worker held about
# 250 MB after 312 KB hits or large misses, released neither by ``malloc_trim`` nor by time
# (jemalloc purges only on its next allocations, in each of 8 arenas; glibc keeps an arena
# per busy thread). One jemalloc arena that purges freed pages after a second from its own
# thread, and two glibc arenas: at most 212 MB after the same misses, 271 with the defaults
# (``python -m bench.front_memory``, docs/PERFORMANCE.md).
FRONT_ALLOCATORS = {
    "MALLOC_ARENA_MAX": "2",
    "_RJEM_MALLOC_CONF": "background_thread:true,narenas:1,dirty_decay_ms:1000,muzzy_decay_ms:0",
}

log = logging.getLogger(__name__)


def start_with_front_allocators() -> None:
    """Start this process again (the same PID, ``execv``) with ``FRONT_ALLOCATORS`` in its
    environment, each unless already set (the operator's own choice stays); returns only
    when nothing is missing. Allocators read these once, at the process's start."""
    missing = {name: v for name, v in FRONT_ALLOCATORS.items() if name not in os.environ}
    if not missing:
        return
    os.environ.update(missing)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)


def keep_large_buffers() -> bool:
    """Whether the thresholds were set (False off glibc, where nothing changes)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        log.info("malloc thresholds not set; large request bodies are copied more slowly")
    return ok


def release_free_memory() -> None:
    """Give the heap's free pages back to the kernel (``malloc_trim(0)``); a no-op off glibc."""
    if _trim is not None:
        _trim(0)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = (ctypes.c_size_t,)
    return trim


_trim = _malloc_trim()
