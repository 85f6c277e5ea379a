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

from app.config import Settings
from app.embedded_redis import EmbeddedRedis, free_port
from app.engines.paddle import PaddleOcrEngine
from app.gunicorn_app import gunicorn_options
from app.imaging import decode_image
from bench import load

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("OCR_SHARED_DIR", ROOT.parent / "shared")) / "corpus"
RESULTS = ROOT / "bench" / "results"
IMAGES = {  # card / receipt / page, as in ENGINES.md
    "card": "paddleocr_doc_00006737.jpg",
    "receipt": "sroie_000.jpg",
    "page": "tesseract_phototest.png",
}
WORKERS, THREADS, CONCURRENCY = 2, 8, 8
HIT_REQUESTS = int(os.environ.get("BENCH_HIT_REQUESTS", "400"))
THROUGHPUT_REQUESTS = int(os.environ.get("BENCH_THROUGHPUT_REQUESTS", "4000"))
MISS_REPEATS = int(os.environ.get("BENCH_MISS_REPEATS", "5"))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(WEB_CONCURRENCY=str(WORKERS), WEB_THREADS=str(THREADS), LOG_LEVEL="warning", **extra)
    return env


def start_service(redis_url: str, port: int, grpc_port: int) -> subprocess.Popen:
    env = _env(REDIS_URL=redis_url, HTTP_PORT=str(port), GRPC_PORT=str(grpc_port), HOST="127.0.0.1")
    return subprocess.Popen([sys.executable, "-m", "app", "serve"], cwd=ROOT, env=env)


def start_naive(redis_url: str, port: int) -> subprocess.Popen:
    opts = gunicorn_options(Settings.from_env({}))
    args = [
        sys.executable, "-m", "gunicorn", "bench.naive_app:app",
        "--bind", f"127.0.0.1:{port}", "--workers", str(WORKERS),
        "--worker-class", opts["worker_class"], "--threads", str(THREADS),
        "--timeout", str(opts["timeout"]), "--keep-alive", str(opts["keepalive"]),
        "--log-level", "warning",
    ]  # fmt: skip
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


def floor(redis_url: str, key: str, b64: str, n: int) -> dict:
    """The least any hit can cost in-process: base64 decode + MD5 + GET of the stored value."""
    client = redis.Redis.from_url(redis_url)
    latencies = []
    for _ in range(n):
        start = time.perf_counter()
        data = base64.b64decode(b64)
        hashlib.md5(data).hexdigest()
        value = client.get(key)
        latencies.append(time.perf_counter() - start)
        assert value
    return load.percentiles(latencies)


def main() -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    engine = PaddleOcrEngine(Settings.from_env({}))
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
        port, naive_port, grpc_port = free_port(), free_port(), free_port()
        service = start_service(server.url, port, grpc_port)
        naive = start_naive(server.url, naive_port)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: requests.get(f"{base}/readyz", timeout=5).ok)
            probe = json_request("/ocr", images["card"])
            wait_until(
                lambda: requests.post(
                    f"http://127.0.0.1:{naive_port}/ocr", data=probe.body,
                    headers=probe.headers, timeout=60,
                ).ok
            )  # fmt: skip
            for name, data in images.items():
                report["images"][name] = measure_image(engine, server.url, port, name, data)
                print(name, json.dumps(report["images"][name], indent=1), flush=True)
            report["throughput"] = measure_throughput(port, naive_port, images["card"])
            report["throughput"]["grpc"] = measure_grpc(f"127.0.0.1:{grpc_port}", images["card"])
            print(json.dumps(report["throughput"], indent=1), flush=True)
        finally:
            for proc in (service, naive):
                proc.terminate()
                proc.wait(60)
    out = RESULTS / "foundation.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"written to {out.relative_to(ROOT)}")
    return 0


