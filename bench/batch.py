"""`make bench`, part 3: does ``ENGINE_BATCH_MAX`` help on this CPU?

The in-process PaddleOCR engine is given the same 8 corpus images one call per image and in
lists of 2, 4 and 8 (``recognize_many``: one pipeline call on a list), interleaved over
rounds; results must be identical. Images per second of each, against one per call, go to
bench/results/batch.json. About 2 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

from app.config import Settings
from app.engines.paddle import PaddleOcrEngine
from bench import load
from bench.dispatch import RESULTS, pick_images

ROUNDS = int(os.environ.get("BENCH_BATCH_ROUNDS", "3"))
SIZES = (2, 4, 8)


def main() -> int:
    settings = Settings.from_env({})
    if not settings.paddle.work_dir:
        settings = settings.with_overrides(ocr_work_dir=tempfile.mkdtemp(prefix="bench-batch-"))
    engine = PaddleOcrEngine.from_settings(settings)
    engine.load()
    images = pick_images()[:8]
    requests = [load.engine_request(engine, d) for d in images]
    engine.recognize_many(requests[:2])  # warm the list path too
    single_s: list[float] = []
    batch_s: dict[int, list[float]] = {n: [] for n in SIZES}
    identical = True
    for _ in range(ROUNDS):
        start = time.perf_counter()
        singles = [engine.recognize(r) for r in requests]
        single_s.append(time.perf_counter() - start)
        for n in SIZES:
            start = time.perf_counter()
            batched = []
            for i in range(0, len(requests), n):
                batched += engine.recognize_many(requests[i : i + n])
            batch_s[n].append(time.perf_counter() - start)
            identical &= [r.lines for r in batched] == [r.lines for r in singles]
    single = statistics.median(single_s)
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "images": len(requests),
        "rounds": ROUNDS,
        "one_per_call_s": round(single, 3),
        "batches": {
            str(n): {
                "median_s": round(statistics.median(ts), 3),
                "throughput_vs_one_per_call": round(single / statistics.median(ts), 3),
            }
            for n, ts in batch_s.items()
        },
        "results_identical": identical,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "batch.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
