"""``python -m app serve``: the whole service on one machine, one command. It starts the
private Redis when ``REDIS_URL`` is unset, the engine processes (``python -m app engine``,
``ENGINE_PROCESSES``, sized to the machine by default), and, once one engine is ready, the
front (``python -m app front``: nginx and the granian front workers, gRPC). It restarts an
engine that dies; an engine that retires itself asks first (``SIGUSR1``), so its replacement
starts before it stops taking misses. The front exiting stops everything: a supervisor above
(docker, systemd, Kubernetes) sees it."""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import multiprocess

from app.config import ConfigError, Settings
from app.ports import free_ports

log = logging.getLogger("app.serve")

SUPERVISOR_PID = "OCR_SUPERVISOR_PID"  # set for the engines: where a retiring one asks
RETIRING_DIR = "OCR_SUPERVISOR_RETIRING"  # where a retiring engine leaves its pid first

ENGINE_GIB = {"paddle": 1.1}  # resident memory of one engine process (docs/ENGINES.md)
REMOTE_ENGINE_GIB = 0.2  # an engine process whose model runs elsewhere (serving, hunyuan)
FRONT_WORKER_GIB = 0.25
PR_SET_PDEATHSIG = 1  # prctl(2)
CRASH_WINDOW_SECONDS = 10.0  # an engine that dies sooner than this after its start backs off


def machine() -> tuple[int, float]:
    """(cores this process may use, GiB of memory available now)."""
    cores = len(os.sched_getaffinity(0))
    available = 0.0
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) / 2**20
    return cores, available


def engine_count(settings: Settings, cores: int, gib: float) -> int:
    """``ENGINE_PROCESSES``, else one per core for an in-process engine (one thread each is
    the best layout measured, docs/ENGINES.md) within the memory the fronts leave; one for a
    remote engine (its slots are ``ENGINE_WORKERS`` concurrent calls)."""
    if settings.processes.engine_processes:
        return settings.processes.engine_processes
    kind = settings.engine.kind
    if kind not in ENGINE_GIB:
        return 1
    spare = gib - FRONT_WORKER_GIB * settings.server.web_concurrency - 0.5
    return max(1, min(cores, int(spare / ENGINE_GIB[kind])))


def check_upgrade(environ: dict[str, str] | os._Environ[str]) -> None:
    """``WEB_CONCURRENCY`` meant "workers, one engine each": set alone, it would now size
    only the fronts, silently. One line says what replaces it."""
    if environ.get("WEB_CONCURRENCY", "").strip() and not environ.get("ENGINE_PROCESSES", ""):
        raise ConfigError(
            "WEB_CONCURRENCY: now counts front workers only (no engine in them); set "
            "ENGINE_PROCESSES too (engine processes; 0 sizes them to the machine)"
        )


@dataclass
class _Engine:
    port: int
    process: subprocess.Popen[bytes]
    shard: int = 0  # the queue shard it serves (``DISPATCH_SHARD``)
    started: float = field(default_factory=time.monotonic)


