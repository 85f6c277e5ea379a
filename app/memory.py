"""glibc malloc settings for processes that copy request bodies of hundreds of KB.

With glibc's defaults, a buffer over the mmap threshold (128 KiB at start, adjusted as
blocks are freed) gets fresh pages from the kernel on every allocation and returns them on
free: copying a 416 KB JSON body (a 312 KB image) then cost 0.48 ms instead of 0.03 ms on
this machine (page faults and zeroing), and a request copies its body several times (socket
buffers, the HTTP parser, base64). Raising the mmap and trim thresholds keeps such buffers
in the heap for reuse. Called at the start of ``python -m app serve`` (before gunicorn
forks its workers, which inherit it); a no-op off glibc. The same
can be had from the environment: ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...``.
"""

from __future__ import annotations

import ctypes
import logging

# glibc's largest (64-bit): covers MAX_REQUEST_BYTES' default (20 MiB), so bodies stay in the heap.
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 64 * 1024 * 1024  # free heap kept for the next bodies before it is returned
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h

log = logging.getLogger(__name__)


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
