"""The front's HTTP server: granian's WSGI interface, chosen by measurement (bench/edge.py,
docs/PERFORMANCE.md "The front's server"). It carries a request for about an eighth of
gunicorn gthread's CPU; the app is the same WSGI callable with the same single hit path.

What gunicorn's master and hooks did for the front, each kept here:

- the workers: ``WEB_CONCURRENCY`` processes (forked), each running the app on
  ``WEB_THREADS`` blocking threads, so a miss waiting for an engine holds one thread and
  hits go on in the others; a crashed worker is started again (``respawn_failed_workers``;
  one that crashes again within 5.5 s is a crash loop: the front exits 1, and ``serve``, the
  container's restart policy or the kubelet take over);
- a hung worker (its interpreter stuck: no heartbeat for ``FRONT_HUNG_SECONDS``, by default
  ``REQUEST_TIMEOUT_SECONDS`` + 30 s as gunicorn's ``timeout`` was) is killed and started
  again (``Watchdog``); a worker over ``FRONT_MAX_RSS_MB`` is replaced, its successor started
  first and its requests finished (granian's ``workers_max_rss``);
- graceful stop: nginx quits first (its in-flight requests are answered by workers still
  running), then every worker finishes its requests within ``REQUEST_TIMEOUT_SECONDS`` and
  runs its exit (gRPC stopped gracefully, the cache closed, L3 flushed, spans exported);
- per worker, after the fork: tracing, the app, gRPC on ``GRPC_PORT`` (``SO_REUSEPORT``);
- Prometheus multiprocess mode: the folder prepared before the workers, a dead worker's live
  gauges removed (``mark_process_dead``);
- nginx started once the socket is bound; the service stops (exit 1) should nginx die;
- keep-alive: granian keeps an idle connection until its header read timeout (60 s), longer
  than nginx keeps its upstream connections (``app.edge.UPSTREAM_KEEPALIVE_SECONDS``);
- no forwarded header is trusted: granian's WSGI environ takes the scheme, script name and
  path from the connection and the request line only;
- its own log lines go through the service's root logger (``LOG_FORMAT=json`` included).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing import util as mp_util
from pathlib import Path
from typing import Any

from granian.constants import HTTPModes, Interfaces
from granian.http import HTTP1Settings
from granian.server.mp import MPServer

from app import logformat, logsafe, memory, tracing
from app.config import Settings
from app.edge import SERVER_KEEPALIVE_SECONDS, Edge

log = logging.getLogger("app.front")

SHARED_METRICS = "OCR_SHARED_METRICS"  # "1": the metrics folder is serve's, for every role
HUNG_GRACE_SECONDS = 30  # by default, silent this long past REQUEST_TIMEOUT_SECONDS: hung
RSS_SAMPLE_SECONDS, RSS_SAMPLES = 5, 2  # FRONT_MAX_RSS_MB: over it in 2 samples 5 s apart
# granian's own loggers, handed to the root logger the service configured (app.logformat).
LOG_CONFIG: dict[str, Any] = {
    "loggers": {
        "_granian": {"handlers": [], "propagate": True},
        "granian.access": {"handlers": [], "propagate": True, "level": "WARNING"},
    }
}


def server_options(settings: Settings, socket: str = "") -> dict[str, Any]:
    """granian's options for the front: on the unix ``socket`` (behind the edge) or on
    HOST:HTTP_PORT (``EDGE=none``)."""
    server = settings.server
    where: dict[str, Any] = (
        {"uds": Path(socket), "uds_permissions": 0o660}
        if socket
        else {"address": server.host, "port": server.http_port}
    )
    return {
        **where,
        "target": "app.front_server:load_worker",  # its name; ``run`` hands granian the loader
        "interface": Interfaces.WSGI,
        "http": HTTPModes.http1,
        "websockets": False,
        "workers": server.web_concurrency,
        "blocking_threads": server.web_threads,
        # Idle blocking threads are kept: a burst of misses should not pay thread starts.
        "blocking_threads_idle_timeout": 600,
        "backlog": 2048,
        "http1_settings": HTTP1Settings(
            header_read_timeout=SERVER_KEEPALIVE_SECONDS * 1000, keep_alive=True
        ),
        "respawn_failed_workers": True,
        "respawn_interval": 0.5,
        "workers_kill_timeout": server.request_timeout_seconds,
        "workers_max_rss": server.front_max_rss_mb or None,
        "rss_sample_interval": RSS_SAMPLE_SECONDS,
        "rss_samples": RSS_SAMPLES,
        "log_enabled": True,
        "log_level": server.log_level.lower(),
        "log_dictconfig": LOG_CONFIG,
        "log_access": False,
    }


# ---------------------------------------------------------------- one worker


def load_worker() -> Callable[..., Any]:
    """Run in each worker after the fork (granian's target loader): its tracer, its app,
    its gRPC server, its heartbeat; its exit registered with the worker process (granian
    returns from serving once its requests are done, then the process runs its exit).

    Also the factory for granian's own CLI (``granian --interface wsgi --factory
    app.front_server:load_worker``, docs/DEPLOYMENT.md), where no ``python -m app`` set up
    the log format first."""
    from app.web import create_front

    memory.keep_large_buffers()
    settings = Settings.from_env()
    if not logging.getLogger().handlers:  # granian's CLI: no `python -m app` before us
        logsafe.install()
        logformat.configure(settings.server.log_level, settings.server.log_format)
    tracing.setup("front")
    app = create_front(settings)
    ocr = app.extensions["ocr"]
    if settings.grpc.enabled:
        from app import grpc_server

        ocr.grpc, _ = grpc_server.start(ocr.cache, settings, service=ocr)
    beat = os.environ.get(HEARTBEAT_DIR)
    if beat:
        Heartbeat(Path(beat), hung_after(settings)).start()
    threading.Thread(target=_trim_every, args=(TRIM_SECONDS,), name="trim", daemon=True).start()
    mp_util.Finalize(None, worker_exit, args=(ocr,), exitpriority=10)
    freeze_startup_heap()
    return app


def freeze_startup_heap() -> None:
    """What a worker built to start (modules, the app, its clients: about 100,000 objects
    the collector tracks) taken out of the collector's reach, once its garbage is collected:
    a full collection then scans only what was made since. Measured on a served front
    (``python -m app serve``, hits beside misses): a full collection stopped every thread of
    the worker for about 55 ms, in every hit's p99; frozen, 1-4 ms (docs/PERFORMANCE.md)."""
    gc.collect()
    gc.freeze()


