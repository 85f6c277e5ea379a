"""A purge is confirmed on the replicas before it is reported done (``app/cache/purging.py``):
a real master with a real replica. Confirmed, the replica no longer holds the keys when the
answer comes; with the replica frozen (SIGSTOP) or Redis failing part-way, the admin API
answers 503 ``purge_unconfirmed`` with ``Retry-After`` and ``ocr-cache purge`` exits 1, and
repeating the purge once the replica answers again is a 200. On a Redis Cluster, with a
master killed right after the purge: tests/test_fleet_cluster.py."""

from __future__ import annotations

import hashlib
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from flask import Flask
from werkzeug.serving import make_server

from app import admin, cli
from app.cache.breaker import CircuitBreaker
from app.cache.store import RedisStore
from app.config import Settings
from app.embedded_redis import EmbeddedRedis
from app.engine_state import EngineState
from tests.fleet import wait_for
from tests.test_cache_unit import IMAGES, CountingEngine, make_cache

pytestmark = pytest.mark.integration

TOKEN = "purge-replicas-token"


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    with EmbeddedRedis() as master:
        args = ["--replicaof", "127.0.0.1", str(master.port)]
        with EmbeddedRedis(extra_args=args) as replica:
            client = redis.Redis(port=replica.port)
            wait_for(
                lambda: client.info("replication")["master_link_status"] == "up", 60, "in sync"
            )
            yield master, replica


@pytest.fixture()
def frozen(pair: tuple[EmbeddedRedis, EmbeddedRedis]) -> Iterator[EmbeddedRedis]:
    """The replica, stopped (connected, but it confirms nothing) until the test ends."""
    replica = pair[1]
    assert replica.proc is not None
    try:
        yield replica
    finally:
        replica.proc.send_signal(signal.SIGCONT)


def fill(master: EmbeddedRedis, n: int = 3) -> None:
    client = redis.Redis(port=master.port)
    for i in range(n):
        client.set(f"ocr:v1:fp:ocr:{{{i:032x}}}", b"x")


Pair = tuple[EmbeddedRedis, EmbeddedRedis]


def test_a_confirmed_purge_is_gone_from_the_replica(pair: Pair) -> None:
    master, replica = pair
    fill(master, 700)  # more than one batch
    store = RedisStore(master.url, 1000, 1000, CircuitBreaker(3, 2.0))
    purged = store.scan_unlink("ocr:v1:*", "ocr:purgesync:")
    assert (purged.removed, purged.unconfirmed) == (700, "")
    left = list(redis.Redis(port=replica.port).scan_iter("ocr:v1:*"))
    assert left == []  # at once: WAIT saw the deletes there


def test_a_frozen_replica_leaves_the_purge_unconfirmed(
    pair: tuple[EmbeddedRedis, EmbeddedRedis], frozen: EmbeddedRedis
) -> None:
    master, _ = pair
    fill(master)
    store = RedisStore(master.url, 1000, 1000, CircuitBreaker(3, 2.0))
    assert frozen.proc is not None
    frozen.proc.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    purged = store.scan_unlink("ocr:v1:*", "ocr:purgesync:")
    assert purged.removed == 3
    assert "0 of 1 replicas" in purged.unconfirmed
    again = store.scan_unlink("ocr:v1:*", "ocr:purgesync:")  # nothing left to delete, still
    assert (again.removed, "0 of 1 replicas" in again.unconfirmed) == (0, True)
    assert time.monotonic() - started < 5  # bounded: WAIT gives up after a second


def test_a_purge_cut_short_by_redis_is_unconfirmed() -> None:
    with EmbeddedRedis() as lone:
        store = RedisStore(lone.url, 1000, 1000, CircuitBreaker(3, 2.0))
    purged = store.scan_unlink("ocr:v1:*", "ocr:purgesync:")  # the server is gone
    assert purged.removed == 0 and "Redis failed" in purged.unconfirmed


def test_admin_api_and_cli_say_unconfirmed_then_repeat(
    base_settings: Settings,
    pair: tuple[EmbeddedRedis, EmbeddedRedis],
    frozen: EmbeddedRedis,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    master, replica = pair
    engine = CountingEngine()
    cache = make_cache(base_settings, engine, redis_url=master.url, redis_timeout_ms=1000)
    cache.get_or_compute(IMAGES[0])
    md5 = hashlib.md5(IMAGES[0]).hexdigest()  # noqa: S324 - the cache key's MD5
    app = Flask(__name__)
    admin.register(app, TOKEN, cache, EngineState(engine, 1.0))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    serve = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    serve.start()
    request.addfinalizer(server.shutdown)
    base = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setenv("OCR_CACHE_ADMIN_TOKEN", TOKEN)

    assert frozen.proc is not None
    frozen.proc.send_signal(signal.SIGSTOP)
    answer = cli.Client(base, 30.0).request(
        "POST", "/admin/purge", json={"md5": md5}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "purge_unconfirmed"
    assert "removed 1 entries" in answer.json()["error"]["message"]
    assert answer.headers["Retry-After"] == "1"
    capsys.readouterr()
    assert cli.main(["purge", "--md5", md5, "--server", base]) == 1
    assert "purge not confirmed, run it again" in capsys.readouterr().err

    frozen.proc.send_signal(signal.SIGCONT)
    client = redis.Redis(port=replica.port)
    wait_for(lambda: client.info("replication")["master_link_status"] == "up", 60, "in sync")
    assert cli.main(["purge", "--md5", md5, "--server", base]) == 0
    assert capsys.readouterr().out.startswith("removed 0 entries")
