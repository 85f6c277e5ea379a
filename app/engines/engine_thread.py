"""The one thread an in-process engine runs on, with room for interjected calls.

Paddle Inference's predictors must be called on the thread that built them (``paddle.py``),
so every call of an engine runs on one thread, one after another. A call may be
*interjected* (``interject``): it runs at the next yield point of the call in progress -
the engine calls ``yield_point()`` between the steps of a page, its recognition batches -
and that call then resumes where it stopped, its own state untouched (an interjected call
runs the same models on the same thread, never at the same time). No call is abandoned or
restarted: a page is only paused while another tenant's ticket runs
(``app/engine_side/interjection.py`` decides which and when). An interjected call is not
interrupted in turn.

A page to be interjected then waits for the batch in progress (6 crops, 0.1-1 s on the
corpus; detection, 0.05-0.9 s, is not split), not the rest of a page that may run 11 s;
line reuse's recognizer pauses between its own batches too. Both pages' answers are those
of either page alone (``tests/test_engine.py``; with line reuse ``tests/test_lines.py``).
"""

from __future__ import annotations

import contextvars
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class _Call:
    """A call and its caller's context (``contextvars``): on the engine's thread it runs in
    it, so the caller's current span is its spans' parent and its log lines carry its ids."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args, self.future = fn, args, Future[Any]()
        self.context = contextvars.copy_context()

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # its caller gave up before it started
        try:
            self.future.set_result(self.context.run(self.fn, *self.args))
        except BaseException as exc:  # the caller's to handle, on its own thread
            self.future.set_exception(exc)


class EngineThread:
    """Runs ``submit``ted calls in order on one daemon thread; ``interject``ed ones first,
    and inside the call in progress at its next ``yield_point``."""

    def __init__(self, name: str) -> None:
        self._lock = threading.Condition()
        self._calls: deque[_Call] = deque()
        self._to_interject: deque[_Call] = deque()
        self._interjecting = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._put(self._calls, _Call(fn, args))

    def interject(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` at the next yield point of the call in progress (or next, when
        there is none)."""
        return self._put(self._to_interject, _Call(fn, args))

    def on_thread(self) -> bool:
        """Whether the caller is this engine's thread (a call from it runs inline)."""
        return threading.current_thread() is self._thread

    def yield_point(self) -> int:
        """Between two steps of the call in progress (on this thread): run the interjected
        calls waiting (how many ran). Nothing within an interjected call, nor from another
        thread."""
        if self._interjecting or not self._to_interject or not self.on_thread():
            return 0
        self._interjecting = True
        try:
            return self._run_interjected()
        finally:
            self._interjecting = False

    def _put(self, calls: deque[_Call], call: _Call) -> Future[Any]:
        with self._lock:
            calls.append(call)
            self._lock.notify()
        return call.future

    def _next(self, calls: deque[_Call]) -> _Call | None:
        with self._lock:
            return calls.popleft() if calls else None

    def _run_interjected(self) -> int:
        ran = 0
        while (call := self._next(self._to_interject)) is not None:
            call.run()
            ran += 1
        return ran

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._calls and not self._to_interject:
                    self._lock.wait()
            self.yield_point()  # interjected calls first, each on its own
            call = self._next(self._calls)
            if call is not None:
                call.run()
