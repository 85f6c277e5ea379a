"""`make bench`: the foundation benchmark, every figure measured side by side in one run.

Starts a private Redis, the service (`python -m app serve`) and the naive seed-style
baseline under the same gunicorn settings, then measures on the same real images:
hit latency (JSON base64 and multipart) against the in-process floor (base64 decode + MD5 +
Redis GET of the stored value), miss latency against a bare engine call, and hot-image
hits/s at concurrency 8 against the baseline. Results go to bench/results/foundation.json.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis
import requests

from app import memory
from app.config import Settings
from app.embedded_redis import EmbeddedRedis
from app.engines.paddle import PaddleOcrEngine
from app.ports import free_port
from bench import entry_size, hitpath, load
from bench.reference import gunicorn_args

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("OCR_SHARED_DIR", ROOT.parent / "shared")) / "corpus"
RESULTS = ROOT / "bench" / "results"
IMAGES = {  # card / receipt / page, as in docs/ENGINES.md
    "card": "paddleocr_doc_00006737.jpg",
    "receipt": "sroie_000.jpg",
    "page": "tesseract_phototest.png",
}
WORKERS, THREADS, CONCURRENCY = 2, 8, 8
HIT_REQUESTS = int(os.environ.get("BENCH_HIT_REQUESTS", "400"))
THROUGHPUT_REQUESTS = int(os.environ.get("BENCH_THROUGHPUT_REQUESTS", "4000"))
THROUGHPUT_SECONDS = float(os.environ.get("BENCH_THROUGHPUT_SECONDS", "6"))
MISS_REPEATS = int(os.environ.get("BENCH_MISS_REPEATS", "7"))
BURST_IMAGE = "sroie_019.jpg"  # not used by the other measurements: cold for the burst


# The malloc thresholds `python -m app serve` sets for itself (app/memory.py), given to every
# server measured (the naive baseline and the echo app too), so no one is measured with
# glibc's page-faulting copies of large bodies and the others without.
MALLOC = (
    f"glibc.malloc.mmap_threshold={memory.MMAP_THRESHOLD}"
    f":glibc.malloc.trim_threshold={memory.TRIM_THRESHOLD}"
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(
        WEB_CONCURRENCY=str(WORKERS),
        ENGINE_PROCESSES=str(WORKERS),
        WEB_THREADS=str(THREADS),
        LOG_LEVEL="warning",
        **extra,
    )
    env.setdefault("GLIBC_TUNABLES", MALLOC)
    return env


def start_service(redis_url: str, port: int, grpc_port: int, **extra: str) -> subprocess.Popen:
    env = _env(
        REDIS_URL=redis_url,
        HTTP_PORT=str(port),
        GRPC_PORT=str(grpc_port),
        HOST="127.0.0.1",
        **extra,
    )
    return subprocess.Popen([sys.executable, "-m", "app", "serve"], cwd=ROOT, env=env)


def start_naive(redis_url: str, port: int, app: str = "bench.naive_app:app") -> subprocess.Popen:
    """The naive baseline (or, with ``app``, another WSGI app) under the service's settings."""
    args = gunicorn_args(app, f"127.0.0.1:{port}", WORKERS, THREADS)
    return subprocess.Popen(args, cwd=ROOT, env=_env(REDIS_URL=redis_url))


def wait_until(check, timeout: float = 180) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    streak = 0
    while time.monotonic() < deadline:
        try:
            streak = streak + 1 if check() else 0
        except requests.RequestException:
            streak = 0
        if streak >= 2 * WORKERS + 2:
            return
        time.sleep(0.5)
    raise RuntimeError("server did not become ready")


def json_request(path: str, data: bytes, **headers: str) -> load.Request:
    body = json.dumps({"image": base64.b64encode(data).decode()}).encode()
    return load.Request(path, body, {"Content-Type": "application/json", **headers})


