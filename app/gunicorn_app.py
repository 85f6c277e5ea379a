"""Running the Flask app under gunicorn from Python, with options derived from Settings.

The front's workers (``python -m app front``): no engine is loaded in them (their engine is
a proxy to the engine processes, ``app.engines.direct``); each also serves gRPC.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from typing import Any

from gunicorn.app.base import BaseApplication
from gunicorn.arbiter import Arbiter
from gunicorn.glogging import Logger

from app import logformat, tracing
from app.config import Settings
from app.edge import GUNICORN_KEEPALIVE_SECONDS, Edge

SHARED_METRICS = "OCR_SHARED_METRICS"  # "1": the metrics folder is serve's, for every role


def gunicorn_options(settings: Settings, bind: str | None = None) -> dict[str, Any]:
    """``bind``: where gunicorn listens instead of HOST:HTTP_PORT (the edge's unix socket)."""
    behind_edge = bool(bind and bind.startswith("unix:"))
    return {
        "bind": bind or f"{settings.server.host}:{settings.server.http_port}",
        "workers": settings.server.web_concurrency,
        "worker_class": "gthread",
        "threads": settings.server.web_threads,
        "timeout": settings.server.request_timeout_seconds + 30,
        "graceful_timeout": settings.server.request_timeout_seconds,
        # nginx reuses its connections and closes idle ones first (app/edge.py); clients
        # talking to gunicorn directly (EDGE=none) get gunicorn's usual few seconds.
        "keepalive": GUNICORN_KEEPALIVE_SECONDS if behind_edge else 5,
        # Behind the edge every request arrives over a unix socket, which gunicorn trusts as
        # a proxy: it must not take SCRIPT_NAME/PATH_INFO or the scheme from client headers.
        "forwarder_headers": "",
        "secure_scheme_headers": {},
        "preload_app": False,
        "loglevel": settings.server.log_level.lower(),
        "accesslog": None,
        "errorlog": "-",
        "logger_class": JsonLogger if settings.server.log_format == "json" else Logger,
        "on_starting": prepare_metrics_dir,
        "child_exit": _child_exit,
        "post_fork": _traced,
        "post_worker_init": _worker_ready,
        "worker_exit": _worker_exit,
    }


class JsonLogger(Logger):
    """gunicorn's own lines (its master's and workers' starts, stops, timeouts) in the
    service's JSON form too (``LOG_FORMAT=json``): one format for a log collector to parse."""

    def setup(self, cfg: Any) -> None:
        super().setup(cfg)
        for handler in self.error_log.handlers:
            handler.setFormatter(logformat.JsonFormatter())


def _traced(server: Any, worker: Any) -> None:
    """This worker's tracer (``OTEL_*``), after the fork: its exporter thread is its own."""
    tracing.setup("front")


def _worker_ready(worker: Any) -> None:
    _start_grpc(worker)


def _start_grpc(worker: Any) -> None:
    """Serve gRPC from this worker too, on the same cache (SO_REUSEPORT shares the port)."""
    ocr = getattr(worker.wsgi, "extensions", {}).get("ocr")  # None: not our app
    if ocr is not None and ocr.settings.grpc.enabled:
        from app import grpc_server

        ocr.grpc, _ = grpc_server.start(ocr.cache, ocr.settings)


def _service_of(worker: Any) -> Any:
    """The worker app's ``OcrService`` (``app.extensions["ocr"]``), or None before it exists."""
    return getattr(getattr(worker, "wsgi", None), "extensions", {}).get("ocr")


def _stop_grpc(server: Any, worker: Any) -> None:
    """Graceful: in-flight RPCs get up to the request timeout to finish; the engine takes
    no more tickets of the miss queue (one it is computing finishes, or is reclaimed
    elsewhere)."""
    ocr = _service_of(worker)
    grpc = getattr(ocr, "grpc", None)
    if grpc is not None:
        grpc.stop(grace=worker.cfg.graceful_timeout).wait()
    cache = getattr(ocr, "cache", None)
    if cache is not None:  # take no more tickets from the global miss queue
        cache.close()


def _drain_l3(server: Any, worker: Any) -> None:
    """Give the L3 write-behind queue a few seconds to empty (its thread is a daemon)."""
    cache = getattr(_service_of(worker), "cache", None)
    if cache is not None and cache.l3 is not None:
        cache.l3.flush(5.0)


def _worker_exit(server: Any, worker: Any) -> None:
    _stop_grpc(server, worker)
    _drain_l3(server, worker)
    tracing.shutdown()  # its batched spans exported


def prepare_metrics_dir(server: Any = None) -> str:
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


def _child_exit(server: Any, worker: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


class _Arbiter(Arbiter):
    """gunicorn's master, supervising the edge: nginx starts once gunicorn's socket is bound;
    a stop quits nginx first (gracefully: its in-flight requests are answered by workers that
    are still running), then the workers; should nginx die, the service stops."""

    edge: Edge | None = None
    edge_died = False

    def start(self) -> None:
        super().start()
        if self.edge is not None and self.edge.pid is None:
            master = os.getpid()

            def died() -> None:  # e.g. its port is taken: nginx exits at start
                self.edge_died = True
                os.kill(master, signal.SIGTERM)

            self.edge.start(on_exit=died)

    def halt(self, reason: str | None = None, exit_status: int = 0) -> None:
        if self.edge_died:  # a supervisor must see a failure, not a clean stop
            reason, exit_status = "the nginx edge exited", 1
        super().halt(reason, exit_status)

    def stop(self, graceful: bool = True) -> None:
        if self.edge is not None:
            self.edge.quit(graceful)
        super().stop(graceful)


class GunicornApp(BaseApplication):
    def __init__(
        self,
        settings: Settings,
        bind: str | None = None,
        edge: Edge | None = None,
        role: str = "front",
    ):
        """``role``: what each worker's app is (``front``: no engine; ``combined``: an
        engine in every worker, the layout before the roles split)."""
        self._settings = settings
        self._bind = bind
        self._edge = edge
        self._role = role
        super().__init__()

    def run(self) -> None:
        arbiter = _Arbiter(self)
        arbiter.edge = self._edge
        try:
            arbiter.run()
        except RuntimeError as exc:  # as BaseApplication.run
            print(f"\nError: {exc}\n", file=sys.stderr)
            sys.exit(1)

    def load_config(self) -> None:
        for key, value in gunicorn_options(self._settings, self._bind).items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        from app.web import create_app

        return create_app(Settings.from_env(), role=self._role)
