import time

from app.cache.breaker import CircuitBreaker


def test_opens_after_threshold_and_probes_after_cooldown():
    b = CircuitBreaker(failure_threshold=2, cooldown_seconds=0.05)
    assert b.allow()
    b.failure()
    assert b.allow() and b.state == "closed"
    b.failure()
    assert b.state == "open" and not b.allow()
    time.sleep(0.06)
    assert b.allow()  # the single half-open probe
    assert not b.allow()
    b.failure()
    assert b.state == "open" and not b.allow()
    time.sleep(0.06)
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.allow()
