"""The waiters' fallback check (``app/queue/watch.py``) on a real Redis: one call per lane for
every waiter of a process, an answer reused only for tickets queued before it was made and
only while fresh, a vanished stream told to every waiter, and Redis down read as "unsure"."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from app.cache.breaker import CircuitBreaker
from app.cache.keys import KeySpace
from app.cache.store import RedisStore
from app.embedded_redis import EmbeddedRedis
from app.queue.watch import LaneWatch
from tests.test_scripts import live_engine, submit, text

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def checks(client: redis.Redis) -> int:
    """The lane checks the server ran: each makes one XRANGE."""
    stats: Any = client.info("commandstats")
    return int(stats.get("cmdstat_xrange", {}).get("calls", 0))


def test_one_check_a_lane_answers_every_waiter(redis_server: EmbeddedRedis) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    names = KeySpace("ocr", "fingerprint").dispatch()
    live_engine(client, names)
    ids = [text(submit(client, names, "a", f"e{i}")[0]) for i in range(3)]
    store = RedisStore(redis_server.url, 2000, 2000, CircuitBreaker(3, 2.0))
    clock = Clock()
    watch = LaneWatch(store, live_ms=10_000, fresh_seconds=8.0, clock=clock)
    client.config_resetstat()
    with (
        watch.watching(names, "a", ids[0]) as first,
        watch.watching(names, "a", ids[1]) as second,
        watch.watching(names, "a", ids[2]) as third,
    ):
        clock.now += 16
        assert first(False) and checks(client) == 1
        clock.now += 1
        assert second(False) and third(False) and checks(client) == 1  # its answer, fresh: no call
        assert second(True) and checks(client) == 2  # news of a loss: a check of its own
        assert third(True) and checks(client) == 2  # ... which answers whoever asked before it
        clock.now += 0.5
        later = text(submit(client, names, "a", "e9")[0])
        with watch.watching(names, "a", later) as newcomer:
            assert newcomer(False) and checks(client) == 3  # queued after it: a check of its own
        client.delete(names.stream("a"))  # the LRU took the lane's stream
        assert second(False) and checks(client) == 3  # still fresh: told at the next check
        clock.now += 8
        assert not second(False) and not first(False) and not third(False) and checks(client) == 4
    assert watch._lanes == {}  # nothing kept once nobody waits


def test_redis_down_is_unsure() -> None:
    store = RedisStore("redis://127.0.0.1:1/0", 200, 200, CircuitBreaker(3, 30.0))
    watch = LaneWatch(store, live_ms=10_000, fresh_seconds=8.0)
    names = KeySpace("ocr", "fingerprint").dispatch()
    with watch.watching(names, "a", "1-0") as alive:
        assert alive(False)  # the next read tells
