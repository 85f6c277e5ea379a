"""`make bench`, part 2: global miss dispatch (issue 14 §1), measured side by side in one run.

One service on a private Redis, 2 granian front workers x 8 threads,
its misses on the global queue (the one cross-process miss path since issue 24; the
per-worker comparison of issue 14 is in git's history of docs/PERFORMANCE.md):

- **Engine utilization**: 20 distinct images, each first sent alone (its single-request
  time), then all 20 at once from 8 clients on an empty cache: utilization = sum of the
  single-request times / 2 engines / the concurrent wall time.
- **Trace with 80 % repeats** (10 distinct images x 5, shuffled, 12 clients): its wall time
  against the work-conserving ideal, the same 10 distinct images sent once each from 12
  clients on an empty cache (no repeats: every request is engine work); two of each,
  interleaved, the least wall time of each kind.
- **Engine busy fraction**: seconds the engines spent computing
  (``ocr_engine_duration_seconds``) / 2 engines / wall time, during the same runs: the
  utilization question asked of the engines themselves, robust to a background load that
  changes between the single-request phase and the concurrent one.
- **Through the service vs the same engines bare** (issue 36): the 20 distinct images at
  c=8 through the service (nginx -> front -> miss queue -> engine processes), and the same
  20 at c=8 sent straight to the same engine processes' direct endpoint
  (``/internal/v1/recognize``, round robin, the ``ENGINE_TOKEN`` the bench gives the
  service), in alternating order, BENCH_DISPATCH_PAIRS pairs on an empty cache each:
  ``service_vs_bare_engines`` = median bare wall time / median service wall time (the
  service's distinct-miss throughput over the bare engines'; target >= 0.95). Layout: one
  machine (os.cpu_count() cores), ``ENGINE_PROCESSES`` = 2 engine processes of one
  inference thread each (one per core, nice ``ENGINE_NICE``), one front of 2 granian
  workers x 8 threads behind nginx, the private Redis, and this process's 8 client threads;
  nothing else of the bench runs meanwhile.
- **Engine calls / distinct images** with 2 instances (a second dispatch service joins the
  first): the trace over both instances at 12 clients, then 16 identical cold requests at
  once.

Results: bench/results/dispatch.json. About 5 minutes on 2 cores.
"""

from __future__ import annotations

import base64
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
import requests

from app.embedded_redis import EmbeddedRedis
from app.engines import direct
from app.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("OCR_SHARED_DIR", ROOT.parent / "shared")) / "corpus"
RESULTS = ROOT / "bench" / "results"
WORKERS, THREADS = 2, 8
ROUNDS = int(os.environ.get("BENCH_DISPATCH_ROUNDS", "2"))
DISTINCT, CLIENTS = 20, 8
TRACE_DISTINCT, TRACE_REPEAT, TRACE_CLIENTS = 10, 5, 12
TRACE_PAIRS = 2  # ideal and trace runs per round, interleaved
BARE_PAIRS = int(os.environ.get("BENCH_DISPATCH_PAIRS", "3"))  # service / bare engine runs
TOKEN = "bench-dispatch-engine-token-0123456789"  # the engines' direct endpoint, here only
RETRIED: list[str] = []  # requests sent twice (reported in the results)


def pick_images() -> list[bytes]:
    """20 corpus images of ordinary size (20-400 KB), in name order: cards, receipts, pages."""
    files = sorted(
        p
        for p in CORPUS.iterdir()
        if p.suffix.lower() in (".jpg", ".png") and 20_000 <= p.stat().st_size <= 400_000
    )
    return [p.read_bytes() for p in files[:DISTINCT]]


