"""What two engines on this machine can do at best: the ceiling of the utilization figure.

``bench.dispatch`` measures utilization as the sum of single-request times / 2 engines / the
concurrent wall time. Even two bare engines, with no service, no HTTP, no Redis, and a
perfect shared queue, do not reach 1.0 when the machine has as many cores as engines: each
engine call is slower while the other engine runs (shared caches and memory bandwidth, the
OS and the client). This measures that ceiling with the same 20 images: each image alone in
one process (after a warm-up), then two processes taking images from one queue
(work-conserving by construction). ``python -m bench.engine_ceiling``; part of bench.dispatch.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from collections.abc import Sequence

ENGINES = 2


def _engine():  # type: ignore[no-untyped-def]
    from app import memory
    from app.config import Settings
    from app.engines.paddle import PaddleOcrEngine

    memory.keep_large_buffers()  # as in the service's processes
    engine = PaddleOcrEngine.from_settings(Settings.from_env({}))
    engine.load()
    return engine


def _call(engine, data: bytes) -> float:  # type: ignore[no-untyped-def]
    from bench.load import engine_request

    start = time.perf_counter()
    engine.recognize(engine_request(engine, data))
    return time.perf_counter() - start


def _solo(images: Sequence[bytes], out: mp.Queue) -> None:
    engine = _engine()
    for data in images[:2]:
        _call(engine, data)
    out.put([_call(engine, data) for data in images])


def _consumer(jobs: mp.Queue, ready: mp.Barrier, out: mp.Queue) -> None:
    engine = _engine()
    _call(engine, jobs.get())  # warm-up (one per process, from the queue's head)
    ready.wait()
    busy = 0.0
    while (data := jobs.get()) is not None:
        busy += _call(engine, data)
    out.put(busy)


def measure(images: Sequence[bytes]) -> dict:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    solo = ctx.Process(target=_solo, args=(list(images), out))
    solo.start()
    singles = out.get()
    solo.join()
    jobs: mp.Queue = ctx.Queue()
    ready = ctx.Barrier(ENGINES + 1)
    procs = [ctx.Process(target=_consumer, args=(jobs, ready, out)) for _ in range(ENGINES)]
    for proc in procs:
        proc.start()
    for data in images[:ENGINES]:
        jobs.put(data)
    ready.wait()
    start = time.perf_counter()
    for data in images:
        jobs.put(data)
    for _ in procs:
        jobs.put(None)
    busy = [out.get() for _ in procs]
    wall = time.perf_counter() - start
    for proc in procs:
        proc.join()
    return {
        "single_call_s": round(sum(singles), 3),
        "parallel_wall_s": round(wall, 3),
        # The utilization two bare engines reach: the ceiling of bench.dispatch's figure.
        "utilization": round(sum(singles) / ENGINES / wall, 3),
        # How much slower a call is while the other engine runs.
        "call_slowdown": round(sum(busy) / sum(singles), 3),
    }


def main() -> int:
    from bench.dispatch import pick_images

    print(json.dumps(measure(pick_images()), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