def measure_image(engine: PaddleOcrEngine, redis_url: str, port: int, name: str, data: bytes):  # type: ignore[no-untyped-def]
    b64 = base64.b64encode(data).decode()
    miss = json_request("/v1/ocr", data, **{"Cache-Control": "no-cache"})
    # Bare engine calls and forced misses, interleaved so both see the same machine.
    bare, missed = [], []
    for _ in range(MISS_REPEATS):
        start = time.perf_counter()
        engine.recognize(decode_image(data, 60_000_000))
        bare.append(time.perf_counter() - start)
        missed.append(load.run(port, miss, 1, 1, 600)["p50_ms"] / 1000)
    bare_ms, miss_ms = statistics.median(bare) * 1000, statistics.median(missed) * 1000
    hit_json = load.run(port, json_request("/v1/ocr", data), 1, HIT_REQUESTS, 120)
    hit_multipart = load.run(port, multipart_request("/v1/ocr", data), 1, HIT_REQUESTS, 120)
    # The service's entry for this image with the default parameters (hash-tagged MD5).
    (stored,) = redis.Redis.from_url(redis_url).keys(f"ocr:v1:*{{{hashlib.md5(data).hexdigest()}}}")
    floor_stats = floor(redis_url, stored, b64, HIT_REQUESTS * 2)
    return {
        "bytes": len(data),
        "bare_engine_ms": bare_ms,
        "miss_ms": miss_ms,
        "miss_overhead_pct": (miss_ms - bare_ms) / bare_ms * 100,
        "hit_json": hit_json,
        "hit_multipart": hit_multipart,
        "floor": floor_stats,
        "hit_json_p50_over_floor": hit_json["p50_ms"] / floor_stats["p50_ms"],
        "hit_multipart_p50_over_floor": hit_multipart["p50_ms"] / floor_stats["p50_ms"],
    }


def measure_throughput(port: int, naive_port: int, data: bytes) -> dict:
    """Hot-image hits/s at concurrency 8, service and baseline alternating, 3 rounds each."""
    ours, naive = [], []
    for _ in range(3):
        ours.append(load.run(port, json_request("/v1/ocr", data), CONCURRENCY,
                             THROUGHPUT_REQUESTS, 60))  # fmt: skip
        naive.append(load.run(naive_port, json_request("/ocr", data), CONCURRENCY,
                              THROUGHPUT_REQUESTS, 60))  # fmt: skip
    ours_rate = statistics.median(r["per_second"] for r in ours)
    naive_rate = statistics.median(r["per_second"] for r in naive)
    return {
        "service_hits_per_s": ours_rate,
        "naive_hits_per_s": naive_rate,
        "ratio": ours_rate / naive_rate,
        "service_errors": sum(r["errors"] for r in ours),
        "naive_errors": sum(r["errors"] for r in naive),
        "service_p99_ms": statistics.median(r["p99_ms"] for r in ours),
        "naive_p99_ms": statistics.median(r["p99_ms"] for r in naive),
    }


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
        "| image | bare engine ms | miss ms (overhead) | hit p50/p99 ms JSON | "
        "hit p50/p99 ms multipart | floor p50 ms | hit p50 / floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in report["images"].items():
        rows.append(
            f"| {name} ({r['bytes'] // 1024} KiB) | {r['bare_engine_ms']:.0f} | "
            f"{r['miss_ms']:.0f} ({r['miss_overhead_pct']:+.1f} %) | "
            f"{r['hit_json']['p50_ms']:.2f} / {r['hit_json']['p99_ms']:.2f} | "
            f"{r['hit_multipart']['p50_ms']:.2f} / {r['hit_multipart']['p99_ms']:.2f} | "
            f"{r['floor']['p50_ms']:.3f} | {r['hit_json_p50_over_floor']:.1f}x |"
        )
    t = report["throughput"]
    rows.append("")
    rows.append(
        f"Hot-image hits/s at concurrency {CONCURRENCY}: service {t['service_hits_per_s']:.0f}, "
        f"naive baseline {t['naive_hits_per_s']:.0f} (ratio {t['ratio']:.2f}x)"
    )
    g = t["grpc"]
    rows.append(
        f"gRPC (card, hot): hit p50 {g['hit_p50_ms']:.2f} ms, p99 {g['hit_p99_ms']:.2f} ms, "
        f"{g['hits_per_s']:.0f} hits/s at concurrency {CONCURRENCY}"
    )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
