"""`python -m bench.edge` (issues 23, 36, 45): the service's hits against the seed, echo
apps, and the candidate servers for the front, behind one nginx.

Every server in one run, on one private Redis (docker/redis.conf: maxmemory, allkeys-lru),
behind the same nginx template (``app.edge``) on a unix socket, 2 worker processes each, the
same malloc thresholds (``bench.run.MALLOC``):

- ``service``: ``python -m app serve`` as users run it (the front under granian WSGI,
  EDGE=nginx, access log on, gRPC on; 2 engine processes and the front's 2 workers), L1 off
  (CACHE_L1_BYTES=0: every hit is an L2 hit);
- ``front_gthread``: the same front app (``app.front_server:load_worker``, gRPC on) under
  gunicorn gthread, 2 x WEB_THREADS, as it shipped before granian;
- ``seed``: the seed design (bench/naive_app.py: Flask + Redis GET + json.loads) under
  gunicorn sync, 2 workers;
- echo (bench/echo_app.py: reads the body, answers a constant) under each candidate server:
  ``echo_gthread`` (gunicorn gthread 2 x 8), ``echo_granian`` (granian WSGI),
  ``echo_granian_asgi``, ``echo_granian_rsgi``, ``echo_uvicorn`` (uvicorn, uvloop +
  httptools, ASGI).

For the 5 / 100 / 312 KB images (bench/hitpath.py's) and wrk -t2 -c8: hits/s, p50, p99 and
the CPU each server's processes spent per request (read from /proc around every wrk run:
the server's, nginx's, Redis's), the servers alternating (the order rotating) over ROUNDS
rounds; medians; the floor the design sets where bodies are large (MD5 for the key + SHA-256
for the check). The in-process figure beside it: the front's WSGI app called directly, one
thread (bench/hitsplit.py's ``in_process``). Then, on the service alone (5 KB hits, quiet and
loaded rounds alternating): the hit p99 while 8 clients send distinct misses; hits/s while
every engine process is stopped (SIGSTOP) and 12 misses wait; the front workers' resident
memory after those large misses; and 128 slow clients while 20 hits are timed. Results:
bench/results/edge.json; a table on stdout.

Environment: BENCH_EDGE_ROUNDS (3), BENCH_EDGE_SECONDS (6 per wrk run),
BENCH_EDGE_WARMUP_SECONDS (2), BENCH_EDGE_FLOOR_SECONDS (0.5 of hashing per size and step),
BENCH_EDGE_LOAD_ROUNDS (3: quiet/loaded pairs in each of the two load phases; the issue's
method asks at least 3 rounds for every target),
BENCH_EDGE_SERVERS (comma-separated names: a subset; service and the references always).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import http.client
import json
import os
import platform
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pybase64
import requests

from app.config import Settings
from app.edge import Edge, find_nginx, nginx_version
from app.embedded_redis import EmbeddedRedis
from app.front_server import cpu_seconds
from app.ports import free_port
from bench import cpu, load, run
from bench.hitpath import CORPUS, SIZES
from bench.reference import gunicorn_args
from tests.helpers import app_children, front_workers_of

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# name -> (app, the server's command for it on a unix socket, its request path)
ECHO = "bench.echo_app"
REFERENCES = ("seed", "echo_gthread", "echo_granian")
SERVERS = ("service", "front_gthread", *REFERENCES, "echo_granian_asgi", "echo_granian_rsgi",
           "echo_uvicorn")  # fmt: skip
CONCURRENCIES = (8,)
ROUNDS = int(os.environ.get("BENCH_EDGE_ROUNDS", "3"))
SECONDS = max(1, round(float(os.environ.get("BENCH_EDGE_SECONDS", "6"))))  # wrk: whole s
WARMUP_SECONDS = max(1, round(float(os.environ.get("BENCH_EDGE_WARMUP_SECONDS", "2"))))
FLOOR_SECONDS = float(os.environ.get("BENCH_EDGE_FLOOR_SECONDS", "0.5"))
WRK_THREADS = 2  # as bench/load.run_wrk
WRK_TIMEOUT = "10s"  # a slow answer is a latency, not a dropped request (wrk's default: 2 s)
LOAD_ROUNDS = int(os.environ.get("BENCH_EDGE_LOAD_ROUNDS", "3"))
READY_SECONDS = 600  # three servers load their engines at once on a small machine
# The front's threads per worker as users get them (the gthread front and echo: 8 threads).
THREADS = Settings.from_env({}).server.web_threads
ECHO_THREADS = 8
# Issue 45's targets.
VS_SEED = {"5KB": 3.0, "100KB": 2.5, "312KB": 2.5}  # L2 hits/s over the seed's, same nginx
VS_ECHO_GTHREAD = {"5KB": 1.0, "100KB": 1.0}  # ... over echo under gunicorn gthread
VS_ECHO_GRANIAN = {"5KB": 0.35}  # ... over echo under granian WSGI
CPU_VS_IN_PROCESS = 2.0  # the server's CPU per 5 KB hit <= 2x the app's in-process CPU
MISS_TAIL = 3.0  # hit p99 while 8 clients send distinct misses <= 3x the quiet p99
STOPPED_SHARE = 0.8  # hits/s with every engine stopped and 12 misses waiting >= 0.8x quiet
RSS_MB = 250  # each front worker's resident memory
MISS_CLIENTS, STOPPED_MISSES = 8, 12
TAIL = 4.0  # issue 23's: p99 <= 4x p50 at c=8 (reported)
SLOW_HEADERS, SLOW_BODIES, SLOW_HITS, SLOW_LIMIT_S = 64, 64, 20, 1.0
TRICKLE_S = 0.5  # a byte per slow connection every this often
SLOW_BODY_BYTES = 10 * 1024 * 1024  # announced, never sent (MAX_REQUEST_BYTES is 20 MiB)


@dataclass
class Server:
    name: str
    port: int
    path: str  # where hits are POSTed
    log: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    edge: Edge | None = None


# ---------------------------------------------------------------- processes


def _spawn(args: list[str], log: Path, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """In its own process group (stopped with it), stdout and stderr to ``log``; SIGTERM
    (a graceful stop) should this process die without stopping it."""
    with log.open("ab") as out:
        return subprocess.Popen(
            args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_term_with_parent,
        )  # fmt: skip


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent goes (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group (gunicorn stops gracefully, quitting its nginx first),
    SIGKILL after 60 s; then SIGKILL to whatever is left of the group."""
    with contextlib.suppress(ProcessLookupError):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def _output_to(log: Path) -> Iterator[None]:
    """This process's stdout and stderr to ``log`` while a child inherits them (nginx writes
    its access log to its stdout, and Edge.start gives it ours)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with log.open("ab") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def start_service(server: Server, redis_url: str, cwd: Path, **extra: str) -> None:
    """``python -m app serve``; ``extra`` settings over the bench's (a ``GRPC_PORT`` too)."""
    settings = {"GRPC_PORT": str(free_port()), "CACHE_L1_BYTES": "0", **extra}
    env = run._env(REDIS_URL=redis_url, HOST="127.0.0.1", HTTP_PORT=str(server.port), **settings)
    env["WEB_THREADS"] = str(THREADS)  # as users get it (bench.run pins 8)
    server.procs.append(_spawn([sys.executable, "-m", "app", "serve"], server.log, cwd, env))