def worker_exit(ocr: Any) -> None:
    """gRPC stopped gracefully (its in-flight RPCs get the request timeout), the cache
    closed (no more tickets taken from the miss queue), the L3 write-behind given a few
    seconds, the tracer's batched spans exported."""
    grpc = getattr(ocr, "grpc", None)
    if grpc is not None:
        grpc.stop(grace=ocr.settings.server.request_timeout_seconds).wait()
    cache = getattr(ocr, "cache", None)
    if cache is not None:
        cache.close()
        if cache.l3 is not None:
            cache.l3.flush(5.0)
    tracing.shutdown()
    log.info("front worker %d stopped: gRPC, the cache, L3 and traces closed", os.getpid())


TRIM_SECONDS = 10.0


def _trim_every(seconds: float) -> None:
    """Give the heap's free pages back to the kernel every few seconds (``malloc_trim``, a
    few ms without the GIL). A miss's body and decoded pixels (tens of MB under the raised
    mmap threshold, ``app.memory``) are freed into the heap, scattered over the threads'
    arenas: without this, a front worker held about 390 MB after a phase of large misses."""
    while True:
        time.sleep(seconds)
        memory.release_free_memory()


# ---------------------------------------------------------------- hung and dead workers

HEARTBEAT_DIR = "OCR_FRONT_HEARTBEAT_DIR"
CRASH_LOOP_SECONDS = 6.0  # granian stops when a worker dies within 5.5 s of its respawn


