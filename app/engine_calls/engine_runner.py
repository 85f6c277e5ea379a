"""Runs engine calls with a bounded queue and a per-call timeout.

A request waits at most ``OCR_TIMEOUT_SECONDS`` for its result. A call that timed out before
it started is cancelled (its caller has gone: the engine never runs it); one that already
started cannot be interrupted safely and finishes (an *orphan*): its result is still handed
to ``late`` (the cache stores it, so a retry is a hit). When more calls are waiting than the
queue holds, a new one is refused at once (``EngineBusy``: 503 + ``Retry-After``,
``err_no``, gRPC RESOURCE_EXHAUSTED) instead of queueing work no one will wait for. A caller
with no time left is answered at once: its call is never queued. ``ocr_engine_queue_depth``
is the number of calls waiting to start, ``ocr_engine_calls_running`` the number running (a
timed-out call that started counts until it ends).

**Orphans yield.** Where the engine can pause its call (below), every call that comes while
an orphan runs goes in at the orphan's next pause, whatever its tenant, instead of waiting
for its end: nobody waits for the orphan, somebody waits for the new call. The orphan
resumes only when nothing waits, and is never abandoned: its page is already paid for up
to the pause, and its entry answers the retry that a 504 usually brings. A call with under
``YIELD_MIN_SECONDS`` left is not begun inside it (once begun, a call is not paused in turn).

Where the engine can pause its call for another (``engine.interject``: the in-process one,
between recognition batches), ``interjected(fn)`` runs ``fn`` - a ticket's whole
serving, its engine call included - on the engine's thread at the next pause of the call
in progress, which then resumes. The paused call is charged its own time only, and ``fn``
runs while the engine does nothing else (its work holds Python's GIL at times: a ticket served
on another thread beside it was measured waiting up to a second for it).
"""

from __future__ import annotations

import contextvars
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from app import metrics
from app.vocabulary import EngineBusy, EngineTimeout

log = logging.getLogger(__name__)

YIELD_MIN_SECONDS = 1.0  # a call with less time left is not begun inside an orphan

T = TypeVar("T")
Interject = Callable[[Callable[[], Any]], "Future[Any]"]


