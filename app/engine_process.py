"""``python -m app engine``: one engine process. It loads the configured engine, consumes the
miss queue (``ENGINE_WORKERS`` slots: the feeders of ``app.engine_side.feeders``), and listens on
``ENGINE_PORT`` for ``/healthz``, ``/readyz``, ``/metrics`` and the direct endpoint that
fronts call while Redis is down (``app.engines.direct``). It speaks no public protocol. It
also drives document jobs (``JOBS_DRIVERS``, ``app.engine_side.job_driver``): their pages go through
the cache and the miss queue like any request.

It retires itself past ``ENGINE_MAX_CALLS`` calls or ``ENGINE_MAX_RSS_MB`` of memory, as
a server's ``max_requests`` does for a worker: under ``serve`` it asks the supervisor for
its replacement first (``SIGUSR1``) and keeps taking misses until that one reports in, then
stops taking, finishes what it holds and exits 0; under Kubernetes the kubelet restarts it
while the other replicas take the queue. ``SIGTERM`` stops it the same way, without waiting
for a replacement.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from flask import Flask, Response, jsonify, request
from werkzeug.serving import make_server

from app import memory, metrics, service, tracing
from app.cache.keys import digest_image
from app.cache.store import RedisStore
from app.cache.tier import Probe
from app.config import Settings
from app.engine_side import job_driver
from app.engines import build_engine, direct
from app.engines.redacting import with_redaction
from app.protocols import rest
from app.supervisor import RETIRING_DIR, SUPERVISOR_PID
from app.vocabulary import CacheControls, ClientError, EngineBusy, EngineError, EngineTimeout

log = logging.getLogger(__name__)

REPLACEMENT_WAIT_SECONDS = 120.0  # the longest a retiring engine waits for its replacement


def rss_mb() -> float:
    """This process's resident memory now (not its peak)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def engine_app(shared: service.OcrService, settings: Settings) -> Flask:
    """The engine process's own small HTTP app (no public protocol)."""
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.server.max_request_bytes * 4 // 3 + 65536
    processes = settings.processes
    inflight = threading.BoundedSemaphore(processes.direct_max_inflight)
    cache = shared.cache

    def error(status: int, code: str, message: str, retry_after: int = 0) -> Response:
        body = rest.error_body(code, message)
        response = Response(body, status=status, mimetype="application/json")
        if retry_after:
            response.headers["Retry-After"] = str(retry_after)
        return response

    @app.get("/healthz")
    def healthz() -> Any:
        return jsonify({"status": "alive", "role": "engine"})

    @app.get("/readyz")
    def readyz() -> Any:
        state = shared.engine_state.status
        feeding = cache.dispatch_ready(0)
        body = {"role": "engine", "engine": state, "queue": "consuming" if feeding else "waiting",
                "fingerprint": cache.engine.fingerprint}  # fmt: skip
        return jsonify(body), (200 if state == "ready" and feeding else 503)

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        payload, content_type = metrics.render()
        return Response(payload, content_type=content_type)

    @app.post(direct.PATH)
    def recognize() -> Response:
        token = processes.engine_token
        if not token:
            return error(404, "not_found", "the direct endpoint is off (ENGINE_TOKEN unset)")
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return error(401, "unauthorized", "a valid ENGINE_TOKEN is required")
        if not inflight.acquire(blocking=False):
            return error(503, "engine_busy", "too many direct calls in flight", 1)
        try:
            data, params, namespace = direct.decode_request(request.get_data())
            probe = Probe(
                data, params, digest_image(data), cache.keys.task(params),
                CacheControls(namespace=namespace), decode=cache.decode,
            )  # fmt: skip
            cache.engine.check_params(params)
            probe.image  # noqa: B018 - a bad image is the caller's error, before the engine
            context = {k: v for k in (tracing.TRACEPARENT, tracing.TRACESTATE)
                       if (v := request.headers.get(k))}  # fmt: skip
            with tracing.TRACER.server(direct.PATH, context):  # in the front's trace
                result = cache.computer.compute(probe)
        except EngineBusy as exc:
            return error(503, exc.code, str(exc), exc.retry_after)
        except EngineTimeout as exc:
            return error(504, exc.code, str(exc))
        except EngineError as exc:
            return error(502, exc.code, str(exc))
        except ClientError as exc:
            return error(400, exc.code, str(exc))
        finally:
            inflight.release()
        return Response(
            direct.orjson.dumps({"format": direct.FORMAT, "result": result.to_dict()}),
            mimetype="application/json",
        )

    return app


EXIT_BROKEN = 3  # the exit status of an engine that retired broken: restarted, and seen