def hung_after(settings: Settings) -> float:
    """Seconds without a heartbeat after which a worker is hung (gunicorn's ``timeout``)."""
    server = settings.server
    return server.front_hung_seconds or server.request_timeout_seconds + HUNG_GRACE_SECONDS


class Heartbeat(threading.Thread):
    """A worker's sign of life: a file named by its pid, touched every few seconds by a
    thread of its own (a thread runs only while the interpreter does: a worker stuck with
    the GIL held, or stopped, goes silent)."""

    def __init__(self, folder: Path, hung_after: float) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.path = folder / str(os.getpid())
        self.every = max(0.5, min(5.0, hung_after / 4))

    def run(self) -> None:
        while True:
            self.path.touch()
            time.sleep(self.every)


class Watchdog(threading.Thread):
    """In the server's main process: a worker whose heartbeat is older than ``hung_after``
    seconds is killed (granian starts another); a worker that is gone has its live gauges
    removed from the metrics folder (prometheus-client's ``mark_process_dead``)."""

    def __init__(
        self,
        folder: Path,
        hung_after: float,
        workers: Callable[[], list[tuple[int, float]]] = lambda: [],
        load_bound: float = CRASH_LOOP_SECONDS,
    ) -> None:
        super().__init__(name="front-watchdog", daemon=True)
        self.folder = folder
        self.hung_after = hung_after
        self.workers = workers  # (pid, when it was started, monotonic) of each worker
        self.stopping = threading.Event()
        # A loading worker's CPU seconds and since when (monotonic) they have not moved.
        self._loading: dict[int, tuple[float, float]] = {}
        self.load_bound = max(hung_after, load_bound)

    def run(self) -> None:
        while not self.stopping.wait(1.0):
            self.check()

    def check(self) -> None:
        now = time.time()
        for path in self.folder.iterdir():
            pid = int(path.name)
            try:
                age = now - path.stat().st_mtime
                os.kill(pid, 0)
            except ProcessLookupError:
                path.unlink(missing_ok=True)
                mark_dead(pid)
                continue
            except OSError:
                continue
            if age > self.hung_after and not self.stopping.is_set():
                log.error("front worker %d sent no heartbeat for %.0f s: killed", pid, age)
                os.kill(pid, signal.SIGKILL)
        # A worker that never loaded (no heartbeat yet) and used no CPU for as long: a fork
        # caught while another thread held a lock (a log line being written) waits on it
        # forever. One still loading on a starved host uses some CPU: it is left to load (a
        # clean-clone run killed both first workers of a front at 5.5 s, and granian, whose
        # main thread waits for a first worker to listen, started none in their place). Not
        # within granian's crash-loop window (a worker that dies within 5.5 s of its respawn
        # stops the server).
        loading, now = {}, time.monotonic()
        for pid, _ in self.workers():
            if (self.folder / str(pid)).exists():
                continue
            used, since = cpu_seconds(pid), now
            seen = self._loading.get(pid)
            if seen is not None and used == seen[0]:
                since = seen[1]
            loading[pid] = used, since
            stalled = now - since
            if stalled > self.load_bound and not self.stopping.is_set():
                log.error("front worker %d did not load, %.0f s without CPU: killed", pid, stalled)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        self._loading = loading


