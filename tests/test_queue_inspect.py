"""The queue, inspectable (``app/queue/inspect.py``): a real Redis, a front whose one engine
slot is held busy on tenant acme's first page while acme's next two and zeta's one wait in
their lanes. The picture tells each lane's waiting and running tickets, acme's deficit, the
live engine and the ticket it holds, and the oldest waits; ``GET /admin/queue`` answers it
only with the admin token; ``ocr-cache queue`` prints it (and ``--json``); the heartbeat's
gauges carry the same figures per tenant label. An empty queue (no keys at all) reads as
empty. On a Redis Cluster: ``tests/test_scripts.py`` (``queue_view.lua``)."""

from __future__ import annotations

import io
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import redis
import requests
from flask import Flask
from PIL import Image
from prometheus_client import REGISTRY
from werkzeug.serving import make_server

from app import admin, cli
from app.cache.keys import KeySpace
from app.cache.region import OcrCache
from app.config import Settings
from app.embedded_redis import EmbeddedRedis
from app.engine_side.heartbeat import Heartbeat
from app.engine_state import EngineState
from app.queue import inspect
from app.queue.requester import TicketQueue
from app.tenants import Tenant, TenantBook
from app.vocabulary import CacheControls, CacheStatus, EngineError
from tests.test_cache_unit import WAIT, CountingEngine, make_cache, wait_for

pytestmark = pytest.mark.unit

TOKEN = "queue-inspect-token"


class Serial(CountingEngine):
    """One engine slot: while its call is held, every other ticket waits."""

    slots = 1