class EngineRunner:
    """``workers`` calls run at once (1 for an in-process engine that serializes anyway, so
    waiting calls stay cancellable here rather than queued inside the engine);
    ``interject``: the engine's, where it can pause its call in progress for another."""

    def __init__(
        self, workers: int, max_queue: int, timeout: float, interject: Interject | None = None
    ) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="engine")
        self._interject = interject
        self._inside = threading.local()  # on the engine's thread, in an interjected fn
        # (start, end) of the interjected work lately done: no call that overlaps it is
        # charged for it (one call at a time where the engine can interject)
        self._interjections: deque[tuple[float, float]] = deque(maxlen=64)
        self._workers = workers
        self._max_queue = max_queue
        self._timeout = timeout
        self._lock = threading.Lock()
        self._waiting = 0
        self._mean_seconds: float | None = None  # moving average of a call (from the first)
        self.calls = 0  # calls that ran to their end (an engine process retires past a bound)
        self.running = 0  # calls running now (a retiring engine process waits for none)
        self.orphans = 0  # calls running whose caller has gone (timed out)

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def slots(self) -> int:
        """Calls that run at once."""
        return self._workers

    @property
    def mean_seconds(self) -> float:
        """Moving average of one call (Retry-After estimates, the fair queue's quantum); 1 s
        before the first call."""
        return 1.0 if self._mean_seconds is None else self._mean_seconds

    def run(
        self,
        fn: Callable[..., T],
        *args: object,
        timeout: float | None = None,
        elapsed: list[float] | None = None,
        late: Callable[[T], None] | None = None,
    ) -> T:
        """``fn(*args)`` on an engine thread; EngineBusy, EngineTimeout or fn's own error.
        ``timeout``: this call's own bound (a ticket's time left), else the runner's;
        ``elapsed`` gets the seconds ``fn`` ran (engine time, without the queue wait nor
        the interjected work it was paused for); ``late(result)``: what becomes of the result
        of a call that ends after its caller timed out. Within ``interjected``, inline; while
        an orphan runs, at its next pause."""
        if timeout is None:
            timeout = self._timeout
        elif timeout <= 0:  # the caller's time is gone: no engine work for nobody
            metrics.ENGINE_QUEUE_DROPPED.labels(reason="caller_gone").inc()
            raise EngineTimeout("OCR took longer than the time its caller had left")
        if getattr(self._inside, "active", False):
            return self._start(elapsed, fn, *args, queued=False)
        self._enter_queue()
        if self._interject is not None and self.orphans:
            return self._yielded(fn, args, timeout, elapsed)
        # In the caller's context (its current span: the engine's spans are its children).
        call = contextvars.copy_context().run
        future: Future[T] = self._pool.submit(call, self._start, elapsed, fn, *args)
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            if future.cancel():  # never started: the engine will not run it for nobody
                self._left_queue()
                metrics.ENGINE_QUEUE_DROPPED.labels(reason="caller_gone").inc()
            else:  # running: an orphan, which finishes in its thread
                self._orphaned(future, late)
            raise EngineTimeout(
                f"OCR took longer than OCR_TIMEOUT_SECONDS={self._timeout:g}"
                if timeout == self._timeout
                else f"OCR took longer than the {timeout:.3g} s its caller had left"
            ) from None

    def _enter_queue(self) -> None:
        """A call waits for the engine (EngineBusy when ``max_queue`` already do)."""
        with self._lock:
            if self._waiting >= self._max_queue:
                metrics.ENGINE_QUEUE_DROPPED.labels(reason="full").inc()
                raise EngineBusy(
                    f"the engine queue is full ({self._max_queue} waiting); retry later",
                    self._retry_after(),
                )
            self._waiting += 1
            metrics.ENGINE_QUEUE_DEPTH.inc()

    def interjected(self, fn: Callable[[], T], timeout: float) -> T:
        """``fn()`` on the engine's thread at the next pause of the call in progress (at
        once when idle; on this thread where the engine cannot pause); engine calls it makes
        through ``run`` run inline there. EngineTimeout if it has not started within
        ``timeout`` (then it never does)."""
        if self._interject is None:
            return fn()

        def inside() -> T:
            self._inside.active, began = True, time.perf_counter()
            try:
                return fn()
            finally:
                self._inside.active = False
                self._interjections.append((began, time.perf_counter()))

        future: Future[T] = self._interject(inside)
        try:
            return future.result(timeout=max(0.0, timeout))
        except FutureTimeout:
            if future.cancel():  # never started: the engine will not run it for nobody
                metrics.ENGINE_QUEUE_DROPPED.labels(reason="caller_gone").inc()
                raise EngineTimeout("no pause of the engine's call came in time") from None
            return future.result()  # started meanwhile: it ends, and it is ours

    def _start(
        self, spent: list[float] | None, fn: Callable[..., T], *args: object, queued: bool = True
    ) -> T:
        if queued:
            self._left_queue()
        metrics.ENGINE_CALLS_RUNNING.inc()
        with self._lock:
            self.running += 1
        began = time.perf_counter()
        try:
            return fn(*args)
        finally:
            metrics.ENGINE_CALLS_RUNNING.dec()
            with self._lock:
                self.running -= 1
                self.calls += 1
            ended = time.perf_counter()
            elapsed = max(0.0, ended - began - self._paused(began, ended))
            mean = self._mean_seconds
            self._mean_seconds = elapsed if mean is None else 0.8 * mean + 0.2 * elapsed
            if spent is not None:
                spent.append(elapsed)

    def _yielded(
        self, fn: Callable[..., T], args: tuple[object, ...], timeout: float,
        elapsed: list[float] | None,
    ) -> T:  # fmt: skip
        """``fn(*args)`` at the next pause of the orphan running. A call with under
        ``YIELD_MIN_SECONDS`` left is not begun there: it could not end in time, and once
        begun it could not be paused in turn for the next one."""
        begun = threading.Event()  # it left the queue (it waits in it as a queued call does)
        if timeout < YIELD_MIN_SECONDS:
            self._left_queue()
            metrics.ENGINE_QUEUE_DROPPED.labels(reason="caller_gone").inc()
            raise EngineTimeout(f"OCR took longer than the {timeout:.3g} s its caller had left")

        def at_pause() -> T:
            begun.set()
            self._left_queue()
            metrics.ENGINE_ORPHAN_YIELDS.inc()
            return self._start(elapsed, fn, *args, queued=False)

        try:
            return self.interjected(at_pause, timeout)
        finally:
            if not begun.is_set():
                self._left_queue()

    def _orphaned(self, future: Future[T], late: Callable[[T], None] | None) -> None:
        """``future`` runs on though its caller has gone: counted until it ends (calls that
        come meanwhile go in at its pauses), then its result goes to ``late``."""
        with self._lock:
            self.orphans += 1

        def ended(done: Future[T]) -> None:
            with self._lock:
                self.orphans -= 1
            if late is not None and not done.cancelled() and done.exception() is None:
                try:
                    late(done.result())
                except Exception:  # noqa: BLE001 - storing a late result is a bonus
                    log.warning("a late engine result could not be kept", exc_info=True)

        future.add_done_callback(ended)

    def _paused(self, began: float, ended: float) -> float:
        """Seconds of interjected work between ``began`` and ``ended`` (within a call
        interjected itself: none, it is not paused)."""
        if getattr(self._inside, "active", False):
            return 0.0
        return sum(
            max(0.0, min(end, ended) - max(start, began))
            for start, end in list(self._interjections)
        )

    def _left_queue(self) -> None:
        with self._lock:
            self._waiting -= 1
        metrics.ENGINE_QUEUE_DEPTH.dec()

    def _retry_after(self) -> int:
        """Seconds until the queue has likely drained by one slot per worker."""
        return max(1, math.ceil(self.mean_seconds * self._waiting / self._workers))