def cpu_seconds(pid: int) -> float:
    """The CPU ``pid`` has used (Linux's /proc); 0 where unreadable (then never moving).
    Also the benches' per-worker reading (bench/edge.py)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mark_dead(pid: int) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


# ---------------------------------------------------------------- the main process


class FrontServer(MPServer):
    """granian's multi-process server, supervising the edge and the workers' heartbeats."""

    def __init__(self, settings: Settings, socket: str = "", edge: Edge | None = None):
        super().__init__(**server_options(settings, socket))
        logging.getLogger("_granian").addFilter(_many_threads_is_intended)
        self._settings = settings
        self.edge = edge
        self.edge_died = False
        self._beats = tempfile.mkdtemp(prefix="ocr-front-beats-")
        os.environ[HEARTBEAT_DIR] = self._beats  # the workers are forks: they read it
        self.watchdog = Watchdog(Path(self._beats), hung_after(settings), self._workers)

    def startup(self, spawn_target: Any, target_loader: Any) -> None:
        super().startup(spawn_target, target_loader)  # bound, workers starting
        self.watchdog.start()
        if self.edge is not None and self.edge.pid is None:
            self._wait_listening()
            self.edge.start(on_exit=self._edge_exited)

    def _wait_listening(self) -> None:
        """granian's unix socket listens once a worker has started serving (until then a
        connection is refused, where gunicorn's master queued it): nginx starts after that,
        so its first requests are not 502s. The socket keeps listening while any process
        holds it, so a worker that restarts later leaves connections queued, not refused."""
        deadline = time.monotonic() + self._settings.server.request_timeout_seconds
        while not self.interrupt_signal and time.monotonic() < deadline:
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(str(self.bind_uds))
                    return
                except OSError:
                    time.sleep(0.05)
        log.warning("no front worker listening after %.0f s: starting nginx anyway",
                    self._settings.server.request_timeout_seconds)  # fmt: skip

    def signal_handler_interrupt(self, *args: Any, **kwargs: Any) -> None:
        """SIGTERM/SIGINT. A worker inherits this handler with the fork and keeps it until
        granian installs the worker's own, once its app is loaded: a stop that reaches it
        meanwhile ends it (the signal's default), where it would only mark the main's copy."""
        if os.getpid() != self.pid:
            signum = args[0] if args else signal.SIGTERM
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        super().signal_handler_interrupt(*args, **kwargs)

    def _edge_exited(self) -> None:
        """nginx died (its port taken, killed): the service stops, and says it failed."""
        self.edge_died = True
        self.signal_handler_interrupt()

    def shutdown(self, exit_code: int = 0) -> None:
        """nginx quits first and gracefully (its in-flight requests are answered by workers
        still running), then the workers stop."""
        self.watchdog.stopping.set()
        if self.edge is not None:
            self.edge.quit(True)
        if self.edge_died:
            log.error("the nginx edge exited: stopping the service")
            exit_code = exit_code or 1
        self._end_unloaded_workers()
        try:
            super().shutdown(exit_code)
        finally:
            shutil.rmtree(self._beats, ignore_errors=True)

    def _workers(self) -> list[tuple[int, float]]:
        """Each worker process: (pid, when granian started it, monotonic)."""
        return [(w.inner.pid, w.birth) for w in list(self.wrks) if w.inner.pid is not None]

    def _end_unloaded_workers(self) -> None:
        """A worker that has not loaded its app yet (no heartbeat: a respawn moments ago)
        holds no request, yet granian would give it ``workers_kill_timeout`` to stop; one
        forked while another thread held a lock may never load, and the stop would wait
        that long (seen once: a stop 1.2 s after a respawn outlasted 60 s). Killed at once."""
        for pid, _ in self._workers():
            if not (Path(self._beats) / str(pid)).exists():
                log.info("front worker %d stopped before it had loaded: killed", pid)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def run(self) -> None:
        self.serve(target_loader=load_worker, wrap_loader=False)


def _many_threads_is_intended(record: logging.LogRecord) -> bool:
    """granian warns when a worker may run more threads than the cores: the front's threads
    mostly wait (a miss waiting for an engine holds one), so the warning is dropped."""
    return "seems quite high compared to the number of CPU cores" not in record.getMessage()


def prepare_metrics_dir() -> str:
    """A clean prometheus multiprocess directory, set before any worker forks (stale files
    from an earlier run would double-count). Under ``serve`` the folder is the supervisor's,
    shared with the engine processes (``SHARED_METRICS``): kept as it is."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.path.join(
        tempfile.gettempdir(), f"ocr-cache-metrics-{os.getpid()}"
    )
    if os.environ.get(SHARED_METRICS) == "1":
        os.makedirs(path, exist_ok=True)
        return path
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path