def multipart_request(path: str, data: bytes) -> load.Request:
    boundary = uuid.uuid4().hex
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="img"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return load.Request(path, body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})


def main() -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    memory.keep_large_buffers()  # the in-process floor copies bodies as the servers do
    engine = PaddleOcrEngine.from_settings(Settings.from_env({}))
    engine.load()
    images = {name: (CORPUS / fname).read_bytes() for name, fname in IMAGES.items()}
    report: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "setup": {"workers": WORKERS, "threads": THREADS, "concurrency": CONCURRENCY,
                  "engine": engine.describe()},
        "images": {},
    }  # fmt: skip
    with EmbeddedRedis() as server:
        port, l2_port, naive_port = free_port(), free_port(), free_port()
        grpc_port = free_port()
        service = start_service(server.url, port, grpc_port)  # defaults: L1 on
        l2_only = start_service(server.url, l2_port, free_port(), CACHE_L1_BYTES="0")
        naive = start_naive(server.url, naive_port)
        # The hit path (issue 14): an echo app, and the L2-only service without the edge
        # (as behind a buffering proxy), both under the same gunicorn settings as the baseline.
        echo_port, direct_port = free_port(), free_port()
        echo = start_naive(server.url, echo_port, "bench.echo_app:app")
        l2_direct = start_service(
            server.url, direct_port, free_port(), CACHE_L1_BYTES="0", EDGE="none"
        )
        try:
            for p in (port, l2_port, direct_port):
                wait_until(lambda p=p: requests.get(f"http://127.0.0.1:{p}/readyz", timeout=5).ok)
            probe = json_request("/ocr", images["card"])
            wait_until(
                lambda: requests.post(
                    f"http://127.0.0.1:{naive_port}/ocr", data=probe.body,
                    headers=probe.headers, timeout=60,
                ).ok
            )  # fmt: skip
            hit_targets = {"service_l2": (l2_port, "/v1/ocr"),
                           "service_l2_direct": (direct_port, "/v1/ocr"),
                           "naive": (naive_port, "/ocr"), "echo": (echo_port, "/ocr")}  # fmt: skip
            report["hitpath"] = hitpath.measure(hit_targets, server.url, json_request)
            report["entry_size"] = entry_size.run(server.url)
            print(hitpath.table(report["hitpath"], report["entry_size"]), flush=True)
            for name, data in images.items():
                report["images"][name] = measure_image(engine, server.url, l2_port, port, data)
                print(name, json.dumps(report["images"][name], indent=1), flush=True)
            report["throughput"] = measure_throughput(port, l2_port, naive_port, images["card"])
            report["throughput"]["grpc"] = measure_grpc(f"127.0.0.1:{grpc_port}", images["card"])
            print(json.dumps(report["throughput"], indent=1), flush=True)
            report["burst"] = measure_burst(engine, port)
            # What any request costs through HTTP + gunicorn + Flask here: GET /healthz.
            healthz = load.Request("/healthz", b"", {}, method="GET")
            report["http_floor"] = load.run(port, healthz, 1, HIT_REQUESTS, 60)
            print(json.dumps(report["burst"], indent=1), flush=True)
        finally:
            for proc in (service, l2_only, naive, echo, l2_direct):
                proc.terminate()
                proc.wait(60)
    out = RESULTS / "foundation.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    hit = {"date": report["date"], "machine": report["machine"], "setup": report["setup"],
           "hitpath": report["hitpath"], "entry_size": report["entry_size"]}  # fmt: skip
    (RESULTS / "hitpath.json").write_text(json.dumps(hit, indent=2) + "\n")
    print(table(report))
    print(hitpath.table(report["hitpath"], report["entry_size"]))
    print(f"written to {out.relative_to(ROOT)}")
    return 0


