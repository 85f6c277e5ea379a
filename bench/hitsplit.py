"""`python -m bench.hitsplit` (issue 36 item 3): a served L2 hit, decomposed side by side.

The same front (``python -m app front``: nginx + the granian workers, no engine; started
through bench/front_variant.py) several times over on one private Redis, each with one part
taken away, beside an echo app and the seed design behind the same nginx, and the app's own
WSGI callable called in-process (bench/profile_hit.py's figure, for the front's app):

- ``front``: as shipped (granian WSGI, WEB_THREADS threads, gRPC server in every worker,
  nginx's JSON access log, Prometheus metrics per request, keep-alive between nginx and it);
- ``no_grpc`` / ``no_access_log`` / ``no_metrics`` / ``no_keepalive``: that one part off;
- ``threads_1`` / ``threads_32``: that many blocking threads per worker;
- ``bare``: gRPC, access log and metrics all off;
- ``echo_<class>``: bench/echo_app.py under gunicorn (the reference) with that worker class;
- ``seed``: bench/naive_app.py (Flask + GET + json.loads) under gthread, same nginx.

For the 5 / 100 / 312 KB images (bench/hitpath.py's SIZES), wrk -t2 -c8, L1 off: hits/s
(medians of ROUNDS rounds, the servers alternating, the order rotating), and the CPU each
part of the machine spent per hit, read from /proc around every wrk run: nginx, the
server's processes, Redis, wrk. The in-process figure: microseconds of CPU per hit of the
front's WSGI app called directly (best of 5 batches).

Results: bench/results/hitsplit.json; a table on stdout. Environment: BENCH_SPLIT_ROUNDS (2),
BENCH_SPLIT_SECONDS (4 per wrk run), BENCH_SPLIT_SERVERS (comma-separated names: a subset).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from app.config import Settings
from app.edge import Edge, find_nginx
from app.embedded_redis import EmbeddedRedis
from app.ports import free_port
from bench import cpu, load, run
from bench.edge import (
    Server,
    _git,
    _platform,
    _spawn,
    cpu_roots,
    post,
    start_edge,
    stop,
    wait_ready,
)  # fmt: skip
from bench.hitpath import CORPUS, SIZES
from bench.reference import gunicorn_args

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
ROUNDS = int(os.environ.get("BENCH_SPLIT_ROUNDS", "2"))
SECONDS = max(1, round(float(os.environ.get("BENCH_SPLIT_SECONDS", "4"))))
WARMUP_SECONDS = 1
CONCURRENCY = 8

# name -> what it is: ("front", env) or (app, worker class, threads)
FRONTS: dict[str, dict[str, str]] = {
    "front": {},
    "no_grpc": {"GRPC_ENABLED": "false"},
    "no_access_log": {"EDGE_ACCESS_LOG": "false"},
    "no_metrics": {"BENCH_NO_METRICS": "1"},
    "no_keepalive": {"BENCH_NO_UPSTREAM_KEEPALIVE": "1"},
    "threads_1": {"WEB_THREADS": "1"},
    "threads_32": {"WEB_THREADS": "32"},
    "bare": {"GRPC_ENABLED": "false", "EDGE_ACCESS_LOG": "false", "BENCH_NO_METRICS": "1"},
}
APPS: dict[str, tuple[str, str]] = {
    "echo_gthread": ("bench.echo_app:app", "gthread"),
    "echo_sync": ("bench.echo_app:app", "sync"),
    "seed": ("bench.naive_app:app", "gthread"),
}


def start_front(name: str, redis_url: str, log: Path, env: dict[str, str]) -> Server:
    server = Server(name, free_port(), "/v1/ocr", log)
    full = run._env(
        REDIS_URL=redis_url, HOST="127.0.0.1", HTTP_PORT=str(server.port),
        GRPC_PORT=str(free_port()), CACHE_L1_BYTES="0",
    )  # fmt: skip
    full.update(env)
    full.pop("ENGINE_PROCESSES", None)
    server.procs.append(_spawn([sys.executable, "-m", "bench.front_variant"], log, ROOT, full))
    return server


def start_app(
    name: str, app: str, worker_class: str, redis_url: str, tmp: Path, nginx: str
) -> Server:
    """``app`` under gunicorn (the front's options, this worker class) on a unix socket,
    the service's own nginx in front (started by ``start_edge`` once every spawn is done)."""
    server = Server(name, free_port(), "/ocr", tmp / f"{name}.log")
    socket_path = tmp / f"{name}.sock"
    settings = Settings.from_env(run._env(HOST="127.0.0.1", HTTP_PORT=str(server.port)))
    threads = run.THREADS if worker_class == "gthread" else 1
    args = gunicorn_args(app, f"unix:{socket_path}", run.WORKERS, threads, worker_class)
    server.procs.append(_spawn(args, server.log, ROOT, run._env(REDIS_URL=redis_url)))
    server.edge = Edge(settings, str(socket_path), nginx)
    server.edge.check()
    return server


def start_engine(redis_url: str, log: Path) -> subprocess.Popen:
    env = run._env(REDIS_URL=redis_url, HOST="127.0.0.1", ENGINE_PORT=str(free_port()))
    env.pop("WEB_CONCURRENCY", None)
    return _spawn([sys.executable, "-m", "app", "engine"], log, ROOT, env)


# ---------------------------------------------------------------- in-process


def environ(body: bytes) -> dict[str, Any]:
    """A JSON hit's WSGI environ, as the front's server builds it behind the edge."""
    return {
        "REQUEST_METHOD": "POST", "PATH_INFO": "/v1/ocr", "SCRIPT_NAME": "",
        "QUERY_STRING": "", "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8000",
        "SERVER_PROTOCOL": "HTTP/1.1", "REMOTE_ADDR": "", "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body),
        "wsgi.url_scheme": "http", "wsgi.errors": sys.stderr, "wsgi.multithread": True,
        "wsgi.multiprocess": True, "wsgi.run_once": False, "wsgi.version": (1, 0),
        "HTTP_X_REQUEST_ID": "bench", "HTTP_X_FORWARDED_FOR": "127.0.0.1",
    }  # fmt: skip


def in_process(redis_url: str, bodies: dict[str, bytes]) -> dict[str, dict[str, float]]:
    """The front's WSGI app called as its server calls it, on the same Redis (L1 off): per hit,
    wall and this thread's CPU microseconds, best of 5 batches."""
    from app.web import create_app

    settings = Settings.from_env({"REDIS_URL": redis_url, "CACHE_L1_BYTES": "0"})
    app = create_app(settings, role="front").wsgi_app
    statuses: list[str] = []

    def start_response(status: str, headers: list, exc_info: object = None) -> None:
        statuses.append(status)

    out = {}
    for size, body in bodies.items():

        def hit(body: bytes = body) -> None:
            b"".join(app(environ(body), start_response))

        for _ in range(50):
            hit()
        assert statuses[-1].startswith("200"), statuses[-1]
        n = 400 if len(body) < 200_000 else 150
        walls, cpus = [], []
        for _ in range(5):
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(n):
                hit()
            walls.append((time.perf_counter() - start) / n * 1e6)
            cpus.append((time.thread_time() - start_cpu) / n * 1e6)
        out[size] = {"wall_us": min(walls), "cpu_us": min(cpus),
                     "per_core_hits_per_s": 1e6 / min(cpus)}  # fmt: skip
    return out


# ---------------------------------------------------------------- measuring


def measure(
    servers: dict[str, Server], reqs: dict[str, load.Request], redis_pid: int
) -> dict[str, Any]:
    for s in servers.values():
        load.run_wrk(s.port, reqs[s.name], CONCURRENCY, WARMUP_SECONDS, "10s")
    names = list(servers)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for round_ in range(ROUNDS):
        k = round_ % len(names)
        for name in names[k:] + names[:k]:
            s = servers[name]
            r, spent = cpu.per_request(
                lambda s=s: load.run_wrk(s.port, reqs[s.name], CONCURRENCY, SECONDS, "10s"),
                cpu_roots(s), redis_pid,
            )  # fmt: skip
            r["cpu_us_per_hit"] = {"workers": spent.pop("server"), **spent}
            runs[name].append(r)
    out = {}
    for name, rs in runs.items():
        out[name] = {
            "hits_per_s": statistics.median(r["per_second"] for r in rs),
            "p50_ms": statistics.median(r["p50_ms"] or 0 for r in rs),
            "p99_ms": statistics.median(r["p99_ms"] or 0 for r in rs),
            "errors": sum(r["errors"] for r in rs),
            "cpu_us_per_hit": {
                part: statistics.median(r["cpu_us_per_hit"][part] for r in rs)
                for part in ("nginx", "workers", "redis", "wrk")
            },
            "runs": rs,
        }
    return out


def table(report: dict) -> str:
    lines = [
        f"L2 hits (wrk -t2 -c{CONCURRENCY}, L1 off, {report['setup']['rounds']} x "
        f"{report['setup']['seconds']} s per server, medians; {report['platform']['cpus']} "
        f"cores; CPU us per hit: nginx / server processes / Redis / wrk)",
        "",
    ]
    for size, r in report["sizes"].items():
        ip = r["in_process"]
        lines += [
            f"{size} ({r['body_bytes'] // 1024} KiB JSON): in-process {ip['cpu_us']:.0f} us CPU, "
            f"{ip['wall_us']:.0f} us wall per hit ({ip['per_core_hits_per_s']:.0f}/s per core)",
            "",
            "| server | hits/s | / front | / echo_gthread | p50 / p99 ms | nginx | workers | "
            "redis | wrk | errors |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        servers = r["servers"]
        base = servers.get("front", {}).get("hits_per_s", float("nan"))
        echo = servers.get("echo_gthread", {}).get("hits_per_s", float("nan"))
        for name, s in servers.items():
            c = s["cpu_us_per_hit"]
            lines.append(
                f"| {name} | {s['hits_per_s']:.0f} | {s['hits_per_s'] / base:.2f} | "
                f"{s['hits_per_s'] / echo:.2f} | {s['p50_ms']:.2f} / {s['p99_ms']:.2f} | "
                f"{c['nginx']:.0f} | {c['workers']:.0f} | {c['redis']:.0f} | {c['wrk']:.0f} | "
                f"{s['errors']} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    from app import memory

    if not load.wrk_available():
        print("bench.hitsplit needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    nginx = find_nginx()
    if nginx is None:
        print("bench.hitsplit needs nginx (make install-edge)", file=sys.stderr)
        return 2
    memory.keep_large_buffers()
    wanted = [n for n in os.environ.get("BENCH_SPLIT_SERVERS", "").split(",") if n]
    fronts = {n: e for n, e in FRONTS.items() if not wanted or n in wanted}
    apps = {n: a for n, a in APPS.items() if not wanted or n in wanted}
    images = {size: (CORPUS / name).read_bytes() for size, name in SIZES.items()}
    report: dict[str, Any] = {
        "issue": 36,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": _git("rev-parse", "HEAD"),
        "tree_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "platform": _platform(nginx),
        "loadavg_before": os.getloadavg(),
        "setup": {
            "workers": run.WORKERS, "threads": run.THREADS, "rounds": ROUNDS,
            "seconds": SECONDS, "client": f"wrk -t2 -c{CONCURRENCY}",
            "fronts": fronts, "apps": {n: list(a) for n, a in apps.items()},
        },
    }  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="bench-hitsplit-"))
    servers: dict[str, Server] = {}
    engine: subprocess.Popen | None = None
    redis_server = EmbeddedRedis()
    ok = False
    try:
        redis_server.start()
        url = redis_server.url
        assert redis_server.proc is not None
        redis_pid = redis_server.proc.pid
        engine = start_engine(url, tmp / "engine.log")
        for name, env in fronts.items():
            servers[name] = start_front(name, url, tmp / f"{name}.log", env)
        for name, (app, worker_class) in apps.items():
            servers[name] = start_app(name, app, worker_class, url, tmp, nginx)
        for name in apps:
            start_edge(servers[name])
        probe = run.json_request("/ocr", images["5KB"])
        for s in servers.values():
            target = f"http://127.0.0.1:{s.port}{s.path}"
            wait_ready(s, lambda t=target: requests.post(
                t, data=probe.body, headers=probe.headers, timeout=300
            ).status_code == 200)  # fmt: skip
        print("servers ready; measuring", flush=True)
        report["sizes"] = {}
        for size, data in images.items():
            reqs = {n: run.json_request(s.path, data) for n, s in servers.items()}
            for s in servers.values():  # the miss that stores the entry (once), then hits
                for _ in range(2):
                    status, answer = post(s.port, reqs[s.name])
                    if status != 200:
                        raise RuntimeError(f"{s.name}: {size} answered {status}: {answer[:200]!r}")
            report["sizes"][size] = {
                "image": SIZES[size],
                "body_bytes": len(reqs[next(iter(reqs))].body),
                "servers": measure(servers, reqs, redis_pid),
            }
            rates = report["sizes"][size]["servers"].items()
            print(f"{size}: " + ", ".join(f"{n} {v['hits_per_s']:.0f}/s" for n, v in rates),
                  flush=True)  # fmt: skip
        bodies = {size: run.json_request("/v1/ocr", d).body for size, d in images.items()}
        for size, figures in in_process(url, bodies).items():
            report["sizes"][size]["in_process"] = figures
        report["loadavg_after"] = os.getloadavg()
        ok = True
    finally:
        for s in servers.values():
            stop(s)
        if engine is not None:
            from bench.edge import _stop

            _stop(engine)
        redis_server.cleanup()
        if not ok:
            for s in servers.values():
                if s.log.exists():
                    tail = s.log.read_text(errors="replace").splitlines()[-15:]
                    print(f"--- {s.name}, last lines:", *tail, sep="\n", file=sys.stderr)
        with contextlib.suppress(OSError):
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
    if not ok:
        return 1
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "hitsplit.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"written to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