def page(tenant: str, i: int) -> bytes:
    """A distinct small image per tenant and number."""
    img = Image.new("RGB", (32, 16), "white")
    img.putpixel((i % 32, i // 32 % 16), (ord(tenant[0]), i % 256, 0))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def book() -> TenantBook:
    return TenantBook.of([Tenant("acme", share=2.0), Tenant("zeta")])


@pytest.fixture()
def raw(redis_server: EmbeddedRedis, redis_client: redis.Redis) -> Iterator[redis.Redis]:
    """A plain client (``redis_client`` hides the queue's keys), on a flushed database."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


class Busy:
    """A front (its engine one slot) held on acme's first page, acme's next two pages and
    zeta's one waiting."""

    def __init__(self, settings: Settings, raw: redis.Redis, pool: ThreadPoolExecutor) -> None:
        self.engine = Serial()
        self.cache: OcrCache = make_cache(settings, self.engine, book=book())
        assert self.cache.dispatch_ready(WAIT)
        queue = self.cache.misses.queue
        assert queue is not None
        self.queue: TicketQueue = queue
        self.engine.hold()
        self.futures: list[Future[Any]] = [self.ask(pool, "acme", 0)]
        assert self.engine.entered.wait(WAIT)
        self.futures += [self.ask(pool, "acme", 1), self.ask(pool, "acme", 2)]
        self.futures.append(self.ask(pool, "zeta", 0))
        names = queue.names
        wait_for(
            lambda: [raw.xlen(names.stream(t)) for t in ("acme", "zeta")] == [3, 1],
            "the tickets were not queued",
        )
        # acme's first page was taken while its lane was alone (no deficit then): its lane
        # holds one from a round robin with zeta, as after a turn.
        raw.hset(names.deficits, "acme", "-0.250000")
        time.sleep(0.02)  # the oldest tickets have waited a while

    def ask(self, pool: ThreadPoolExecutor, tenant: str, i: int) -> Future[Any]:
        controls = CacheControls(namespace=tenant)
        return pool.submit(self.cache.get_or_compute, page(tenant, i), None, controls)

    def view(self, raw: redis.Redis) -> inspect.Snapshot:
        return inspect.read(raw, self.queue.names, live_ms=self.queue.live_ms)

    def finish(self) -> None:
        self.engine.release.set()
        assert all(f.result(WAIT).status is CacheStatus.MISS for f in self.futures)


@pytest.fixture()
def busy(base_settings: Settings, raw: redis.Redis) -> Iterator[tuple[Busy, ThreadPoolExecutor]]:
    with ThreadPoolExecutor(8) as pool:
        front = Busy(base_settings, raw, pool)
        try:
            yield front, pool
        finally:
            front.engine.release.set()
    front.finish()


def admin_url(cache: OcrCache, engine: Any, request: pytest.FixtureRequest) -> str:
    """The admin API of a front over HTTP (what ``ocr-cache queue`` calls)."""
    app = Flask(__name__)
    admin.register(app, TOKEN, cache, EngineState(engine, 1.0))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    ).start()
    request.addfinalizer(server.shutdown)
    return f"http://127.0.0.1:{server.server_port}"


def test_the_picture_tells_lanes_engines_and_the_oldest_wait(
    busy: tuple[Busy, ThreadPoolExecutor], raw: redis.Redis
) -> None:
    front, _ = busy
    view = front.view(raw)
    lanes = {lane.tenant: lane for lane in view.lanes}
    assert set(lanes) == {"acme", "zeta"}
    assert (lanes["acme"].waiting, lanes["acme"].running) == (2, 1)
    assert (lanes["zeta"].waiting, lanes["zeta"].running) == (1, 0)
    assert (view.waiting, view.running) == (3, 1)
    # acme's lane has a deficit (planted: its credit less a ticket's cost); zeta's has none
    # until its turn comes.
    assert lanes["acme"].deficit == -0.25 and lanes["zeta"].deficit is None
    assert lanes["acme"].share == 2.0 and lanes["zeta"].share == 1.0
    assert lanes["acme"].in_ring and lanes["zeta"].in_ring
    for lane in lanes.values():
        assert lane.oldest_wait_ms is not None and lane.oldest_wait_ms >= 20
    assert view.oldest_wait_ms == max(lane.oldest_wait_ms for lane in lanes.values())  # type: ignore[type-var]
    # One live engine (the front's one slot), busy with acme's first ticket.
    assert (view.live, view.busy) == (1, 1)
    (engine,) = view.engines
    assert engine.live and engine.running == 1 and engine.last_report_ms is not None
    (held,) = engine.holds
    assert held.lane == "acme" and held.deliveries == 1 and held.idle_ms >= 0
    assert inspect.enqueued_ms(held.id) <= view.at_ms - lanes["acme"].oldest_wait_ms  # type: ignore[operator]
    # Counts only (the gauges' read): nothing listed one by one.
    counts = inspect.read(raw, front.queue.names, live_ms=front.queue.live_ms, held=0)
    assert counts.engines[0].holds == () and counts.engines[0].running == 1


def test_the_admin_endpoint_and_the_command(
    busy: tuple[Busy, ThreadPoolExecutor],
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    front, _ = busy
    base = admin_url(front.cache, front.engine, request)
    assert requests.get(f"{base}/admin/queue", timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer not-the-token"}
    assert requests.get(f"{base}/admin/queue", headers=wrong, timeout=10).status_code == 401
    answer = requests.get(
        f"{base}/admin/queue", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["queue"] == front.queue.names.tag
    assert (body["waiting"], body["running"], body["engines_live"], body["engines_busy"]) == (
        3, 1, 1, 1,
    )  # fmt: skip
    assert body["oldest_wait_ms"] >= 20 and body["live_window_ms"] == front.queue.live_ms
    lanes = {lane["tenant"]: lane for lane in body["lanes"]}
    assert set(lanes["acme"]) == {
        "lane", "tenant", "waiting", "running", "oldest_wait_ms", "deficit_seconds", "share",
        "cost_seconds", "in_ring",
    }  # fmt: skip
    assert (lanes["acme"]["waiting"], lanes["acme"]["running"]) == (2, 1)
    assert isinstance(lanes["acme"]["deficit_seconds"], float)
    (engine,) = body["engines"]
    assert set(engine) == {"consumer", "last_report_ms", "live", "running", "holds"}
    (held,) = engine["holds"]
    assert set(held) == {"id", "lane", "tenant", "idle_ms", "deliveries", "interjected"}
    assert held["tenant"] == "acme" and held["interjected"] is False

    # The command: the token from the environment (or a file), a table or the JSON.
    monkeypatch.setenv("OCR_CACHE_ADMIN_TOKEN", "wrong")
    assert cli.main(["queue", "--server", base]) == 2
    assert "refused the admin token" in capsys.readouterr().err
    monkeypatch.setenv("OCR_CACHE_ADMIN_TOKEN", TOKEN)
    assert cli.main(["queue", "--server", base]) == 0
    out = capsys.readouterr().out
    assert re.search(r"3 waiting, 1 running, oldest wait [\d.]+ m?s; engines 1 live, 1 busy", out)
    assert re.search(r"^acme +2 +1 +[\d.]+ m?s +-?\d+\.\d{3} +2 +– +yes$", out, re.M), out
    assert re.search(r"^zeta +1 +0 +[\d.]+ m?s +– +1 +– +yes$", out, re.M), out
    consumer = re.escape(engine["consumer"])
    row = rf"^{consumer} +[\d.]+ m?s busy +{re.escape(held['id'])} +acme +[\d.]+ m?s +1$"
    assert re.search(row, out, re.M), out
    assert cli.main(["queue", "--server", base, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    counts = [(lane["tenant"], lane["waiting"], lane["running"]) for lane in printed["lanes"]]
    assert counts == [("acme", 2, 1), ("zeta", 1, 0)]
    assert printed["engines"][0]["holds"][0]["id"] == held["id"]


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_the_gauges_carry_the_same_figures(
    busy: tuple[Busy, ThreadPoolExecutor], raw: redis.Redis
) -> None:
    front, _ = busy
    queue, tenants = front.queue, book()
    heartbeat = Heartbeat(
        queue.names, label=tenants.label, labels=tenants.labels,
        live_ms=queue.live_ms,
    )  # fmt: skip
    heartbeat.report_view(raw)
    view = front.view(raw)
    assert sample("ocr_dispatch_queue_running") == 1
    assert sample("ocr_dispatch_engines", state="busy") == 1
    assert sample("ocr_dispatch_engines", state="idle") == 0
    assert sample("ocr_dispatch_tenant_running", tenant="acme") == 1
    assert sample("ocr_dispatch_tenant_running", tenant="zeta") == 0
    assert sample("ocr_dispatch_tenant_running", tenant="default") == 0  # every label, 0 too
    acme = next(lane for lane in view.lanes if lane.tenant == "acme")
    assert sample("ocr_dispatch_tenant_deficit_seconds", tenant="acme") == acme.deficit
    assert sample("ocr_dispatch_tenant_deficit_seconds", tenant="zeta") == 0
    oldest = sample("ocr_dispatch_oldest_wait_seconds")
    assert oldest is not None and oldest >= 0.02
    zeta_wait = sample("ocr_dispatch_tenant_oldest_wait_seconds", tenant="zeta")
    assert zeta_wait is not None and 0.02 <= zeta_wait <= oldest


def loading() -> None:
    """An engine still loading: its feeders keep out of the queue."""
    raise EngineError("loading")


def test_an_empty_queue_reads_as_empty(
    base_settings: Settings, raw: redis.Redis, request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """No queue key at all (nothing queued yet, or all evicted): zeros, no lanes, no
    engines, no oldest wait; the command says so."""
    view = inspect.read(raw, KeySpace("ocr", "nothing").dispatch(), live_ms=3000)
    assert raw.dbsize() == 0  # read, nothing written
    assert (view.waiting, view.running, view.oldest_wait_ms, view.live) == (0, 0, None, 0)
    assert view.lanes == () and view.engines == () and view.ring == ()
    out = io.StringIO()
    cli.print_queue(view.as_json(), out)
    text = out.getvalue()
    assert "0 waiting, 0 running, oldest wait –; engines 0 live, 0 busy" in text
    assert "(no lanes: nothing queued)" in text and "(no engines have reported in)" in text
    # The endpoint of a front whose engine has not reported in yet answers the same.
    engine = Serial()
    cache = make_cache(base_settings, engine, book=book(), gate=loading)
    base = admin_url(cache, engine, request)
    monkeypatch.setenv("OCR_CACHE_ADMIN_TOKEN", TOKEN)
    assert cli.main(["queue", "--server", base, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert (body["waiting"], body["lanes"], body["engines"]) == (0, [], [])
