"""Settings that are gone, and what to do instead: still set, they stop start-up."""

from __future__ import annotations

REMOVED = {
    "HTTP_FRONT": "nginx is the edge now (EDGE=nginx); behind another buffering proxy set "
    "EDGE=none",
    "HTTP_FRONT_HITS": "hits are answered by the workers' one hit path behind nginx; unset it",
    "HTTP_FRONT_PROCESSES": "the edge's processes are EDGE_WORKERS (nginx worker_processes)",
    "CACHE_COMPRESS_MIN_BYTES": "every entry is compressed (envelope 2); it had no effect: unset it",
    "SINGLEFLIGHT_LEASE_MS": "the lease is gone: one ticket per image in the global queue, reclaimed "
    "after DISPATCH_CLAIM_MS when its engine dies",
    "SINGLEFLIGHT_WAIT_SECONDS": "the lease is gone: a miss waits at most OCR_TIMEOUT_SECONDS",
    "DISPATCH_ENABLED": "the global queue is the one way a miss is shared across processes; "
    "unset it",
    "ENGINE_QUEUE_MAX": "fronts queue no engine calls: a tenant's lane holds DISPATCH_QUEUE_MAX "
    "misses per live engine; an engine process's direct endpoint takes "
    "ENGINE_DIRECT_MAX_INFLIGHT",
}
