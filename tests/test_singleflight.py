"""One computation per image across threads (in-process) and across front doors that share
only Redis (app instances in one test process stand for processes: they share nothing but
the Redis server, exactly like granian workers or replicas), with the real engine. The
mechanism's own cases are in tests/test_cache_unit.py and tests/test_dispatch.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import PHOTOTEST, WORD_CH
from tests.fleet import wait_for
from tests.helpers import b64, metric_sum, stored_keys

pytestmark = pytest.mark.integration


def engine_calls(client) -> float:  # type: ignore[no-untyped-def]
    return metric_sum(client.get("/metrics").text, "ocr_engine_calls_total")


def fire(clients, data: bytes, n: int):  # type: ignore[no-untyped-def]
    barrier = threading.Barrier(n)

    def one(i: int):  # type: ignore[no-untyped-def]
        barrier.wait()
        resp = clients[i % len(clients)].post("/v1/ocr", json={"image": b64(data)})
        body = resp.get_json()
        return resp.status_code, resp.headers.get("X-Cache"), body.get("lines", body)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_threads_of_one_process_share_one_computation(make_app):
    client = make_app().test_client()
    before = engine_calls(client)
    results = fire([client], PHOTOTEST.read_bytes(), 8)
    assert engine_calls(client) - before == 1
    assert {r[0] for r in results} == {200}
    statuses = sorted(r[1] for r in results)
    assert statuses.count("MISS") == 1 and set(statuses) <= {"MISS", "COALESCED", "HIT"}
    assert all(r[2] == results[0][2] for r in results)


def test_front_doors_sharing_only_redis_compute_once(make_app):
    clients = [make_app().test_client() for _ in range(4)]
    before = engine_calls(clients[0])
    results = fire(clients, PHOTOTEST.read_bytes(), 16)
    assert engine_calls(clients[0]) - before == 1
    assert {r[0] for r in results} == {200}
    assert all(r[2] == results[0][2] for r in results)
    statuses = sorted(r[1] for r in results)
    assert statuses.count("MISS") == 1 and set(statuses) <= {"MISS", "COALESCED", "HIT"}


def test_failed_computation_is_not_shared_as_a_result(make_app, redis_client, engine):
    """The in-process followers of a failing computation get its error once; nothing cached."""
    from app.vocabulary import EngineError

    calls = []
    gate = threading.Event()

    class Failing:
        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            return getattr(engine, name)

        def recognize(self, request):  # type: ignore[no-untyped-def]
            calls.append(1)
            gate.wait(120)
            raise EngineError("engine crashed")

    app = make_app(engine_override=Failing())
    client = app.test_client()
    # The engine fails once all four requests are in flight: in the app's single flight.
    flights, arrived = app.extensions["ocr"]["cache"]._misses._flights, []
    do = flights.do

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        arrived.append(1)
        return do(*args, **kwargs)

    def fail_once_all_joined() -> None:
        try:
            wait_for(lambda: len(arrived) >= 4 and calls, 120, "four requests in flight")
        finally:
            gate.set()

    flights.do = counted
    threading.Thread(target=fail_once_all_joined, daemon=True).start()
    results = fire([client], WORD_CH.read_bytes(), 4)
    assert [r[0] for r in results] == [503] * 4
    assert all(r[2]["error"]["message"] == "engine crashed" for r in results)
    assert len(calls) == 1
    assert stored_keys(redis_client, "ocr:*") == []


def test_a_computed_entry_is_announced_to_the_waiters(make_app, redis_client):
    client = make_app().test_client()
    pubsub = redis_client.pubsub()
    pubsub.psubscribe("ocr:done:*")
    client.post("/v1/ocr", json={"image": b64(PHOTOTEST.read_bytes())})
    messages = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not messages:
        message = pubsub.get_message(timeout=0.5)
        if message and message["type"] == "pmessage":
            messages.append(message)
    assert messages and messages[0]["data"].startswith(b"ok:")  # ok:<ticket id>