def measure_image(engine: PaddleOcrEngine, redis_url: str, port: int, l1_port: int, data: bytes):  # type: ignore[no-untyped-def]
    """On the L2-only service: misses vs bare engine calls, hits vs the floor; then the
    same hits on the default service, whose L1 answers them."""
    b64 = base64.b64encode(data).decode()
    miss = json_request("/v1/ocr", data, **{"Cache-Control": "no-cache"})
    # Bare engine calls and forced misses, interleaved so both see the same machine.
    bare, missed = [], []
    for _ in range(MISS_REPEATS):
        start = time.perf_counter()
        engine.recognize(load.engine_request(engine, data))
        bare.append(time.perf_counter() - start)
        missed.append(load.run(port, miss, 1, 1, 600)["p50_ms"] / 1000)
    bare_ms, miss_ms = statistics.median(bare) * 1000, statistics.median(missed) * 1000
    hit_json = load.run(port, json_request("/v1/ocr", data), 1, HIT_REQUESTS, 120)
    hit_multipart = load.run(port, multipart_request("/v1/ocr", data), 1, HIT_REQUESTS, 120)
    load.run(l1_port, json_request("/v1/ocr", data), 1, 2, 60)  # into this worker's L1
    hit_l1 = load.run(l1_port, json_request("/v1/ocr", data), 1, HIT_REQUESTS, 120)
    # The service's entry for this image with the default parameters (hash-tagged MD5).
    (stored,) = redis.Redis.from_url(redis_url).keys(f"ocr:v1:*{{{hashlib.md5(data).hexdigest()}}}")
    floor_stats = load.hit_floor(redis_url, stored, b64, HIT_REQUESTS * 2)
    return {
        "bytes": len(data),
        "bare_engine_ms": bare_ms,
        "miss_ms": miss_ms,
        "miss_overhead_pct": (miss_ms - bare_ms) / bare_ms * 100,
        "hit_json": hit_json,
        "hit_multipart": hit_multipart,
        "hit_json_l1": hit_l1,
        "floor": floor_stats,
        "hit_json_p50_over_floor": hit_json["p50_ms"] / floor_stats["p50_ms"],
        "hit_multipart_p50_over_floor": hit_multipart["p50_ms"] / floor_stats["p50_ms"],
    }


def measure_throughput(port: int, l2_port: int, naive_port: int, data: bytes) -> dict:
    """Hot-image hits/s at concurrency 8: service (L1), service (L2 only), naive baseline,
    alternating, 3 rounds each; medians."""
    runs: dict[str, list[dict]] = {"service": [], "service_l2": [], "naive": []}
    targets = {"service": (port, "/v1/ocr"), "service_l2": (l2_port, "/v1/ocr"),
               "naive": (naive_port, "/ocr")}  # fmt: skip
    for _ in range(3):
        for name, (p, path) in targets.items():
            request = json_request(path, data)
            if load.wrk_available():
                runs[name].append(load.run_wrk(p, request, CONCURRENCY, THROUGHPUT_SECONDS))
            else:
                runs[name].append(
                    load.run(p, request, CONCURRENCY, THROUGHPUT_REQUESTS, THROUGHPUT_SECONDS)
                )
    rate = {name: statistics.median(r["per_second"] for r in rs) for name, rs in runs.items()}
    return {
        "service_hits_per_s": rate["service"],
        "service_l2_hits_per_s": rate["service_l2"],
        "naive_hits_per_s": rate["naive"],
        "ratio": rate["service"] / rate["naive"],
        "l2_ratio": rate["service_l2"] / rate["naive"],
        "errors": {name: sum(r["errors"] for r in rs) for name, rs in runs.items()},
        "p99_ms": {name: statistics.median(r["p99_ms"] for r in rs) for name, rs in runs.items()},
        "client": "wrk" if load.wrk_available() else "python processes",
    }


