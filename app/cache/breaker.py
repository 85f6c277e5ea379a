"""A small circuit breaker: after N consecutive failures, skip Redis for a cool-down.

While open, calls fail fast instead of each paying a timeout; after the cool-down one call
is let through (half-open) and its outcome closes or re-opens the circuit. That is how the
service comes back to caching by itself when Redis returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int,
        cooldown_seconds: float,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``on_change(is_open)`` is called once at the start (closed: a gauge reads this
        breaker, not an earlier one of the process) and on each transition (a gauge for
        alerting), not on every call, so the hot path pays nothing for it."""
        self._on_change = on_change
        if on_change is not None:
            on_change(False)
        self._clock = clock
        self._threshold = failure_threshold
        self._cooldown = cooldown_seconds
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """May a call go to Redis now?"""
        with self._lock:
            if self._opened_at is None:
                return True
            if self._probing or self._clock() - self._opened_at < self._cooldown:
                return False
            self._probing = True  # exactly one probe per cool-down
            return True

    def success(self) -> None:
        with self._lock:
            was_open = self._opened_at is not None
            self._failures = 0
            self._opened_at = None
            self._probing = False
        if was_open and self._on_change is not None:
            self._on_change(False)

    def failure(self) -> None:
        with self._lock:
            was_open = self._opened_at is not None
            self._failures += 1
            self._probing = False
            if self._failures >= self._threshold:
                self._opened_at = self._clock()
            opened = not was_open and self._opened_at is not None
        if opened and self._on_change is not None:
            self._on_change(True)

    @property
    def state(self) -> str:
        with self._lock:
            if self._opened_at is None:
                return "closed"
            return "half-open" if self._probing else "open"