def server_command(name: str, socket_path: Path) -> list[str]:
    """The command that serves ``name``'s app on ``socket_path``, 2 worker processes."""
    workers = str(run.WORKERS)
    granian = [sys.executable, "-m", "granian", "--uds", str(socket_path), "--workers", workers,
               "--http", "1", "--no-ws", "--log-level", "warning"]  # fmt: skip
    bind = f"unix:{socket_path}"
    if name == "seed":
        return gunicorn_args("bench.naive_app:app", bind, run.WORKERS, 1, "sync")
    if name == "front_gthread":
        return gunicorn_args("app.front_server:load_worker()", bind, run.WORKERS, THREADS)
    if name == "echo_gthread":
        return gunicorn_args(f"{ECHO}:app", bind, run.WORKERS, ECHO_THREADS)
    if name == "echo_granian":
        return [*granian, "--interface", "wsgi", "--blocking-threads", str(ECHO_THREADS),
                f"{ECHO}:app"]  # fmt: skip
    if name == "echo_granian_asgi":
        return [*granian, "--interface", "asginl", f"{ECHO}:asgi_app"]
    if name == "echo_granian_rsgi":
        return [*granian, "--interface", "rsgi", f"{ECHO}:rsgi_app"]
    if name == "echo_uvicorn":
        return [sys.executable, "-m", "uvicorn", "--uds", str(socket_path), "--workers", workers,
                "--loop", "uvloop", "--http", "httptools", "--no-access-log",
                "--log-level", "warning", f"{ECHO}:asgi_app"]  # fmt: skip
    raise ValueError(name)