class Service:
    def __init__(self, redis_url: str, **env: str) -> None:
        self.port = free_port()
        full = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        full.update(
            REDIS_URL=redis_url, HTTP_PORT=str(self.port), GRPC_ENABLED="false",
            HOST="127.0.0.1", WEB_CONCURRENCY=str(WORKERS),
            ENGINE_PROCESSES=str(WORKERS), WEB_THREADS=str(THREADS),
            LOG_LEVEL="warning", CACHE_L1_BYTES="0", REDIS_TIMEOUT_MS="250",
            ENGINE_TOKEN=TOKEN, ENGINE_DIRECT_MAX_INFLIGHT=str(CLIENTS),
        )  # fmt: skip
        full.update(env)  # a caller's settings over these (bench/fairness.py)
        self.proc = subprocess.Popen([sys.executable, "-m", "app", "serve"], cwd=ROOT, env=full)
        self.base = f"http://127.0.0.1:{self.port}"
        self.session = requests.Session()

    def wait_ready(self, timeout: float = 240) -> None:
        deadline, streak = time.monotonic() + timeout, 0
        while streak < 3 * WORKERS:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("service did not become ready")
            try:
                streak = streak + 1 if requests.get(f"{self.base}/readyz", timeout=2).ok else 0
            except requests.RequestException:
                streak = 0
            time.sleep(0.3)
        time.sleep(2)  # every worker's feeder has reported in (they heartbeat every second)

    def ocr(self, data: bytes) -> str:
        body = {"image": base64.b64encode(data).decode()}
        resp = requests.post(f"{self.base}/v1/ocr", json=body, timeout=300)
        if resp.status_code == 502:  # a front hop that failed (seen once under heavy load)
            RETRIED.append(resp.text[:200])
            resp = requests.post(f"{self.base}/v1/ocr", json=body, timeout=300)
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {resp.text[:200]}")
        return resp.headers.get("X-Cache", "")

    def engine_calls(self) -> float:
        return self._metric("ocr_engine_calls_total{")

    def engine_seconds(self) -> float:
        """Seconds the engines spent computing (summed over workers)."""
        return self._metric("ocr_engine_duration_seconds_sum{")

    def _metric(self, prefix: str) -> float:
        text = requests.get(f"{self.base}/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
        )

    def engine_urls(self) -> list[str]:
        """The direct endpoints of this service's engine processes (its children running
        ``-m app engine``; each one's ``ENGINE_PORT`` read from its environment)."""
        urls = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) != self.proc.pid:
                continue
            if [a for a in cmdline if a][-3:] != [b"-m", b"app", b"engine"]:
                continue
            port = next(v[12:].decode() for v in environ if v.startswith(b"ENGINE_PORT="))
            urls.append(f"http://127.0.0.1:{port}{direct.PATH}")
        return sorted(urls)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def bare(urls: Sequence[str], items: Sequence[bytes], clients: int) -> float:
    """Wall seconds for the engines' direct endpoints to answer ``items`` from ``clients``
    threads (request i to engine i % n), as a front calls them."""
    params = _default_params().to_dict()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}

    def call(i: int) -> None:
        body = json.dumps({"format": direct.FORMAT, "image": base64.b64encode(items[i]).decode(),
                           "params": params, "namespace": ""})  # fmt: skip
        resp = requests.post(urls[i % len(urls)], data=body, headers=headers, timeout=300)
        if resp.status_code != 200:
            raise RuntimeError(
                f"engine {urls[i % len(urls)]}: {resp.status_code} {resp.text[:200]}"
            )

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(call, range(len(items))))
    return time.perf_counter() - start


def _default_params():  # type: ignore[no-untyped-def]
    from app.config import Settings
    from app.engines import build_engine

    return build_engine(Settings.from_env({})).default_params


def service_vs_bare(service: Service, flush, images: list[bytes]) -> dict:  # type: ignore[no-untyped-def]
    """The same distinct images at c=CLIENTS through the service and to the same engines
    bare, alternating (the order flips each pair); medians of the wall times."""
    urls = service.engine_urls()
    through, direct_ = [], []
    for pair in range(BARE_PAIRS):
        for kind in ("service", "bare") if pair % 2 == 0 else ("bare", "service"):
            if kind == "service":
                flush()
                through.append(round(concurrent([service], images, CLIENTS), 3))
            else:
                direct_.append(round(bare(urls, images, CLIENTS), 3))
        print(f"pair {pair + 1}: service {through[-1]} s, bare engines {direct_[-1]} s", flush=True)
    return {
        "engines": urls,
        "images": len(images),
        "clients": CLIENTS,
        "service_wall_s": through,
        "bare_engines_wall_s": direct_,
        "service_images_per_s": round(len(images) / statistics.median(through), 3),
        "bare_engines_images_per_s": round(len(images) / statistics.median(direct_), 3),
        # throughput through the service / the same engines' bare throughput
        "service_vs_bare_engines": round(
            statistics.median(direct_) / statistics.median(through), 3
        ),
        "formula": "median(bare wall s) / median(service wall s), same images, same engine "
                   "processes, c=8, alternating",
    }  # fmt: skip


