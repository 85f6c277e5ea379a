"""Loads the engine in the background at start-up, so /readyz can say when it is ready and
the first request does not pay for the load (it waits for it instead of failing)."""

from __future__ import annotations

import logging
import threading
import time

from app.engines.base import Engine, EngineError

log = logging.getLogger(__name__)


class EngineState:
    def __init__(self, engine: Engine, wait_seconds: float) -> None:
        self.engine = engine
        self._wait_seconds = wait_seconds
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

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def wait(self) -> None:
        if self._ready.wait(self._wait_seconds):
            return
        raise EngineError(self.error or "engine is still loading")
