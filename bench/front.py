"""`python -m bench.front`: what the slow-client shield (app/front.py) costs and buys.

Two `python -m app serve` instances on one private Redis, identical but for HTTP_FRONT
(true: asyncio h11 front -> gunicorn on a unix socket; false: gunicorn on the TCP port), one
worker x 8 threads each, L1 off (L2 hits: the path a later issue wants fast). Measured side by
side, interleaved in rounds: hit latency for the card image (JSON base64) on a keep-alive
connection and on a new connection per request, the empty round trip (`GET /healthz`), and
hit latency while 64 clients trickle headers and 64 trickle bodies. bench/results/front.json.
"""

from __future__ import annotations

import base64
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time

import requests

from app.embedded_redis import EmbeddedRedis, free_port
from bench import load
from bench.run import CORPUS, IMAGES, RESULTS, ROOT, _env

ROUNDS = int(os.environ.get("BENCH_FRONT_ROUNDS", "5"))
PER_ROUND = int(os.environ.get("BENCH_FRONT_PER_ROUND", "100"))
SLOW = 64


def start(redis_url: str, front: bool) -> tuple:  # type: ignore[type-arg]
    import subprocess

    port = free_port()
    env = _env(
        REDIS_URL=redis_url, HTTP_PORT=str(port), GRPC_PORT=str(free_port()), HOST="127.0.0.1",
        HTTP_FRONT="true" if front else "false", CACHE_L1_BYTES="0",
    )  # fmt: skip
    env.update(WEB_CONCURRENCY="1", WEB_THREADS="8")
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve"], cwd=ROOT, env=env)
    return proc, f"http://127.0.0.1:{port}", port


def ready(base: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{base}/readyz", timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base} never became ready")


def timed(fn, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def trickle(port: int, stop: threading.Event) -> list[socket.socket]:
    socks = []
    for i in range(SLOW):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(f"POST /v1/ocr HTTP/1.1\r\nHost: x\r\nX-Slow-{i}: ".encode())
        socks.append(s)
    for _ in range(SLOW):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/ocr HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
        socks.append(s)

    def run() -> None:
        while not stop.wait(0.5):
            for s in socks:
                try:
                    s.send(b"a")
                except OSError:
                    pass

    threading.Thread(target=run, daemon=True).start()
    return socks


def under_attack(base: str, port: int, body: dict) -> dict:
    stop = threading.Event()
    socks = trickle(port, stop)
    time.sleep(1.0)
    latencies, failures = [], 0
    for _ in range(20):
        started = time.perf_counter()
        try:
            requests.post(f"{base}/v1/ocr", json=body, timeout=5).raise_for_status()
            latencies.append(time.perf_counter() - started)
        except requests.RequestException:
            failures += 1
    stop.set()
    for s in socks:
        s.close()
    return {"hits": load.percentiles(latencies), "failed_or_over_5s": failures, "of": 20}


def main() -> int:
    data = (CORPUS / IMAGES["card"]).read_bytes()
    body = {"image": base64.b64encode(data).decode()}
    with EmbeddedRedis() as redis_server:
        servers = {name: start(redis_server.url, name == "front") for name in ("front", "direct")}
        try:
            for _, base, _ in servers.values():
                ready(base)
                requests.post(f"{base}/v1/ocr", json=body, timeout=120).raise_for_status()
            samples: dict[str, dict[str, list[float]]] = {
                name: {"hit_keepalive": [], "hit_new_connection": [], "healthz": []}
                for name in servers
            }
            sessions = {name: requests.Session() for name in servers}
            for _ in range(ROUNDS):
                for name, (_, base, _) in servers.items():
                    s = sessions[name]
                    samples[name]["hit_keepalive"] += timed(
                        lambda s=s, base=base: s.post(f"{base}/v1/ocr", json=body), PER_ROUND
                    )
                    samples[name]["hit_new_connection"] += timed(
                        lambda base=base: requests.post(f"{base}/v1/ocr", json=body),
                        PER_ROUND // 2,
                    )
                    samples[name]["healthz"] += timed(
                        lambda s=s, base=base: s.get(f"{base}/healthz"), PER_ROUND
                    )
            result: dict = {
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "image": IMAGES["card"],
                "layout": "1 worker x 8 threads each, L1 off, interleaved rounds",
            }
            for name in servers:
                result[name] = {k: load.percentiles(v) for k, v in samples[name].items()}
            p50 = {
                name: {k: statistics.median(v) for k, v in samples[name].items()}
                for name in servers
            }
            result["ratio_front_over_direct_p50"] = {
                k: round(p50["front"][k] / p50["direct"][k], 3) for k in p50["front"]
            }
            result["added_p50_ms"] = {
                k: round((p50["front"][k] - p50["direct"][k]) * 1000, 3) for k in p50["front"]
            }
            if os.environ.get("BENCH_FRONT_ATTACK", "1") != "0":
                result["under_128_slow_clients"] = {
                    name: under_attack(base, port, body)
                    for name, (_, base, port) in servers.items()
                }
        finally:
            for proc, _, _ in servers.values():
                proc.terminate()
            for proc, _, _ in servers.values():
                proc.wait(timeout=120)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "front.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