def start_behind_edge(server: Server, redis_url: str, tmp: Path, nginx: str) -> None:
    """``server``'s app under its server on a unix socket, the service's own nginx edge in
    front (its configuration checked here, started by ``start_edge``)."""
    socket_path = tmp / f"{server.name}.sock"
    # The settings the service reads (the same environment): the same edge.
    settings = Settings.from_env(run._env(HOST="127.0.0.1", HTTP_PORT=str(server.port)))
    env = run._env(REDIS_URL=redis_url, CACHE_L1_BYTES="0", GRPC_PORT=str(free_port()),
                   PROMETHEUS_MULTIPROC_DIR=str(tmp / f"{server.name}-metrics"))  # fmt: skip
    env["WEB_THREADS"] = str(THREADS)
    os.makedirs(env["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
    server.procs.append(_spawn(server_command(server.name, socket_path), server.log, ROOT, env))
    server.edge = Edge(settings, str(socket_path), nginx)
    server.edge.check()


def cpu_roots(server: Server) -> list[int]:
    """The processes whose trees are ``server``'s for CPU accounting: the front under
    ``serve`` (not the engines), else the server's main process; and its nginx."""
    roots = [server.procs[0].pid]
    if server.name == "service":
        roots = app_children(roots[0], "front")
    if server.edge is not None and server.edge.pid is not None:
        roots.append(server.edge.pid)
    return roots


def start_edge(server: Server) -> None:
    """After every ``_spawn``: Edge.start leaves a thread behind, and a child forked from a
    process with threads should not run Python (``_spawn``'s preexec_fn) before its exec."""
    assert server.edge is not None
    with _output_to(server.log):
        server.edge.start()


def stop(server: Server) -> None:
    if server.edge is not None:
        with contextlib.suppress(Exception):
            server.edge.quit()
    for proc in server.procs:
        _stop(proc)


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def wait_ready(server: Server, check: Callable[[], bool]) -> None:
    try:
        run.wait_until(check, READY_SECONDS)
    except RuntimeError:
        raise RuntimeError(f"{server.name} did not become ready (log: {server.log})") from None
    for proc in server.procs:
        if proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {proc.returncode} (log: {server.log})")


# ---------------------------------------------------------------- load


def wrk(port: int, req: load.Request, concurrency: int, seconds: int) -> dict:
    """bench/load.run_wrk with a request timeout (a request that takes longer is an error)."""
    return load.run_wrk(port, req, concurrency, seconds, WRK_TIMEOUT)


def post(port: int, req: load.Request, timeout: float = 600) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", req.path, body=req.body, headers=req.headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def cache_status(body: bytes) -> str:
    """The REST answer's ``cache`` (and ``cache_tier``) fields, e.g. "hit/l2"."""
    try:
        answer = json.loads(body)
    except ValueError:
        return "?"
    status = str(answer.get("cache", "?"))
    return f"{status}/{answer['cache_tier']}" if answer.get("cache_tier") else status


def measure_size(
    servers: dict[str, Server], requests_: dict[str, load.Request], redis_pid: int
) -> dict:
    """One size: wrk at each concurrency, ROUNDS rounds, the servers alternating (the order
    rotating); around each run, the CPU its server's processes, nginx and Redis spent."""
    for s in servers.values():  # warm-up, at the higher concurrency
        wrk(s.port, requests_[s.name], max(CONCURRENCIES), WARMUP_SECONDS)
    names = list(servers)
    out: dict[str, Any] = {}
    for concurrency in CONCURRENCIES:
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        for round_ in range(ROUNDS):
            k = round_ % len(names)
            for name in names[k:] + names[:k]:
                s = servers[name]
                r, r["cpu_us_per_request"] = cpu.per_request(
                    lambda s=s, c=concurrency: wrk(s.port, requests_[s.name], c, SECONDS),
                    cpu_roots(s), redis_pid,
                )  # fmt: skip
                runs[name].append(r)

        hits = _medians(runs, "per_second")
        p50, p99 = _medians(runs, "p50_ms"), _medians(runs, "p99_ms")
        cpu_us = {
            name: {part: statistics.median(r["cpu_us_per_request"][part] for r in rs)
                   for part in ("server", "nginx", "redis", "wrk")}
            for name, rs in runs.items()
        }  # fmt: skip
        out[f"c{concurrency}"] = {
            "concurrency": concurrency,
            "hits_per_s": hits,
            "p50_ms": p50,
            "p99_ms": p99,
            "cpu_us_per_request": cpu_us,
            "errors": {n: sum(r["errors"] for r in rs) for n, rs in runs.items()},
            "service_vs": {n: _ratio(hits["service"], hits[n]) for n in names if n != "service"},
            "service_p99_over_p50": _ratio(p99["service"], p50["service"]),
            "runs": runs,
        }
    return out


def _medians(runs: dict[str, list[dict]], metric: str) -> dict[str, float]:
    out = {}
    for name, rs in runs.items():
        values = [r[metric] for r in rs if r[metric] is not None]
        out[name] = statistics.median(values) if values else float("nan")
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b and b == b else float("nan")


# ---------------------------------------------------------------- the digest floor


def digest_floor(data: bytes) -> dict:
    """CPU time per hit of what the design must do with the image bytes (MD5 for the key,
    SHA-256 for the check), and of base64 decoding apart; the ceiling these set on hits/s
    with every core of this machine hashing and nothing else."""
    b64 = pybase64.b64encode(data)

    def per_call(step: Callable[[], object]) -> float:
        step()
        n, spent = 0, 0.0
        start = time.thread_time()
        while spent < FLOOR_SECONDS or n < 20:
            step()
            n += 1
            spent = time.thread_time() - start
        return spent / n

    digests = per_call(lambda: (hashlib.md5(data).digest(), hashlib.sha256(data).digest()))
    decode = per_call(lambda: pybase64.b64decode(b64, validate=True))
    cores = os.cpu_count() or 1
    return {
        "md5_sha256_us": digests * 1e6,
        "b64decode_us": decode * 1e6,
        "md5_sha256_b64decode_us": (digests + decode) * 1e6,
        "cores": cores,
        "ceiling_hits_per_s": cores / digests,
        "ceiling_with_b64decode_hits_per_s": cores / (digests + decode),
    }


# ---------------------------------------------------------------- slow clients


def slow_clients(port: int, hit: load.Request) -> dict:
    """64 connections trickling a request head, 64 trickling a large body after a complete
    head, a byte each every TRICKLE_S; meanwhile SLOW_HITS sequential hits, each on a new
    connection, timed."""
    head = (
        b"POST /v1/ocr HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"X-Padding: " + b"p" * 2000 + b"\r\n\r\n"
    )
    body_head = (
        f"POST /v1/ocr HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {SLOW_BODY_BYTES}\r\n\r\n"
    ).encode()
    body = b'{"image": "' + b"A" * 4000
    slow: list[tuple[socket.socket, bytes]] = []
    for i in range(SLOW_HEADERS + SLOW_BODIES):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        if i >= SLOW_HEADERS:
            sock.sendall(body_head)
        sock.setblocking(False)
        slow.append((sock, head if i < SLOW_HEADERS else body))
    stop = threading.Event()
    sent = [0] * len(slow)
    send_failures = [0]

    def trickle() -> None:
        while not stop.is_set():
            for i, (sock, data) in enumerate(slow):
                if sent[i] < len(data):
                    try:
                        sent[i] += sock.send(data[sent[i] : sent[i] + 1])
                    except OSError:
                        send_failures[0] += 1
                        sent[i] = len(data)  # closed: stop sending on it
            stop.wait(TRICKLE_S)

    thread = threading.Thread(target=trickle, name="trickle", daemon=True)
    thread.start()
    results = []
    try:
        time.sleep(2 * TRICKLE_S + 0.1)  # every slow connection has trickled a few bytes
        for _ in range(SLOW_HITS):
            start = time.perf_counter()
            try:
                status, _ = post(port, hit, timeout=10)
                outcome: int | str = status
            except OSError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            results.append((outcome, (time.perf_counter() - start) * 1000))
        open_after = sum(1 for sock, _ in slow if _still_open(sock))
    finally:
        stop.set()
        thread.join(5)
        for sock, _ in slow:
            sock.close()
    latencies = sorted(ms for _, ms in results)
    answered = [s for s, ms in results if s == 200 and ms <= SLOW_LIMIT_S * 1000]
    return {
        "trickling_headers": SLOW_HEADERS,
        "trickling_bodies": SLOW_BODIES,
        "trickle_every_s": TRICKLE_S,
        "still_open_after_hits": open_after,
        "slow_send_failures": send_failures[0],
        "hits": SLOW_HITS,
        "statuses": [s for s, _ in results],
        "latencies_ms": [ms for _, ms in results],
        "p50_ms": statistics.median(latencies),
        "max_ms": latencies[-1],
        "answered_within_limit": len(answered),
        "limit_s": SLOW_LIMIT_S,
    }


def _still_open(sock: socket.socket) -> bool:
    """True when the server has neither answered nor closed this connection (either makes
    it readable)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return not readable


# ---------------------------------------------------------------- hits beside misses


def distinct_images(count: int) -> Iterator[bytes]:
    """``count`` images no cache has seen: corpus pages (20-400 KB) with one pixel changed
    by a counter, re-encoded (a new MD5, a new SHA-256 and new pixels: every one a miss)."""
    import io

    from PIL import Image

    files = sorted(
        p
        for p in CORPUS.iterdir()
        if p.suffix.lower() in (".jpg", ".png") and 20_000 <= p.stat().st_size <= 400_000
    )
    stamp = int(time.time() * 1000)
    for i in range(count):
        with Image.open(files[i % len(files)]) as image:
            rgb = image.convert("RGB")
        value = (stamp + i) % 251
        rgb.putpixel((0, 0), (value, (value * 7) % 256, (i // 251) % 256))
        out = io.BytesIO()
        rgb.save(out, format="JPEG", quality=92)
        yield out.getvalue()


class Misses:
    """``clients`` threads, each sending distinct misses one after another until stopped."""

    def __init__(self, port: int, clients: int, images: Iterator[bytes]) -> None:
        self._port = port
        self._images = images
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.statuses: list[int | str] = []
        self.seconds: list[float] = []
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]

    def _next(self) -> bytes | None:
        with self._lock:
            return next(self._images, None)

    def _loop(self) -> None:
        while not self._stop.is_set():
            data = self._next()
            if data is None:
                return
            start = time.perf_counter()
            try:
                status: int | str = post(self._port, run.json_request("/v1/ocr", data), 120)[0]
            except OSError as exc:
                status = type(exc).__name__
            with self._lock:
                self.statuses.append(status)
                self.seconds.append(time.perf_counter() - start)

    def __enter__(self) -> Misses:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(150)

    def summary(self) -> dict:
        counts: dict[str, int] = {}
        for status in self.statuses:
            counts[str(status)] = counts.get(str(status), 0) + 1
        return {"answered": len(self.statuses), "statuses": counts,
                "median_s": statistics.median(self.seconds) if self.seconds else None}  # fmt: skip


def engine_pids(serve_pid: int) -> list[int]:
    """The engine processes of a ``python -m app serve``: its children whose command line
    ends with ``-m app engine``."""
    return app_children(serve_pid, "engine")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def hits_beside_misses(server: Server, hit: load.Request, images: Iterator[bytes]) -> dict:
    """Quiet and loaded wrk runs alternating (LOAD_ROUNDS pairs each): hits alone; hits while
    MISS_CLIENTS clients send distinct misses; hits while every engine process is stopped
    (SIGSTOP) and STOPPED_MISSES misses wait."""
    serve_pid = server.procs[0].pid
    engines = engine_pids(serve_pid)
    if not engines:
        raise RuntimeError("no engine process found under the service")
    out: dict[str, Any] = {"engine_pids": engines, "engine_nice": [
        os.getpriority(os.PRIO_PROCESS, pid) for pid in engines]}  # fmt: skip
    workers = front_workers_of(serve_pid)

    def hits() -> dict:
        """A wrk run of hits, with the CPU seconds each front worker spent in it: a split far
        from even means the connections sat on one worker."""
        before = [cpu_seconds(pid) for pid in workers]
        result = wrk(server.port, hit, 8, SECONDS)
        after = [cpu_seconds(pid) for pid in workers]
        result["worker_cpu_s"] = [round(b - a, 2) for a, b in zip(before, after, strict=True)]
        return result

    quiet: list[dict] = []
    busy: list[dict] = []
    stopped: list[dict] = []
    misses_busy, misses_stopped = [], []
    for _ in range(LOAD_ROUNDS):
        quiet.append(hits())
        with Misses(server.port, MISS_CLIENTS, images) as misses:
            time.sleep(2)  # every engine computing
            busy.append(hits())
        misses_busy.append(misses.summary())
    for _ in range(LOAD_ROUNDS):
        quiet.append(hits())
        for pid in engines:
            os.kill(pid, signal.SIGSTOP)
        try:
            with Misses(server.port, STOPPED_MISSES, images) as misses:
                time.sleep(2)  # every miss sent and waiting
                stopped.append(hits())
                for pid in engines:  # the waiting misses are answered, then the threads stop
                    os.kill(pid, signal.SIGCONT)
        finally:
            for pid in engines:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        misses_stopped.append(misses.summary())
    med = statistics.median
    quiet_p99 = med(r["p99_ms"] for r in quiet)
    quiet_rate = med(r["per_second"] for r in quiet)
    out.update({
        "quiet": {"hits_per_s": quiet_rate, "p50_ms": med(r["p50_ms"] for r in quiet),
                  "p99_ms": quiet_p99, "runs": quiet},
        "misses": {"clients": MISS_CLIENTS, "hits_per_s": med(r["per_second"] for r in busy),
                   "p50_ms": med(r["p50_ms"] for r in busy),
                   "p99_ms": med(r["p99_ms"] for r in busy), "runs": busy,
                   "miss_answers": misses_busy},
        "engines_stopped": {"waiting_misses": STOPPED_MISSES,
                            "hits_per_s": med(r["per_second"] for r in stopped),
                            "p99_ms": med(r["p99_ms"] for r in stopped), "runs": stopped,
                            "miss_answers": misses_stopped},
    })  # fmt: skip
    out["p99_under_misses_vs_quiet"] = _ratio(out["misses"]["p99_ms"], quiet_p99)
    out["hits_engines_stopped_vs_quiet"] = _ratio(out["engines_stopped"]["hits_per_s"], quiet_rate)
    return out


def floor_share(echo_hits_per_s: float, floor: dict) -> float:
    """The share of echo's hits/s a server reaches whose hit costs echo's request plus the
    two digests and nothing else: 1 / (1 + echo rate x digest seconds / cores)."""
    return 1 / (1 + echo_hits_per_s * floor["md5_sha256_us"] / 1e6 / floor["cores"])


# ---------------------------------------------------------------- the report


def targets(report: dict) -> list[dict]:
    rows = []
    bounds = (("seed", VS_SEED), ("echo_gthread", VS_ECHO_GTHREAD),
              ("echo_granian", VS_ECHO_GRANIAN))  # fmt: skip
    for size in SIZES:
        r = report["sizes"][size]
        c = r["c8"]
        for reference, shares in bounds:
            if size in shares:
                value = c["service_vs"][reference]
                rows.append({"target": f"L2 hits/s >= {shares[size]}x {reference}, same nginx",
                             "size": size, "value": value,
                             "met": value >= shares[size]})  # fmt: skip
        errors = {n: c["errors"][n] for n in c["errors"]}
        rows.append({"target": "no errors (every answer 200, no socket errors)", "size": size,
                     "value": errors, "met": not any(errors.values())})  # fmt: skip
    five = report["sizes"]["5KB"]
    served = five["c8"]["cpu_us_per_request"]["service"]["server"]
    alone = report["in_process_us"]["5KB"]["cpu_us"]
    rows.append({"target": f"the front's CPU per 5 KB hit <= {CPU_VS_IN_PROCESS:g}x the app's "
                           f"in-process CPU ({alone:.0f} us)", "size": "5KB",
                 "value": served / alone,
                 "met": served / alone <= CPU_VS_IN_PROCESS})  # fmt: skip
    load_ = report["beside_misses"]
    rows.append({"target": f"hit p99 while {MISS_CLIENTS} clients send distinct misses <= "
                           f"{MISS_TAIL:g}x quiet p99", "size": "5KB",
                 "value": load_["p99_under_misses_vs_quiet"],
                 "met": load_["p99_under_misses_vs_quiet"] <= MISS_TAIL})  # fmt: skip
    rows.append({"target": f"hits/s with every engine stopped and {STOPPED_MISSES} misses "
                           f"waiting >= {STOPPED_SHARE}x quiet", "size": "5KB",
                 "value": load_["hits_engines_stopped_vs_quiet"],
                 "met": load_["hits_engines_stopped_vs_quiet"] >= STOPPED_SHARE})  # fmt: skip
    rss = report["front_worker_rss_mb"]
    rows.append({"target": f"front worker RSS <= {RSS_MB} MB", "value": max(rss.values()),
                 "met": max(rss.values()) <= RSS_MB})  # fmt: skip
    slow = report["slow_clients"]
    rows.append({
        "target": f"{SLOW_HEADERS + SLOW_BODIES} slow clients: {SLOW_HITS} hits all answered "
                  f"within {SLOW_LIMIT_S:g} s",
        "value": f"{slow['answered_within_limit']}/{SLOW_HITS}, max {slow['max_ms']:.1f} ms",
        "met": slow["answered_within_limit"] == SLOW_HITS,
    })  # fmt: skip
    return rows


def table(report: dict) -> str:
    names = list(report["sizes"]["5KB"]["c8"]["hits_per_s"])
    lines = [
        f"L2 hits/s (wrk -t{WRK_THREADS} -c8, {report['setup']['rounds']} x "
        f"{report['setup']['seconds']} s per server, medians; L1 off; the same nginx), "
        f"{report['platform']['cpus']} cores, load {report['loadavg_before'][0]:.2f} -> "
        f"{report['loadavg_after'][0]:.2f}",
        "",
        "| server | " + " | ".join(f"{size} hits/s | CPU us/req (server+nginx)" for size in SIZES)
        + " | errors |",
        "|---|" + "---|---|" * len(SIZES) + "---|",
    ]  # fmt: skip
    for name in names:
        cells = []
        errors = 0
        for size in SIZES:
            c = report["sizes"][size]["c8"]
            spent = c["cpu_us_per_request"][name]
            hits = c["hits_per_s"][name]
            cells.append(f"{hits:.0f} | {spent['server']:.0f}+{spent['nginx']:.0f}")
            errors += c["errors"][name]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {errors} |")
    for size in SIZES:
        ratios = report["sizes"][size]["c8"]["service_vs"]
        lines.append(f"service / reference at {size}: " + ", ".join(
            f"{n} {ratios[n]:.2f}x" for n in REFERENCES))  # fmt: skip
    five = report["sizes"]["5KB"]["c8"]
    alone = report["in_process_us"]["5KB"]["cpu_us"]
    spent = five["cpu_us_per_request"]["service"]
    lines += [
        f"5 KB hit, CPU per request: front {spent['server']:.0f} us (in-process app "
        f"{alone:.0f} us: {spent['server'] / alone:.2f}x), nginx {spent['nginx']:.0f} us, Redis "
        f"{spent['redis']:.0f} us, wrk {spent['wrk']:.0f} us; p50 / p99 "
        f"{five['p50_ms']['service']:.2f} / {five['p99_ms']['service']:.2f} ms",
    ]
    m = report["beside_misses"]
    lines += [
        "",
        f"5 KB hits, service alone: quiet {m['quiet']['hits_per_s']:.0f}/s, p99 "
        f"{m['quiet']['p99_ms']:.2f} ms; while {MISS_CLIENTS} clients send distinct misses "
        f"{m['misses']['hits_per_s']:.0f}/s, p99 {m['misses']['p99_ms']:.2f} ms "
        f"({m['p99_under_misses_vs_quiet']:.2f}x); every engine stopped with "
        f"{STOPPED_MISSES} misses waiting {m['engines_stopped']['hits_per_s']:.0f}/s "
        f"({m['hits_engines_stopped_vs_quiet']:.2f}x quiet). Misses answered: "
        f"{m['misses']['miss_answers']}, stopped: {m['engines_stopped']['miss_answers']}",
        f"Front worker RSS (MB): {report['front_worker_rss_mb']}",
    ]
    lines += ["", "Digest floor per hit (CPU; ceiling = cores / floor):", ""]
    for size in SIZES:
        f = report["sizes"][size]["floor"]
        best = report["sizes"][size]["c8"]["hits_per_s"]["service"]
        lines.append(
            f"  {size}: MD5+SHA-256 {f['md5_sha256_us']:.0f} us, b64decode "
            f"{f['b64decode_us']:.0f} us; ceiling {f['ceiling_hits_per_s']:.0f} hits/s "
            f"({f['ceiling_with_b64decode_hits_per_s']:.0f} with decoding); service "
            f"{best:.0f} = {best / f['ceiling_hits_per_s']:.0%} of it"
        )
    slow = report["slow_clients"]
    lines += [
        "",
        f"Slow clients ({slow['trickling_headers']} trickling heads, "
        f"{slow['trickling_bodies']} trickling bodies; {slow['still_open_after_hits']} "
        f"still open after): {slow['answered_within_limit']}/{slow['hits']} hits answered "
        f"within {slow['limit_s']:g} s, p50 {slow['p50_ms']:.1f} ms, max {slow['max_ms']:.1f} ms; "
        f"statuses {sorted(set(map(str, slow['statuses'])))}",
        "",
        "Targets:",
    ]
    for t in report["targets"]:
        where = " ".join(f"{k}={t[k]}" for k in ("size", "concurrency") if k in t)
        value = f"{t['value']:.2f}" if isinstance(t["value"], float) else t["value"]
        lines.append(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']} {where}: {value}")
    return "\n".join(lines)


def _platform(nginx: str) -> dict:
    out = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    wrk_version = (out.stdout + out.stderr).strip()
    return {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "system": platform.platform(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "nginx": ".".join(map(str, nginx_version(nginx))),
        "wrk": wrk_version.splitlines()[0] if wrk_version else "",
    }


# ---------------------------------------------------------------- main


def main() -> int:
    from app import memory

    if not load.wrk_available():
        print("bench.edge needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    nginx = find_nginx()
    if nginx is None:
        print("bench.edge needs nginx (make install-edge)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop every process
    memory.keep_large_buffers()  # the in-process floor allocates as the servers do
    RESULTS.mkdir(parents=True, exist_ok=True)
    images = {size: (CORPUS / name).read_bytes() for size, name in SIZES.items()}
    report: dict[str, Any] = {
        "issue": 45,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": _git("rev-parse", "HEAD"),
        "tree_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "platform": _platform(nginx),
        "loadavg_before": os.getloadavg(),
        "setup": {
            "workers": run.WORKERS, "threads": THREADS, "engine_processes": run.WORKERS,
            "malloc": run.MALLOC, "rounds": ROUNDS, "seconds": SECONDS,
            "warmup_seconds": WARMUP_SECONDS, "load_rounds": LOAD_ROUNDS,
            "concurrencies": list(CONCURRENCIES),
            "client": f"wrk -t{WRK_THREADS} --timeout {WRK_TIMEOUT}",
            "servers": {name: " ".join(server_command(name, Path("<socket>")))
                        for name in SERVERS if name != "service"},
        },
    }  # fmt: skip
    report["setup"]["servers"]["service"] = (
        "python -m app serve (2 engine processes, the front's 2 granian WSGI workers, gRPC "
        "on), EDGE=nginx (access log on), CACHE_L1_BYTES=0"
    )
    chosen = os.environ.get("BENCH_EDGE_SERVERS", "")
    names = [n for n in SERVERS if not chosen or n in chosen.split(",") or n == "service"
             or n in REFERENCES]  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="bench-edge-"))
    servers: dict[str, Server] = {}
    redis_server = EmbeddedRedis()
    ok = False
    try:
        redis_server.start()
        url = redis_server.url
        servers = {
            name: Server(name, free_port(), "/v1/ocr" if name.startswith(("service", "front"))
                         else "/ocr", tmp / f"{name}.log")
            for name in names
        }  # fmt: skip
        start_service(servers["service"], url, ROOT)
        for name in names[1:]:
            start_behind_edge(servers[name], url, tmp, nginx)
        for name in names[1:]:
            start_edge(servers[name])
        probe = run.json_request("/ocr", images["5KB"])
        for s in servers.values():
            if s.path == "/v1/ocr":  # the fronts: their misses need the service's engines
                ready = f"http://127.0.0.1:{s.port}/readyz"
                wait_ready(s, lambda ready=ready: requests.get(ready, timeout=5).ok)
            else:
                target = f"http://127.0.0.1:{s.port}{s.path}"
                wait_ready(s, lambda t=target: requests.post(
                    t, data=probe.body, headers=probe.headers, timeout=120).ok)  # fmt: skip
        print("servers ready; measuring", flush=True)
        redis_pid = redis_server.proc.pid if redis_server.proc is not None else 0
        report["sizes"] = {}
        report["first_hit_cache_status"] = {}
        for size, data in images.items():
            requests_ = {n: run.json_request(s.path, data) for n, s in servers.items()}
            statuses = {}
            for s in servers.values():  # the miss that stores the entry, then one hit
                miss, _ = post(s.port, requests_[s.name])
                status, answer = post(s.port, requests_[s.name])
                if miss != 200 or status != 200:
                    raise RuntimeError(f"{s.name}: {size} answered {miss}, then {status}")
                statuses[s.name] = cache_status(answer) if s.path == "/v1/ocr" else "n/a"
            report["first_hit_cache_status"][size] = statuses
            entry = {
                "image": SIZES[size],
                "image_bytes": len(data),
                "body_bytes": len(requests_["service"].body),
                "floor": digest_floor(data),
                **measure_size(servers, requests_, redis_pid),
            }
            entry["echo_share_digest_floor"] = floor_share(
                entry["c8"]["hits_per_s"]["echo_granian"], entry["floor"]
            )
            report["sizes"][size] = entry
            c = entry[f"c{CONCURRENCIES[0]}"]["hits_per_s"]
            print(f"{size}: c={CONCURRENCIES[0]} " + ", ".join(
                f"{n} {v:.0f}/s" for n, v in c.items()), flush=True)  # fmt: skip
        hit = run.json_request("/v1/ocr", images["5KB"])
        service = servers["service"]
        report["front_worker_rss_mb"] = {
            str(pid): round(rss_mb(pid), 1) for pid in front_workers_of(service.procs[0].pid)
        }
        report["beside_misses"] = hits_beside_misses(service, hit, distinct_images(100_000))
        print("beside misses: " + json.dumps({k: v for k, v in report["beside_misses"].items()
                                             if not isinstance(v, dict)}), flush=True)  # fmt: skip
        # after the misses too: the most a worker held
        for pid in front_workers_of(service.procs[0].pid):
            report["front_worker_rss_mb"][str(pid)] = max(
                report["front_worker_rss_mb"].get(str(pid), 0.0), round(rss_mb(pid), 1)
            )
        report["slow_clients"] = slow_clients(service.port, hit)
        report["loadavg_after"] = os.getloadavg()
        # nginx's JSON access log, on as users run it (it went to the service's stdout).
        with service.log.open("rb") as log:
            report["service_access_log_lines"] = sum(line.startswith(b'{"time"') for line in log)
        from bench.hitsplit import in_process  # it imports this module

        report["in_process_us"] = in_process(
            url, {size: run.json_request("/v1/ocr", data).body for size, data in images.items()}
        )
        report["targets"] = targets(report)
        report["all_targets_met"] = all(t["met"] for t in report["targets"])
        ok = True
    finally:
        for s in servers.values():
            stop(s)
        redis_server.cleanup()
        if not ok:
            for s in servers.values():
                if s.log.exists():
                    tail = s.log.read_text(errors="replace").splitlines()[-15:]
                    print(f"--- {s.name} ({s.log.name}), last lines:", *tail, sep="\n",
                          file=sys.stderr)  # fmt: skip
        shutil.rmtree(tmp, ignore_errors=True)
    out = RESULTS / "edge.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"written to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