class Retirement:
    """Past a call or memory bound: replacement first (under ``serve``), then a drain. A
    broken engine (``ENGINE_UNREADY_AFTER_FAILURES`` unexpected failures in a row: its
    feeders already take nothing) drains at once and exits ``EXIT_BROKEN``, for ``serve`` or
    the kubelet to restart it: a corrupt model in memory or a lost GPU context is not mended
    by waiting."""

    def __init__(self, shared: service.OcrService, settings: Settings, stop: threading.Event):
        self._shared = shared
        self._max_calls = settings.processes.max_calls
        self._max_rss = settings.processes.max_rss_mb
        self._stop = stop
        self.reason = ""
        self.broken = False

    def watch(self) -> None:
        runner, state = self._shared.cache.computer.runner, self._shared.engine_state
        while not self._stop.wait(1.0):
            if state.failing:
                self.broken = True
                self.reason = (
                    f"{state.failures} failures in a row (ENGINE_UNREADY_AFTER_FAILURES): broken"
                )
                metrics.ENGINE_BROKEN.inc()
                log.error("engine broken after %s; it takes no more tickets and exits for a "
                          "restart", self.reason)  # fmt: skip
                self._stop.set()
                return
            if self._max_calls and runner.calls >= self._max_calls:
                self.reason = f"{runner.calls} calls (ENGINE_MAX_CALLS={self._max_calls})"
            elif self._max_rss and (rss := rss_mb()) > self._max_rss:
                self.reason = f"{rss:.0f} MB resident (ENGINE_MAX_RSS_MB={self._max_rss})"
            else:
                continue
            log.info("engine retiring after %s", self.reason)
            self._await_replacement()
            self._stop.set()
            return

    def _await_replacement(self) -> None:
        """Ask ``serve`` for a replacement, and keep taking misses until it reports in."""
        supervisor = int(os.environ.get(SUPERVISOR_PID, "0") or 0)
        if not supervisor:
            return
        before = live_engines(self._shared)
        try:
            retiring = os.environ.get(RETIRING_DIR, "")
            if retiring:  # so that its replacement serves this one's queue shard
                Path(retiring, str(os.getpid())).touch()
            os.kill(supervisor, signal.SIGUSR1)
        except OSError:
            return
        deadline = time.monotonic() + REPLACEMENT_WAIT_SECONDS
        while time.monotonic() < deadline and not self._stop.is_set():
            if live_engines(self._shared) > before:
                return
            time.sleep(0.5)


def live_engines(shared: service.OcrService) -> int:
    """Engine slots that reported in lately (the queue's register); 0 without Redis."""
    store = shared.cache.store
    queue = shared.cache.misses.queue
    if not isinstance(store, RedisStore) or queue is None:
        return 0
    engines, live_ms = queue.names.engines, queue.live_ms
    ok, count = store.run("dispatch", lambda c: c.zcount(engines, _redis_ms(c) - live_ms, "+inf"))
    return int(count) if ok else 0


def _redis_ms(client: Any) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def run(settings: Settings) -> int:
    """Serve until SIGTERM/SIGINT or retirement; 0 on a clean stop."""
    # Below the fronts, before any thread starts (threads inherit it): on a machine the two
    # roles share, an engine computing a miss never takes the CPU from a hit
    # (docs/PERFORMANCE.md, "Roles apart").
    with contextlib.suppress(OSError):
        os.nice(settings.processes.engine_nice)
    memory.keep_large_buffers()
    tracing.setup("engine")  # OTEL_*: off unless an endpoint or exporter is set
    engine = with_redaction(
        build_engine(settings), settings.redaction.types, settings.redaction.patterns_file
    )
    metrics.initialise(engine.kind)
    shared = service.build(settings, engine, None, role="engine")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per probe
    server = make_server(
        settings.server.host, settings.processes.engine_port,
        engine_app(shared, settings), threaded=True,
    )  # fmt: skip
    shared.engine_state.start()  # the routes exist (``service.build``)
    threading.Thread(target=server.serve_forever, name="engine-http", daemon=True).start()
    retirement = Retirement(shared, settings, stop)
    threading.Thread(target=retirement.watch, name="engine-retire", daemon=True).start()
    jobs = job_driver.start(settings, shared.jobs, shared.cache)  # document jobs' pages
    log.info(
        "engine process %d: %s on the miss queue, %d slot(s), port %d",
        os.getpid(), engine.kind, shared.cache.computer.runner.slots,
        settings.processes.engine_port,
    )  # fmt: skip
    while not stop.wait(1.0):
        pass
    if jobs is not None:  # the page in progress ends; another engine's driver goes on
        jobs.stop(float(settings.engine.timeout_seconds))
    drain(shared, float(settings.engine.timeout_seconds))
    server.shutdown()
    tracing.shutdown()
    log.info("engine process %d stopped%s", os.getpid(),
             f" (retired after {retirement.reason})" if retirement.reason else "")  # fmt: skip
    return EXIT_BROKEN if retirement.broken else 0


def drain(shared: service.OcrService, timeout: float) -> None:
    """Take no more misses; let the calls in progress finish (their results are stored). A
    stopped feeder takes no ticket after its wake-up (``Feeders._read``): one taken then and
    cut off by the exit was answered as a bug (an HTTP 500 seen during a retirement). The
    feeders' threads are joined for a few seconds only: waiting for them up to the OCR timeout
    each made a stop outlast its supervisor's wait (a clean-clone run)."""
    shared.cache.close()
    runner = shared.cache.computer.runner
    deadline = time.monotonic() + timeout
    while runner.running and time.monotonic() < deadline:
        time.sleep(0.1)
    if shared.cache.l3 is not None:
        shared.cache.l3.flush(5.0)
