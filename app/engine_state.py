"""The engine's lifecycle as /readyz reports it: loaded in the background at start-up (the
first request waits for it instead of paying for it), then healthy or failing: after
``unready_after`` consecutive engine errors the worker reports unready until a call succeeds
again. Timeouts and a full queue are load, never recorded here (``app.engine_calls.compute``)."""

from __future__ import annotations

import logging
import threading
import time

from app import metrics
from app.engines.base import Engine
from app.vocabulary import EngineError

log = logging.getLogger(__name__)


class EngineState:
    def __init__(self, engine: Engine, wait_seconds: float, unready_after: int = 5) -> None:
        self.engine = engine
        self._wait_seconds = wait_seconds
        self._unready_after = unready_after
        self._consecutive_failures = 0
        self._ready = threading.Event()
        self.error: str | None = None
        self.load_seconds: float | None = None

    def start(self) -> None:
        threading.Thread(target=self._load, name="engine-loader", daemon=True).start()

    def _load(self) -> None:
        start = time.perf_counter()
        try:
            self.engine.load()
        except Exception as exc:  # report, do not crash the worker: /readyz says why
            self.error = f"{exc.__class__.__name__}: {exc}"
            log.exception("engine failed to load")
            return
        self.load_seconds = time.perf_counter() - start
        log.info("engine %s ready in %.1fs", self.engine.fingerprint, self.load_seconds)
        self._ready.set()
        metrics.ENGINE_READY.set(1)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self.failing

    @property
    def failing(self) -> bool:
        return self._consecutive_failures >= self._unready_after

    @property
    def failures(self) -> int:
        """The engine's own failures in a row now."""
        return self._consecutive_failures

    @property
    def status(self) -> str:
        if self.error:
            return "failed"
        if not self._ready.is_set():
            return "loading"
        return "failing" if self.failing else "ready"

    def record(self, ok: bool) -> None:
        """Called after every engine call that ran to its end: ``ok`` False for the engine's
        own error only (not for client errors, timeouts or a full queue)."""
        was_ready = self.ready
        self._consecutive_failures = 0 if ok else self._consecutive_failures + 1
        if self.ready != was_ready:
            metrics.ENGINE_READY.set(1 if self.ready else 0)

    def wait(self) -> None:
        if self._ready.wait(self._wait_seconds):
            return
        raise EngineError(self.error or "engine is still loading")
