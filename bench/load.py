"""A small load generator: N client processes, one keep-alive connection each.

Processes rather than threads, so the client's own GIL does not cap the measured rate.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import multiprocessing as mp
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis


@dataclass(frozen=True)
class Request:
    path: str
    body: bytes
    headers: dict[str, str]
    method: str = "POST"


def _worker(port: int, req: Request, count: int, deadline: float, out: mp.Queue) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    latencies, errors = [], 0
    for _ in range(count):
        if time.monotonic() > deadline:
            break
        start = time.perf_counter()
        conn.request(req.method, req.path, body=req.body or None, headers=req.headers)
        resp = conn.getresponse()
        resp.read()
        latencies.append(time.perf_counter() - start)
        if resp.status != 200:
            errors += 1
    conn.close()
    out.put((latencies, errors))


def _grpc_worker(endpoint: str, b64: str, count: int, deadline: float, out: mp.Queue) -> None:
    import grpc  # imported in the child only: the parent process never starts grpc

    from app.protocols.pipeline_stubs import pb2, pb2_grpc

    stub = pb2_grpc.PipelineServiceStub(grpc.insecure_channel(endpoint))
    request = pb2.Request(key=["image"], value=[b64])
    latencies, errors = [], 0
    for _ in range(count):
        if time.monotonic() > deadline:
            break
        start = time.perf_counter()
        reply = stub.inference(request, timeout=120)
        latencies.append(time.perf_counter() - start)
        errors += reply.err_no != 0
    out.put((latencies, errors))


def run(port: int, req: Request, concurrency: int, total: int, max_seconds: float) -> dict:
    """Send ``total`` HTTP requests over ``concurrency`` connections."""
    return _pool(_worker, (port, req), concurrency, total, max_seconds)


def run_grpc(endpoint: str, b64: str, concurrency: int, total: int, max_seconds: float) -> dict:
    """Send ``total`` PipelineService/inference calls over ``concurrency`` channels."""
    return _pool(_grpc_worker, (endpoint, b64), concurrency, total, max_seconds)


def _pool(target, args: tuple, concurrency: int, total: int, max_seconds: float) -> dict:  # type: ignore[no-untyped-def]
    """Rate and latencies of ``total`` requests spread over ``concurrency`` processes."""
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    per = max(1, total // concurrency)
    deadline = time.monotonic() + max_seconds
    procs = [
        ctx.Process(target=target, args=(*args, per, deadline, out)) for _ in range(concurrency)
    ]
    start = time.perf_counter()
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    elapsed = time.perf_counter() - start
    for p in procs:
        p.join()
    latencies = sorted(x for lat, _ in results for x in lat)
    return {
        "requests": len(latencies),
        "errors": sum(e for _, e in results),
        "seconds": elapsed,
        "per_second": len(latencies) / elapsed,
        **percentiles(latencies),
    }


def percentiles(latencies: list[float]) -> dict:
    xs = sorted(latencies)
    if not xs:
        return {}

    def pct(p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000

    return {
        "p50_ms": pct(0.50),
        "p90_ms": pct(0.90),
        "p99_ms": pct(0.99),
        "max_ms": xs[-1] * 1000,
        "n": len(xs),
    }


def wrk_available() -> bool:
    return shutil.which("wrk") is not None


def run_wrk(
    port: int, req: Request, concurrency: int, seconds: float, timeout: str | None = None
) -> dict:
    """The same load with wrk (C, event loop): the client then costs far less CPU than the
    service, so rates compare servers rather than Python clients. 2 client threads. Errors
    are non-2xx answers and wrk's socket errors (a timed-out or reset request is no answer)."""
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body"
        body.write_bytes(req.body)
        script = Path(tmp) / "post.lua"
        headers = "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in req.headers.items())
        script.write_text(
            f'wrk.method = "POST"\nlocal f = io.open("{body}", "rb")\n'
            f'wrk.body = f:read("*all")\nf:close()\n{headers}'
        )
        limit = ["--timeout", timeout] if timeout else []
        out = subprocess.run(
            ["wrk", "-t2", f"-c{concurrency}", f"-d{seconds:g}s", "--latency", *limit,
             "-s", str(script), f"http://127.0.0.1:{port}{req.path}"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    socket_errors = sum(int(n) for n in sock.groups()) if sock else 0
    return {
        "per_second": float(rate.group(1)) if rate else 0.0,
        "requests": int(total.group(1)) if total else 0,
        "p50_ms": _ms(re.search(r"50%\s+([\d.]+)(us|ms|s)", out)),
        "p99_ms": _ms(re.search(r"99%\s+([\d.]+)(us|ms|s)", out)),
        "non_2xx": int(non_2xx.group(1)) if non_2xx else 0,
        "socket_errors": socket_errors,
        "errors": (int(non_2xx.group(1)) if non_2xx else 0) + socket_errors,
        "client": "wrk",
    }


def _ms(match: re.Match | None) -> float | None:
    if match is None:
        return None
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[match.group(2)]
    return float(match.group(1)) * scale


def hit_floor(redis_url: str, key: str | bytes, b64: str, n: int) -> dict:
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
    return percentiles(latencies)


def engine_request(engine: Any, data: bytes) -> Any:
    """A bare engine call's request for ``data`` with the engine's default parameters (the
    benchmarks' side-by-side reference for misses)."""
    from app.engines.base import OcrRequest
    from app.imaging import decode_image

    return OcrRequest(data, decode_image(data, 60_000_000), engine.default_params)
