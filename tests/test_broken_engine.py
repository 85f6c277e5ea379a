"""A failing engine does not eat the queue: a ticket an engine fails with an unexpected error is
run once more on another live engine before its caller sees an error, and an engine that
fails ``ENGINE_UNREADY_AFTER_FAILURES`` tickets in a row stops taking any, reports unready
and (an engine process) retires for a restart.

Two front doors with their own feeders share one queue in this process: one around the real
engine, one around a double whose ``recognize`` raises an exception no layer expects (a bug,
a broken GPU). Everything else is the real thing: Redis, the queue's scripts, the feeders."""

from __future__ import annotations

import base64
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from app.engine_process import Retirement
from app.engines.base import OcrRequest
from app.vocabulary import OcrResult
from tests.conftest import CORPUS
from tests.fleet import wait_for
from tests.helpers import metric_sum

pytestmark = pytest.mark.integration

IMAGES = sorted(CORPUS.glob("*.png"), key=lambda path: path.stat().st_size)[1:8]  # small


class BrokenEngine:
    """The real engine's identity; every ``recognize`` fails with an unexpected type, once
    ``release`` is set (a test holds the first call until the healthy engine is up)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.kind = engine.kind
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def recognize(self, request: OcrRequest) -> OcrResult:
        self.calls += 1
        self.entered.set()
        self.release.wait(60)
        raise KeyError("a broken engine")


def _body(path) -> dict[str, str]:
    return {"image": base64.b64encode(path.read_bytes()).decode()}


def _tickets(client, outcome: str) -> float:
    text = client.get("/metrics").get_data(as_text=True)
    return metric_sum(text, "ocr_dispatch_tickets_total", outcome=outcome)


@pytest.fixture()
def broken(make_app, engine):
    double = BrokenEngine(engine)
    app = make_app(engine_override=double, engine_unready_after_failures=1)
    state = app.extensions["ocr"]["engine_state"]
    wait_for(lambda: state.ready, 60, f"the engine ready (status {state.status})")
    app.extensions["ocr"]["cache"].dispatch_ready(5)
    return app, double


def _live_engines(app) -> list[str]:
    cache = app.extensions["ocr"]["cache"]
    names = cache.misses.queue.names
    return [m.decode() for m in cache.store.run("t", lambda c: c.zrange(names.engines, 0, -1))[1]]


def test_a_broken_engine_beside_a_healthy_one(broken, make_app):
    app, double = broken
    client = app.test_client()
    retried = _tickets(client, "retried")
    with ThreadPoolExecutor(1) as pool:
        # The broken engine takes the only ticket (it is the only engine yet) and holds it
        # until a healthy engine is live, then fails it: handed back, not answered 500.
        first = pool.submit(client.post, "/v1/ocr", json=_body(IMAGES[0]))
        assert double.entered.wait(60), "the broken engine never took the ticket"
        healthy = make_app()
        double.release.set()
        answer = first.result(timeout=120)
    assert answer.status_code == 200, answer.get_data(as_text=True)
    assert answer.headers["X-Cache"] == "MISS"
    again = healthy.test_client().post("/v1/ocr", json=_body(IMAGES[0]))  # the stored entry
    assert again.headers["X-Cache"] == "HIT"
    assert again.get_json()["lines"] == answer.get_json()["lines"]
    assert double.calls == 1
    assert _tickets(client, "retried") == retried + 1

    # One failure in a row is this engine's bound here: it takes no more tickets, is out of
    # the live register, and reports unready; every request is answered by the healthy one.
    state = app.extensions["ocr"]["engine_state"]
    assert state.status == "failing" and client.get("/readyz").status_code == 503
    healthy_names = set(_live_engines(healthy))
    wait_for(
        lambda: set(_live_engines(app)) <= healthy_names, 30,
        f"the broken engine out of the live register ({_live_engines(app)})",
    )  # fmt: skip
    clients = [client, healthy.test_client()]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(
            lambda i: clients[i % 2].post("/v1/ocr", json=_body(IMAGES[1 + i])), range(6)
        ))  # fmt: skip
    assert [a.status_code for a in answers] == [200] * 6, [a.get_json() for a in answers]
    assert double.calls == 1

    # An engine process in this state retires at once, for a restart (exit status 3).
    stop = threading.Event()
    retirement = Retirement(app.extensions["ocr"], app.extensions["ocr"]["settings"], stop)
    before = metric_sum(client.get("/metrics").get_data(as_text=True), "ocr_engine_broken_total")
    watcher = threading.Thread(target=retirement.watch, daemon=True)
    watcher.start()
    watcher.join(10)
    assert stop.is_set() and retirement.broken and "failures in a row" in retirement.reason
    after = metric_sum(client.get("/metrics").get_data(as_text=True), "ocr_engine_broken_total")
    assert after == before + 1


def test_alone_a_broken_engine_answers_at_once(broken):
    """No other engine is live: the ticket is not handed back (nobody would take it), its
    caller hears the error now, not at its deadline."""
    app, double = broken
    double.release.set()
    client = app.test_client()
    retried = _tickets(client, "retried")
    answer = client.post("/v1/ocr", json=_body(IMAGES[0]))
    assert answer.status_code == 500
    assert answer.get_json()["error"]["code"] == "internal_error"
    assert _tickets(client, "retried") == retried
    assert "X-Cache" not in answer.headers