class Supervisor:
    def __init__(self, settings: Settings, engines: int) -> None:
        self._settings = settings
        self._target = engines
        # Twice the engines' ports: a retiring engine and its replacement overlap. From
        # ENGINE_PORT up when it is set, else free ones (several `serve` on one host).
        base, count = settings.processes.engine_port, 2 * engines
        self._ports = (
            list(range(base, base + count)) if os.environ.get("ENGINE_PORT") else free_ports(count)
        )
        self._engines: list[_Engine] = []
        self._front: subprocess.Popen[bytes] | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._owed = 0  # engines to start as soon as a port is free (replacements, restarts)
        self._crashes = 0
        self.env = dict(os.environ)
        self.env[SUPERVISOR_PID] = str(os.getpid())
        # A retiring engine names itself here (a file, its pid) before it signals: its
        # replacement serves its queue shard (``_next_shard``).
        self.retiring = Path(tempfile.mkdtemp(prefix="ocr-serve-retiring-"))
        self.env[RETIRING_DIR] = str(self.retiring)
        # One metrics folder for the fronts and the engines: the front's /metrics is the
        # whole machine's, as it was when the engines lived in the workers.
        self.metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
        if self.metrics_dir:  # a clean one: an earlier run's files would double-count
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            os.makedirs(self.metrics_dir)
        else:
            self.metrics_dir = tempfile.mkdtemp(prefix="ocr-serve-metrics-")
        self.env.update(PROMETHEUS_MULTIPROC_DIR=self.metrics_dir, OCR_SHARED_METRICS="1")
        self.env["ENGINE_URLS"] = ",".join(f"http://127.0.0.1:{port}" for port in self._ports)

    # The engines ----------------------------------------------------------------------------

    @property
    def ports(self) -> str:
        return ",".join(map(str, self._ports[: self._target]))

    def _start_owed(self) -> None:
        """Start the engines owed, as far as ports are free (a retiring one frees its own)."""
        while self._owed and not self._stopping and self._start_engine():
            self._owed -= 1

    def _start_engine(self) -> bool:
        used = {engine.port for engine in self._engines}
        port = next((port for port in self._ports if port not in used), None)
        if port is None:
            return False
        # The engines' port is internal under serve: loopback, whatever HOST the front has.
        env = dict(self.env, ENGINE_PORT=str(port), HOST="127.0.0.1")
        shard = self._next_shard()
        if self._settings.dispatch.shards > 1:
            env["DISPATCH_SHARD"] = str(shard)
        process = subprocess.Popen(
            [sys.executable, "-m", "app", "engine"], env=env, preexec_fn=_die_with_parent
        )
        self._engines.append(_Engine(port, process, shard))
        return True

    def _reap_engines(self) -> None:
        for engine in list(self._engines):
            code = engine.process.poll()
            if code is None:
                continue
            self._engines.remove(engine)
            multiprocess.mark_process_dead(engine.process.pid, self.metrics_dir)
            note = self.retiring / str(engine.process.pid)
            retired = note.exists()
            note.unlink(missing_ok=True)
            if self._stopping or retired:
                continue  # retired, or died retiring: its replacement was asked for already
            lived = time.monotonic() - engine.started
            self._crashes = self._crashes + 1 if lived < CRASH_WINDOW_SECONDS else 0
            delay = min(30.0, 0.5 * 2**self._crashes) if self._crashes else 0.0
            log.warning("engine process %d exited (%s) after %.0f s; restarting in %.1f s",
                        engine.process.pid, code, lived, delay)  # fmt: skip
            if delay:
                self._wake.wait(delay)
            self._owed += 1

    def _next_shard(self) -> int:
        """The queue shard a new engine serves: the one fewest engines serve, not counting
        those retiring, so a replacement takes its predecessor's shard and every shard keeps
        an engine (``ENGINE_PROCESSES`` >= shards)."""
        retiring = {int(path.name) for path in self.retiring.iterdir() if path.name.isdigit()}
        serving = [0] * self._settings.dispatch.shards
        for engine in self._engines:
            if engine.process.pid not in retiring:
                serving[engine.shard] += 1
        return serving.index(min(serving))

    def _retire(self, *_: object) -> None:
        """An engine asked for its replacement (``SIGUSR1``): started from the loop."""
        self._owed += 1
        self._wake.set()

    def _ready(self, engine: _Engine) -> bool:
        try:
            url = f"http://127.0.0.1:{engine.port}/readyz"
            with urllib.request.urlopen(url, timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    # The whole ------------------------------------------------------------------------------

    def _stop(self, *_: object) -> None:
        self._stopping = True
        self._wake.set()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        signal.signal(signal.SIGUSR1, self._retire)
        for _ in range(self._target):
            self._start_engine()
        deadline = time.monotonic() + self._settings.server.request_timeout_seconds
        while not self._stopping and not any(self._ready(e) for e in self._engines):
            if time.monotonic() > deadline:
                log.error("no engine process became ready within REQUEST_TIMEOUT_SECONDS")
                break
            self._reap_engines()
            self._start_owed()
            self._wake.wait(0.25)
        if self._stopping:
            return self._shutdown(0)
        self._front = subprocess.Popen(
            [sys.executable, "-m", "app", "front"], env=self.env, preexec_fn=_die_with_parent
        )
        while not self._stopping:
            self._wake.wait(0.5)
            self._wake.clear()
            self._reap_engines()
            self._start_owed()
            code = self._front.poll()
            if code is not None:
                log.error("the front exited (%s): stopping the engines", code)
                return self._shutdown(code or 1)
        return self._shutdown(0)

    def _shutdown(self, code: int) -> int:
        """The front first (it answers what it holds), then the engines (they finish theirs)."""
        self._stopping = True
        if self._front is not None and self._front.poll() is None:
            self._front.terminate()
            _wait(self._front, self._settings.server.request_timeout_seconds + 5)
        for engine in self._engines:
            if engine.process.poll() is None:
                engine.process.terminate()
        for engine in self._engines:
            _wait(engine.process, self._settings.engine.timeout_seconds + 10)
        shutil.rmtree(self.retiring, ignore_errors=True)
        return code


def _die_with_parent() -> None:
    """In a child before it execs: SIGTERM when the supervisor dies (even by ``-9``), so no
    engine or front outlives it holding its ports."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _wait(process: subprocess.Popen[bytes], seconds: float) -> None:
    try:
        process.wait(seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def serve(settings: Settings) -> int:
    """The one command: private Redis if needed, engines, then the front."""
    from app.embedded_redis import EmbeddedRedis

    try:
        check_upgrade(os.environ)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    cores, gib = machine()
    engines = engine_count(settings, cores, gib)
    if engines < settings.dispatch.shards:  # a shard without an engine: its misses wait out
        shards = settings.dispatch.shards
        print(f"configuration error: DISPATCH_SHARDS={shards} needs as many engine processes "
              f"at least (ENGINE_PROCESSES: {engines})", file=sys.stderr)  # fmt: skip
        return 2
    embedded = None
    token_dir = tempfile.mkdtemp(prefix="ocr-serve-")
    try:
        if settings.cache.enabled and not settings.redis.url:
            embedded = EmbeddedRedis().start()
            os.environ["REDIS_URL"] = embedded.url
            log.info("REDIS_URL unset: started a private Redis at %s (docker/redis.conf)",
                     embedded.url)  # fmt: skip
        supervisor = Supervisor(settings, engines)
        if not settings.processes.engine_token:  # the direct endpoint, between our processes
            path = os.path.join(token_dir, "engine-token")
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as out:
                out.write(secrets.token_urlsafe(32))
            supervisor.env.pop("ENGINE_TOKEN", None)
            supervisor.env["ENGINE_TOKEN_FILE"] = path
        workers = settings.server.web_concurrency
        log.info(
            "serve: 1 front (%d worker%s, HTTP on %s:%d, gRPC on %d) and %d engine process%s "
            "(%s, ports %s), sized to %d cores and %.1f GiB available",
            workers, "" if workers == 1 else "s", settings.server.host,
            settings.server.http_port, settings.server.grpc_port, engines,
            "" if engines == 1 else "es", settings.engine.kind,
            supervisor.ports, cores, gib,
        )  # fmt: skip
        try:
            return supervisor.run()
        finally:
            shutil.rmtree(supervisor.metrics_dir, ignore_errors=True)
    finally:
        shutil.rmtree(token_dir, ignore_errors=True)
        if embedded is not None:
            embedded.cleanup()
