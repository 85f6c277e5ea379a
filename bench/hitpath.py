"""The L2 hit path figures of `make bench` (issue 14 §2), measured side by side.

For a 5 KB, a 100 KB and a 312 KB image (JSON bodies of 7, 131 and 416 KB): hits/s at
concurrency 8 of the service with L1 off (answers from Redis) against the naive seed-style
baseline and an HTTP echo app (bench/echo_app.py) under the same gunicorn settings, and the
L2 hit p50 at concurrency 1 against the in-process floor (base64 decode + MD5 + one GET).
Servers are measured in alternation, after a warm-up, ``ROUNDS`` times each; medians.
"""

from __future__ import annotations

import base64
import hashlib
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import redis

from bench import load

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("OCR_SHARED_DIR", ROOT.parent / "shared")) / "corpus"
SIZES = {  # the body sizes: a text page, a receipt, a photographed page
    "5KB": "tesseract_phototest.png",
    "100KB": "sroie_000.jpg",
    "312KB": "paddleocr_doc_1.jpg",
}
CONCURRENCY = 8
ROUNDS = int(os.environ.get("BENCH_HIT_ROUNDS", "3"))
SECONDS = float(os.environ.get("BENCH_THROUGHPUT_SECONDS", "6"))
WARMUP_SECONDS = 2  # wrk takes whole seconds
LATENCY_REQUESTS = int(os.environ.get("BENCH_HIT_REQUESTS", "400"))
REQUESTS = int(os.environ.get("BENCH_THROUGHPUT_REQUESTS", "4000"))


def _rate(port: int, request: load.Request, seconds: float) -> dict:
    if load.wrk_available():
        return load.run_wrk(port, request, CONCURRENCY, seconds)
    return load.run(port, request, CONCURRENCY, REQUESTS, seconds)


def measure(
    targets: dict[str, tuple[int, str]],
    redis_url: str,
    json_request: Callable[..., load.Request],
) -> dict:
    """``targets``: name -> (port, path); "service_l2" is the one the ratios are of."""
    report: dict = {"concurrency": CONCURRENCY, "rounds": ROUNDS, "seconds": SECONDS,
                    "client": "wrk" if load.wrk_available() else "python processes"}  # fmt: skip
    l2_port = targets["service_l2"][0]
    for size, name in SIZES.items():
        data = (CORPUS / name).read_bytes()
        requests_ = {t: json_request(path, data) for t, (_, path) in targets.items()}
        for t, (port, _) in targets.items():  # the misses that store the entries
            load.run(port, requests_[t], 1, 2, 600)
        for t, (port, _) in targets.items():
            _rate(port, requests_[t], WARMUP_SECONDS)
        runs: dict[str, list[dict]] = {t: [] for t in targets}
        for _ in range(ROUNDS):
            for t, (port, _) in targets.items():
                runs[t].append(_rate(port, requests_[t], SECONDS))
        rate = {t: statistics.median(r["per_second"] for r in rs) for t, rs in runs.items()}
        hit = load.run(l2_port, requests_["service_l2"], 1, LATENCY_REQUESTS, 120)
        (key,) = redis.Redis.from_url(redis_url).keys(
            f"ocr:v1:*{{{hashlib.md5(data).hexdigest()}}}"
        )
        floor_stats = load.hit_floor(
            redis_url, key, base64.b64encode(data).decode(), LATENCY_REQUESTS * 2
        )
        entry = {
            "image": name,
            "image_bytes": len(data),
            "body_bytes": len(requests_["service_l2"].body),
            "hits_per_s": rate,
            "errors": {t: sum(r["errors"] for r in rs) for t, rs in runs.items()},
            "l2_vs_naive": rate["service_l2"] / rate["naive"],
            "l2_vs_echo": rate["service_l2"] / rate["echo"],
            "hit_p50_ms": hit["p50_ms"],
            "hit_p99_ms": hit["p99_ms"],
            "floor_p50_ms": floor_stats["p50_ms"],
            "hit_p50_minus_floor_ms": hit["p50_ms"] - floor_stats["p50_ms"],
        }
        if "service_l2_direct" in rate:
            entry["l2_direct_vs_naive"] = rate["service_l2_direct"] / rate["naive"]
            entry["l2_direct_vs_echo"] = rate["service_l2_direct"] / rate["echo"]
            direct = load.run(targets["service_l2_direct"][0], requests_["service_l2_direct"],
                              1, LATENCY_REQUESTS, 120)  # fmt: skip
            entry["direct_hit_p50_ms"] = direct["p50_ms"]
            entry["direct_hit_p50_minus_floor_ms"] = direct["p50_ms"] - floor_stats["p50_ms"]
        report[size] = entry
    return report


