"""`python -m bench.edge` (issue 23): the nginx edge against today's h11 front, side by side.

Four servers in one run, on one private Redis (docker/redis.conf: maxmemory, allkeys-lru),
each under the same gunicorn settings (2 workers x 8 threads, app/gunicorn_app.py) and the
same malloc thresholds (``bench.run.MALLOC``):

- ``service``: ``python -m app serve`` as users run it (EDGE=nginx, access log on), L1 off
  (CACHE_L1_BYTES=0: every hit is an L2 hit);
- ``seed``: the seed design (bench/naive_app.py: Flask + Redis GET + json.loads) on a unix
  socket behind the same nginx (``app.edge.Edge``, the service's own template);
- ``echo``: bench/echo_app.py (reads the body, answers a constant) behind the same nginx;
- ``h11_front``: the service as of the last commit with the h11 front (app/front.py; its
  front answers plain L2 hits itself), from a detached ``git worktree``, L1 off, its
  defaults otherwise (HTTP_FRONT=true, HTTP_FRONT_HITS=true). It needs h11 and uvloop
  (requirements-dev.txt). Its entries use their own key prefix, so each server's hits are
  of an entry it stored itself.

For the 5 / 100 / 312 KB images (bench/hitpath.py's) and wrk at c=8 and c=64: hits/s, p50,
p99, the servers alternating (the order rotating) over ROUNDS rounds; medians. Then the
floor the design sets where bodies are large (MD5 for the key + SHA-256 for the check, and
base64 decoding apart), and 128 slow clients against the service while 20 hits are timed.
Results: bench/results/edge.json; a table on stdout.

Environment: BENCH_EDGE_ROUNDS (3), BENCH_EDGE_SECONDS (6 per wrk run),
BENCH_EDGE_WARMUP_SECONDS (2), BENCH_EDGE_FLOOR_SECONDS (0.5 of hashing per size and step).
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
from app.embedded_redis import EmbeddedRedis, free_port
from app.gunicorn_app import gunicorn_options
from bench import load, run
from bench.hitpath import CORPUS, SIZES

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SERVERS = ("service", "seed", "echo", "h11_front")
CONCURRENCIES = (8, 64)
ROUNDS = int(os.environ.get("BENCH_EDGE_ROUNDS", "3"))
SECONDS = max(1, round(float(os.environ.get("BENCH_EDGE_SECONDS", "6"))))  # wrk: whole s
WARMUP_SECONDS = max(1, round(float(os.environ.get("BENCH_EDGE_WARMUP_SECONDS", "2"))))
FLOOR_SECONDS = float(os.environ.get("BENCH_EDGE_FLOOR_SECONDS", "0.5"))
WRK_THREADS = 2  # as bench/load.run_wrk
WRK_TIMEOUT = "10s"  # a slow answer is a latency, not a dropped request (wrk's default: 2 s)
READY_SECONDS = 600  # three servers load their engines at once on a small machine
# Issue 23's targets.
VS_H11 = 0.8  # L2 hits/s >= 0.8x today's h11 front, at every size
VS_SEED = 1.5  # ... and >= 1.5x the seed design behind the same nginx
TAIL = 4.0  # p99 <= 4x p50 at c=8
SLOW_HEADERS, SLOW_BODIES, SLOW_HITS, SLOW_LIMIT_S = 64, 64, 20, 1.0
TRICKLE_S = 0.5  # a byte per slow connection every this often
SLOW_BODY_BYTES = 10 * 1024 * 1024  # announced, never sent (MAX_REQUEST_BYTES is 20 MiB)
H11_PREFIX = "ocrh11"  # the h11 front's entries apart from the service's (same key schema)


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
    env = run._env(
        REDIS_URL=redis_url,
        HOST="127.0.0.1",
        HTTP_PORT=str(server.port),
        GRPC_PORT=str(free_port()),
        CACHE_L1_BYTES="0",
        **extra,
    )
    server.procs.append(_spawn([sys.executable, "-m", "app", "serve"], server.log, cwd, env))


def start_behind_edge(server: Server, app: str, redis_url: str, tmp: Path, nginx: str) -> None:
    """``app`` under gunicorn on a unix socket, the service's own nginx edge in front (its
    configuration checked here, started by ``start_edge``)."""
    socket_path = tmp / f"{server.name}.sock"
    # The settings the service reads (the same environment): the same gunicorn, the same edge.
    settings = Settings.from_env(run._env(HOST="127.0.0.1", HTTP_PORT=str(server.port)))
    opts = gunicorn_options(settings, bind=f"unix:{socket_path}")
    args = [
        sys.executable, "-m", "gunicorn", app,
        "--bind", opts["bind"], "--workers", str(run.WORKERS),
        "--worker-class", opts["worker_class"], "--threads", str(run.THREADS),
        "--timeout", str(opts["timeout"]), "--graceful-timeout", str(opts["graceful_timeout"]),
        "--keep-alive", str(opts["keepalive"]), "--log-level", "warning",
    ]  # fmt: skip
    server.procs.append(_spawn(args, server.log, ROOT, run._env(REDIS_URL=redis_url)))
    server.edge = Edge(settings, str(socket_path), nginx)
    server.edge.check()


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


def h11_commit() -> str:
    """The last commit with app/front.py: the parent of the one that deleted it."""
    deleted = _git("log", "-1", "--format=%H", "--diff-filter=D", "--", "app/front.py")
    if not deleted:
        raise RuntimeError("no commit deletes app/front.py: is this a shallow clone?")
    return _git("rev-parse", f"{deleted}^")


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def _imports_from(tree: Path, env: dict[str, str]) -> str:
    """Where ``import app`` resolves with this environment in ``tree`` (not this checkout's
    editable install)."""
    return subprocess.run(
        [sys.executable, "-c", "import app; print(app.__file__)"],
        cwd=tree, env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip


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


def measure_size(servers: dict[str, Server], requests_: dict[str, load.Request]) -> dict:
    """One size: wrk at each concurrency, ROUNDS rounds, the servers alternating."""
    for s in servers.values():  # warm-up, at the higher concurrency
        wrk(s.port, requests_[s.name], max(CONCURRENCIES), WARMUP_SECONDS)
    out: dict[str, Any] = {}
    for concurrency in CONCURRENCIES:
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        for round_ in range(ROUNDS):
            order = SERVERS[round_ % len(SERVERS) :] + SERVERS[: round_ % len(SERVERS)]
            for name in order:
                s = servers[name]
                runs[name].append(wrk(s.port, requests_[name], concurrency, SECONDS))

        hits = _medians(runs, "per_second")
        p50, p99 = _medians(runs, "p50_ms"), _medians(runs, "p99_ms")
        out[f"c{concurrency}"] = {
            "concurrency": concurrency,
            "hits_per_s": hits,
            "p50_ms": p50,
            "p99_ms": p99,
            "errors": {n: sum(r["errors"] for r in rs) for n, rs in runs.items()},
            "service_vs_h11_front": _ratio(hits["service"], hits["h11_front"]),
            "service_vs_seed": _ratio(hits["service"], hits["seed"]),
            "service_vs_echo": _ratio(hits["service"], hits["echo"]),
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


# ---------------------------------------------------------------- the report


def targets(report: dict) -> list[dict]:
    rows = []
    for size in SIZES:
        r = report["sizes"][size]
        for concurrency in CONCURRENCIES:
            c = r[f"c{concurrency}"]
            rows.append({"target": f"L2 hits/s >= {VS_H11}x h11 front", "size": size,
                         "concurrency": concurrency, "value": c["service_vs_h11_front"],
                         "met": c["service_vs_h11_front"] >= VS_H11})  # fmt: skip
            rows.append({"target": f"L2 hits/s >= {VS_SEED}x seed behind nginx", "size": size,
                         "concurrency": concurrency, "value": c["service_vs_seed"],
                         "met": c["service_vs_seed"] >= VS_SEED})  # fmt: skip
        c8 = r["c8"]
        rows.append({"target": f"p99 <= {TAIL:g}x p50 at c=8", "size": size, "concurrency": 8,
                     "value": c8["service_p99_over_p50"],
                     "met": c8["service_p99_over_p50"] <= TAIL})  # fmt: skip
        errors = {n: sum(r[f"c{c}"]["errors"][n] for c in CONCURRENCIES) for n in SERVERS}
        rows.append({"target": "no errors (every answer 200, no socket errors)", "size": size,
                     "value": errors, "met": not any(errors.values())})  # fmt: skip
    slow = report["slow_clients"]
    rows.append({
        "target": f"{SLOW_HEADERS + SLOW_BODIES} slow clients: {SLOW_HITS} hits all answered "
                  f"within {SLOW_LIMIT_S:g} s",
        "value": f"{slow['answered_within_limit']}/{SLOW_HITS}, max {slow['max_ms']:.1f} ms",
        "met": slow["answered_within_limit"] == SLOW_HITS,
    })  # fmt: skip
    return rows


def table(report: dict) -> str:
    lines = [
        f"L2 hits/s (wrk -t{WRK_THREADS}, {report['setup']['rounds']} x "
        f"{report['setup']['seconds']} s per server, medians; L1 off), "
        f"{report['platform']['cpus']} cores, load {report['loadavg_before'][0]:.2f} -> "
        f"{report['loadavg_after'][0]:.2f}",
        "",
        "| body | c | service | h11 front | seed | echo | /h11 | /seed | /echo | "
        "service p50 / p99 ms | errors s/h/sd/e |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in SIZES:
        r = report["sizes"][size]
        for concurrency in CONCURRENCIES:
            c = r[f"c{concurrency}"]
            h = c["hits_per_s"]
            e = c["errors"]
            lines.append(
                f"| {size} | {concurrency} | {h['service']:.0f} | {h['h11_front']:.0f} | "
                f"{h['seed']:.0f} | {h['echo']:.0f} | {c['service_vs_h11_front']:.2f}x | "
                f"{c['service_vs_seed']:.2f}x | {c['service_vs_echo']:.2f}x | "
                f"{c['p50_ms']['service']:.2f} / {c['p99_ms']['service']:.2f} | "
                f"{e['service']}/{e['h11_front']}/{e['seed']}/{e['echo']} |"
            )
    lines += ["", "Digest floor per hit (CPU; ceiling = cores / floor):", ""]
    for size in SIZES:
        f = report["sizes"][size]["floor"]
        best = max(report["sizes"][size][f"c{c}"]["hits_per_s"]["service"] for c in CONCURRENCIES)
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
    commit = h11_commit()
    report: dict[str, Any] = {
        "issue": 23,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": _git("rev-parse", "HEAD"),
        "tree_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "h11_front_commit": commit,
        "platform": _platform(nginx),
        "loadavg_before": os.getloadavg(),
        "setup": {
            "workers": run.WORKERS, "threads": run.THREADS, "malloc": run.MALLOC,
            "rounds": ROUNDS, "seconds": SECONDS, "warmup_seconds": WARMUP_SECONDS,
            "concurrencies": list(CONCURRENCIES),
            "client": f"wrk -t{WRK_THREADS} --timeout {WRK_TIMEOUT}",
            "servers": {
                "service": "python -m app serve, EDGE=nginx (access log on), CACHE_L1_BYTES=0",
                "seed": "bench/naive_app.py (Flask + GET + json.loads) under gunicorn, behind "
                        "app.edge.Edge (the same nginx template)",
                "echo": "bench/echo_app.py (reads the body, answers a constant) under "
                        "gunicorn, behind app.edge.Edge",
                "h11_front": f"python -m app serve at {commit[:12]} (HTTP_FRONT=true, "
                             f"HTTP_FRONT_HITS=true), CACHE_L1_BYTES=0, "
                             f"CACHE_KEY_PREFIX={H11_PREFIX}",
            },
        },
    }  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="bench-edge-"))
    tree = tmp / "h11-front"
    servers: dict[str, Server] = {}
    worktree = False
    redis_server = EmbeddedRedis()
    ok = False
    try:
        _git("worktree", "add", "--detach", str(tree), commit)
        worktree = True
        redis_server.start()
        url = redis_server.url
        servers = {
            name: Server(name, free_port(), "/v1/ocr" if name in ("service", "h11_front")
                         else "/ocr", tmp / f"{name}.log")
            for name in SERVERS
        }  # fmt: skip
        start_service(servers["service"], url, ROOT)
        old_env = {"PYTHONPATH": str(tree), "CACHE_KEY_PREFIX": H11_PREFIX}
        where = _imports_from(tree, run._env(**old_env))
        if not where.startswith(str(tree)):
            raise RuntimeError(f"the h11 front's tree imports app from {where}, not {tree}")
        start_service(servers["h11_front"], url, tree, **old_env)
        start_behind_edge(servers["seed"], "bench.naive_app:app", url, tmp, nginx)
        start_behind_edge(servers["echo"], "bench.echo_app:app", url, tmp, nginx)
        start_edge(servers["seed"])
        start_edge(servers["echo"])
        probe = run.json_request("/ocr", images["5KB"])
        for s in servers.values():
            if s.name in ("service", "h11_front"):
                ready = f"http://127.0.0.1:{s.port}/readyz"
                wait_ready(s, lambda ready=ready: requests.get(ready, timeout=5).ok)
            else:
                target = f"http://127.0.0.1:{s.port}{s.path}"
                wait_ready(s, lambda t=target: requests.post(
                    t, data=probe.body, headers=probe.headers, timeout=120).ok)  # fmt: skip
        print("servers ready; measuring", flush=True)
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
                **measure_size(servers, requests_),
            }
            report["sizes"][size] = entry
            c = entry[f"c{CONCURRENCIES[0]}"]["hits_per_s"]
            print(f"{size}: c={CONCURRENCIES[0]} " + ", ".join(
                f"{n} {v:.0f}/s" for n, v in c.items()), flush=True)  # fmt: skip
        hit = run.json_request("/v1/ocr", images["5KB"])
        report["slow_clients"] = slow_clients(servers["service"].port, hit)
        report["loadavg_after"] = os.getloadavg()
        # nginx's JSON access log, on as users run it (it went to the service's stdout).
        with servers["service"].log.open("rb") as log:
            report["service_access_log_lines"] = sum(line.startswith(b'{"time"') for line in log)
        report["targets"] = targets(report)
        report["all_targets_met"] = all(t["met"] for t in report["targets"])
        ok = True
    finally:
        for s in servers.values():
            stop(s)
        redis_server.cleanup()
        if worktree:
            with contextlib.suppress(subprocess.CalledProcessError):
                _git("worktree", "remove", "--force", str(tree))
            with contextlib.suppress(subprocess.CalledProcessError):
                _git("worktree", "prune")
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
