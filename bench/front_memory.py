"""`python -m bench.front_memory` (issue 45's memory target): a front worker's resident memory
after a phase of large bodies, with the front's allocator settings (``app.memory``'s
``FRONT_ALLOCATORS``, what ``python -m app front`` runs with) and with the allocators'
defaults given explicitly (glibc's 8 arenas a core, granian's jemalloc with 8 arenas that
purge only on later allocations), alternating.

Each run: ``python -m app serve`` as `bench/edge.py` starts it (L1 off, 2 front workers, 2
engine processes) on a private Redis; wrk hits of the 5, 100 and 312 KB images (c=8, 6 s
each), then 40 distinct corpus pages (20-400 KB, re-encoded: every one a miss) from 8
clients; each front worker's RSS after the hits, its peak during the misses, after them, and
11 s later. Target: at most 250 MB after the large misses.

Results: bench/results/front_memory.json.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from app import memory
from app.embedded_redis import EmbeddedRedis
from app.ports import free_port
from bench import edge, run
from tests.helpers import front_workers_of

RESULTS = edge.ROOT / "bench" / "results" / "front_memory.json"
ROUNDS = int(os.environ.get("BENCH_MEMORY_ROUNDS", "2"))
MISSES, CLIENTS = 40, 8
DEFAULTS = {  # the allocators as they are without the front's settings, said explicitly
    "MALLOC_ARENA_MAX": str(8 * (os.cpu_count() or 1)),
    "_RJEM_MALLOC_CONF": "background_thread:false",
}


def measure(settings: dict[str, str], images: list[bytes]) -> dict[str, Any]:
    """One service with these allocator settings: its front workers' RSS (MB) by phase."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    redis_server = EmbeddedRedis()
    redis_server.start()
    server = edge.Server("service", free_port(), "/v1/ocr", tmp / "service.log")
    try:
        edge.start_service(server, redis_server.url, edge.ROOT, **settings)
        ready = f"http://127.0.0.1:{server.port}/readyz"
        edge.wait_ready(server, lambda: requests.get(ready, timeout=5).ok)
        workers = front_workers_of(server.procs[0].pid)

        def rss() -> list[float]:
            return [round(edge.rss_mb(pid), 1) for pid in workers]

        out: dict[str, Any] = {"start": rss()}
        for size in ("5KB", "100KB", "312KB"):
            hit = run.json_request("/v1/ocr", (edge.CORPUS / edge.SIZES[size]).read_bytes())
            edge.post(server.port, hit)
            edge.wrk(server.port, hit, 8, 6)
        out["after_hits"] = rss()
        peak = [0.0] * len(workers)
        with edge.Misses(server.port, CLIENTS, iter(images)) as misses:
            began = time.monotonic()
            while len(misses.statuses) < len(images) and time.monotonic() - began < 120:
                peak = [max(p, now) for p, now in zip(peak, rss(), strict=True)]
                time.sleep(0.5)
        out["miss_answers"] = misses.summary()
        out["peak_during_misses"] = peak
        out["after_misses"] = rss()
        time.sleep(11)
        out["after_misses_11s"] = rss()
        return out
    finally:
        edge.stop(server)
        redis_server.cleanup()


def main() -> None:
    memory.keep_large_buffers()
    images = list(edge.distinct_images(MISSES * ROUNDS * 2))
    runs: dict[str, list[dict[str, Any]]] = {"front_settings": [], "defaults": []}
    for i in range(ROUNDS):
        for name, settings in (("front_settings", {}), ("defaults", DEFAULTS)):
            batch = images[(2 * i + (name == "defaults")) * MISSES :][:MISSES]
            runs[name].append(measure(settings, batch))
            print(name, json.dumps(runs[name][-1]), flush=True)
    report = {
        "issue": 45,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": edge._git("rev-parse", "--short", "HEAD"),
        "front_allocators": memory.FRONT_ALLOCATORS,
        "defaults": DEFAULTS,
        "runs": runs,
        "max_after_misses_mb": {
            name: max(max(r["after_misses"]) for r in rows) for name, rows in runs.items()
        },
        "target_mb": edge.RSS_MB,
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["max_after_misses_mb"]))


if __name__ == "__main__":
    main()
