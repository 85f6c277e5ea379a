"""A small load generator: N client processes, one keep-alive connection each.

Processes rather than threads, so the client's own GIL does not cap the measured rate.
"""

from __future__ import annotations

import http.client
import multiprocessing as mp
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    path: str
    body: bytes
    headers: dict[str, str]


def _worker(port: int, req: Request, count: int, deadline: float, out: mp.Queue) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    latencies, errors = [], 0
    for _ in range(count):
        if time.monotonic() > deadline:
            break
        start = time.perf_counter()
        conn.request("POST", req.path, body=req.body, headers=req.headers)
        resp = conn.getresponse()
        resp.read()
        latencies.append(time.perf_counter() - start)
        if resp.status != 200:
            errors += 1
    conn.close()
    out.put((latencies, errors))


def _grpc_worker(endpoint: str, b64: str, count: int, deadline: float, out: mp.Queue) -> None:
    import grpc  # imported in the child only: the parent process never starts grpc

    from app.grpc_server import pb2, pb2_grpc

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