def concurrent(targets: Sequence[Service], items: Sequence[bytes], clients: int) -> float:
    """Wall seconds to answer ``items`` from ``clients`` threads (request i to target i % n)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda i: targets[i % len(targets)].ocr(items[i]), range(len(items))))
    return time.perf_counter() - start


def measure_round(service: Service, flush, images: list[bytes], trace: list[bytes]) -> dict:  # type: ignore[no-untyped-def]
    singles = []
    for data in images:  # each alone: its single-request (miss) time
        flush()
        start = time.perf_counter()
        assert service.ocr(data) == "MISS"
        singles.append(time.perf_counter() - start)
    flush()
    before, busy = service.engine_calls(), service.engine_seconds()
    wall = concurrent([service], images, CLIENTS)
    calls = service.engine_calls() - before
    busy = service.engine_seconds() - busy
    distinct = list(dict.fromkeys(trace))
    ideals, traces = [], []
    for _ in range(TRACE_PAIRS):  # interleaved; the least of each: a background load only adds
        flush()
        ideals.append(concurrent([service], distinct, TRACE_CLIENTS))
        flush()
        before, trace_busy = service.engine_calls(), service.engine_seconds()
        traces.append(concurrent([service], trace, TRACE_CLIENTS))
        trace_calls = service.engine_calls() - before
        trace_busy = service.engine_seconds() - trace_busy
    ideal, trace_wall = min(ideals), min(traces)
    return {
        "single_request_s": round(sum(singles), 3),
        "concurrent_wall_s": round(wall, 3),
        "utilization": round(sum(singles) / WORKERS / wall, 3),
        # The same question asked of the engines themselves: the fraction of the wall time
        # they were computing (robust to a background load that changes between phases).
        "engine_busy_fraction": round(busy / WORKERS / wall, 3),
        "engine_calls": calls,
        "trace_ideal_wall_s": round(ideal, 3),
        "trace_wall_s": round(trace_wall, 3),
        "trace_vs_ideal": round(ideal / trace_wall, 3),
        "trace_engine_busy_fraction": round(trace_busy / WORKERS / traces[-1], 3),
        "trace_engine_calls_per_distinct": round(trace_calls / len(distinct), 3),
    }


def main() -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    images = pick_images()
    rng = random.Random(14)
    trace = [images[i] for i in range(TRACE_DISTINCT) for _ in range(TRACE_REPEAT)]
    rng.shuffle(trace)
    report: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "setup": {
            "workers": WORKERS,
            "threads": THREADS,
            "rounds": ROUNDS,
            "utilization": f"{DISTINCT} distinct images, {CLIENTS} clients",
            "trace": f"{TRACE_DISTINCT} distinct x {TRACE_REPEAT} "
            f"({100 - 100 // TRACE_REPEAT} % repeats), {TRACE_CLIENTS} clients",
        },  # fmt: skip
    }
    report["layout"] = {
        "cores": os.cpu_count(),
        "engine_processes": WORKERS,
        "engines_per_core": WORKERS / (os.cpu_count() or 1),
        "front": f"1 front: nginx + {WORKERS} granian workers x {THREADS} threads, gRPC off",
        "also": "the private Redis; this process's client threads; nothing else of the bench",
    }
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)

        def flush() -> None:  # the entries only: the dispatch queue and its engines stay
            keys = [k for k in client.scan_iter("ocr:*")]
            if keys:
                client.delete(*keys)

        services = {"dispatch": Service(server.url)}
        try:
            for service in services.values():
                service.wait_ready()
            for service in services.values():  # warm it (first calls are slower)
                flush()
                concurrent([service], images[:4], 4)
            rounds: dict[str, list[dict]] = {name: [] for name in services}
            for r in range(ROUNDS):
                for name, service in services.items():
                    rounds[name].append(measure_round(service, flush, images, trace))
                    print(f"round {r + 1} {name}: {rounds[name][-1]}", flush=True)
            report["single_instance"] = {
                name: {"rounds": rs, **_medians(rs)} for name, rs in rounds.items()
            }
            report["vs_bare_engines"] = service_vs_bare(services["dispatch"], flush, images)
            print(f"vs bare engines: {report['vs_bare_engines']}", flush=True)
            second = Service(server.url)
            services["second"] = second
            second.wait_ready()
            report["two_instances"] = measure_two(
                [services["dispatch"], second], flush, trace, images[DISTINCT - 1]
            )
        finally:
            for service in services.values():
                service.stop()
    report["requests_retried_after_502"] = len(RETRIED)
    out = RESULTS / "dispatch.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=2))
    print(f"wrote {out}")
    return 0


def measure_two(targets: list[Service], flush, trace: list[bytes], burst: bytes) -> dict:  # type: ignore[no-untyped-def]
    flush()
    before = sum(t.engine_calls() for t in targets)
    wall = concurrent(targets, trace, TRACE_CLIENTS)
    trace_calls = sum(t.engine_calls() for t in targets) - before
    flush()
    before = sum(t.engine_calls() for t in targets)
    concurrent(targets, [burst] * 16, 16)
    burst_calls = sum(t.engine_calls() for t in targets) - before
    distinct = len(set(trace))
    return {
        "trace_requests": len(trace),
        "trace_distinct": distinct,
        "trace_wall_s": round(wall, 3),
        "trace_engine_calls": trace_calls,
        "burst_requests": 16,
        "burst_engine_calls": burst_calls,
        "engine_calls_per_distinct": round((trace_calls + burst_calls) / (distinct + 1), 3),
    }


def _medians(rounds: list[dict]) -> dict:
    keys = ("utilization", "engine_busy_fraction", "trace_vs_ideal",
            "trace_engine_busy_fraction", "trace_engine_calls_per_distinct")  # fmt: skip
    return {f"median_{k}": round(statistics.median(r[k] for r in rounds), 3) for k in keys}


if __name__ == "__main__":
    sys.exit(main())