def table(report: dict, entry_size: dict | None) -> str:
    rows = [
        f"L2-only hits/s at concurrency {report['concurrency']} ({report['client']}, "
        f"{report['rounds']} x {report['seconds']:g} s per server, medians):",
        "",
        "| body | service L2 | service L2, no front | naive | echo | L2 / naive | "
        "L2 / echo | no front: / naive, / echo | L2 hit p50 − floor ms (no front) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size in SIZES:
        r = report[size]
        h = r["hits_per_s"]
        rows.append(
            f"| {size} ({r['body_bytes'] // 1024} KiB JSON) | {h['service_l2']:.0f} | "
            f"{h.get('service_l2_direct', float('nan')):.0f} | {h['naive']:.0f} | "
            f"{h['echo']:.0f} | {r['l2_vs_naive']:.2f}x | {r['l2_vs_echo']:.2f}x | "
            f"{r.get('l2_direct_vs_naive', float('nan')):.2f}x, "
            f"{r.get('l2_direct_vs_echo', float('nan')):.2f}x | "
            f"{r['hit_p50_minus_floor_ms']:.2f} "
            f"({r.get('direct_hit_p50_minus_floor_ms', float('nan')):.2f}) |"
        )
    if entry_size:
        e = entry_size["lines"]
        w = entry_size["word_boxes"]
        rows += [
            "",
            f"Redis MEMORY USAGE / raw result JSON over {e['images']} held-out corpus images: "
            f"{e['ratio']:.3f} (per-image mean {e['mean_ratio']:.3f}); previous format "
            f"{e['ratio_v1']:.3f} ({e['mean_ratio_v1']:.3f}). With word boxes "
            f"({w['images']} images): {w['ratio']:.3f} (previous {w['ratio_v1']:.3f}).",
        ]
    return "\n".join(rows)


def main() -> int:
    """``python -m bench.hitpath``: only these figures (the inner loop of issue 14 §2);
    the four servers as ``make bench`` starts them; results in bench/results/hitpath_only.json."""
    import json
    import sys
    import time

    import requests

    from app import memory
    from app.embedded_redis import EmbeddedRedis
    from app.ports import free_port
    from bench import run

    memory.keep_large_buffers()  # the in-process floor copies bodies as the servers do
    with EmbeddedRedis() as server:
        ports = {name: free_port() for name in ("service_l2", "service_l2_direct", "naive", "echo")}
        procs = [
            run.start_service(server.url, ports["service_l2"], free_port(), CACHE_L1_BYTES="0"),
            run.start_service(
                server.url,
                ports["service_l2_direct"],
                free_port(),
                CACHE_L1_BYTES="0",
                EDGE="none",
            ),  # fmt: skip
            run.start_naive(server.url, ports["naive"]),
            run.start_naive(server.url, ports["echo"], "bench.echo_app:app"),
        ]
        try:
            for name in ("service_l2", "service_l2_direct"):
                url = f"http://127.0.0.1:{ports[name]}/readyz"
                run.wait_until(lambda url=url: requests.get(url, timeout=5).ok)
            probe = run.json_request("/ocr", b"x")
            naive = f"http://127.0.0.1:{ports['naive']}/ocr"
            run.wait_until(lambda: requests.post(naive, data=probe.body, headers=probe.headers,
                                                 timeout=60).status_code < 502)  # fmt: skip
            targets = {name: (port, "/ocr" if name in ("naive", "echo") else "/v1/ocr")
                       for name, port in ports.items()}  # fmt: skip
            report = measure(targets, server.url, run.json_request)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(60)
    report["date"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    out = ROOT / "bench" / "results" / "hitpath_only.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report, None), file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
