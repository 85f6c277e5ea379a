"""The Redis circuit breaker, on a clock the test moves (no sleeping)."""

import pytest

from app.cache.breaker import CircuitBreaker

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_threshold_and_probes_after_cooldown():
    clock = Clock()
    changes: list[bool] = []
    b = CircuitBreaker(failure_threshold=2, cooldown_seconds=5, on_change=changes.append,
                       clock=clock)  # fmt: skip
    assert changes == [False]  # the gauge reads this new breaker: closed
    assert b.allow()
    b.failure()
    assert b.allow() and b.state == "closed"
    b.failure()
    assert b.state == "open" and not b.allow() and changes == [False, True]
    clock.now += 4.9
    assert not b.allow()  # still cooling down
    clock.now += 0.2
    assert b.allow()  # the single half-open probe
    assert not b.allow() and b.state == "half-open"
    b.failure()
    assert b.state == "open" and not b.allow()
    clock.now += 5.1
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.allow() and changes == [False, True, False]