def measure_burst(engine: PaddleOcrEngine, port: int) -> dict:
    """32 identical cold requests at once: one engine call; latency vs one bare call."""
    data = (CORPUS / BURST_IMAGE).read_bytes()
    start = time.perf_counter()
    engine.recognize(load.engine_request(engine, data))
    bare_ms = (time.perf_counter() - start) * 1000
    before = _engine_calls(port)
    burst = load.run(port, json_request("/v1/ocr", data), 32, 32, 300)
    return {
        "image": BURST_IMAGE,
        "requests": burst["requests"],
        "errors": burst["errors"],
        "engine_calls": _engine_calls(port) - before,
        "bare_engine_ms": bare_ms,
        "p50_ms": burst["p50_ms"],
        "max_ms": burst["max_ms"],
    }


def _engine_calls(port: int) -> float:
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ocr_engine_calls_total{")
    )


def measure_grpc(endpoint: str, data: bytes) -> dict:
    """gRPC PipelineService hits for the hot image: latency at 1, hits/s at 8."""
    b64 = base64.b64encode(data).decode()
    load.run_grpc(endpoint, b64, 1, 5, 120)  # make sure the entry exists
    latency = load.run_grpc(endpoint, b64, 1, HIT_REQUESTS, 120)
    rates = [load.run_grpc(endpoint, b64, CONCURRENCY, THROUGHPUT_REQUESTS, 60) for _ in range(3)]
    return {
        "hit_p50_ms": latency["p50_ms"],
        "hit_p99_ms": latency["p99_ms"],
        "hits_per_s": statistics.median(r["per_second"] for r in rates),
        "errors": latency["errors"] + sum(r["errors"] for r in rates),
    }


def table(report: dict) -> str:
    rows = [
        "| image | bare engine ms | miss ms (overhead) | L2 hit p50/p99 ms JSON | "
        "L2 hit p50/p99 ms multipart | floor p50 ms | L2 hit p50 / floor | L1 hit p50/p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["images"].items():
        rows.append(
            f"| {name} ({r['bytes'] // 1024} KiB) | {r['bare_engine_ms']:.0f} | "
            f"{r['miss_ms']:.0f} ({r['miss_overhead_pct']:+.1f} %) | "
            f"{r['hit_json']['p50_ms']:.2f} / {r['hit_json']['p99_ms']:.2f} | "
            f"{r['hit_multipart']['p50_ms']:.2f} / {r['hit_multipart']['p99_ms']:.2f} | "
            f"{r['floor']['p50_ms']:.3f} | {r['hit_json_p50_over_floor']:.1f}x | "
            f"{r['hit_json_l1']['p50_ms']:.2f} / {r['hit_json_l1']['p99_ms']:.2f} |"
        )
    t, g, b = report["throughput"], report["throughput"]["grpc"], report["burst"]
    h = report["http_floor"]
    rows += [
        "",
        f"HTTP round trip through gunicorn + Flask (GET /healthz, same client): p50 "
        f"{h['p50_ms']:.2f} ms, p99 {h['p99_ms']:.2f} ms.",
        f"Hot-image hits/s at concurrency {CONCURRENCY} (card, client: {t['client']}): "
        "service with L1 "
        f"{t['service_hits_per_s']:.0f}, service L2 only {t['service_l2_hits_per_s']:.0f}, "
        f"naive baseline {t['naive_hits_per_s']:.0f} (ratios {t['ratio']:.2f}x and "
        f"{t['l2_ratio']:.2f}x).",
        f"gRPC (card, hot): hit p50 {g['hit_p50_ms']:.2f} ms, p99 {g['hit_p99_ms']:.2f} ms, "
        f"{g['hits_per_s']:.0f} hits/s at concurrency {CONCURRENCY}.",
        f"Coalesced burst: {b['requests']} identical cold requests ({b['image']}) at once -> "
        f"{b['engine_calls']:.0f} engine call(s); p50 {b['p50_ms']:.0f} ms, max "
        f"{b['max_ms']:.0f} ms vs one bare engine call {b['bare_engine_ms']:.0f} ms.",
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
