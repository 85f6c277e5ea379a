"""The fair miss queue (issue 26 §3) on the real dispatch path: a real Redis, two front doors
as two workers' processes (each with its feeder and a slow counting engine), tenants as key
namespaces. The tickets are queued first by a front door whose own engine takes none (a
stand-in engine keeps the queue open), then two workers start and take them, so the order
the engines compute them in is the queue's choice alone. Interjection
(``DISPATCH_INTERJECT``): engines whose calls pause between steps, tenant a's calls held at
their pauses until the test releases them, so what runs inside them is the queue's choice
alone too."""

from __future__ import annotations

import io
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest
import redis
from PIL import Image

from app.cache.keys import digest_image
from app.cache.region import OcrCache
from app.config import Settings
from app.engine_side import interjection
from app.engines.base import OcrRequest
from app.engines.engine_thread import EngineThread
from app.queue.ticket import Ticket
from app.tenants import Tenant, TenantBook
from app.vocabulary import CacheControls, CacheStatus, OcrParams, OcrResult
from tests.helpers import stand_in_engine
from tests.test_cache_unit import WAIT, CountingEngine, make_cache, wait_for

pytestmark = pytest.mark.unit

CALL_SECONDS = 0.02  # every engine call's own time: equal costs, so shares decide


class TimedEngine(CountingEngine):
    """One call at a time, each ``CALL_SECONDS`` long, recording which image it computed in
    one order shared by every worker, and how many calls ran at once."""

    slots = 1

    def __init__(self, order: list[bytes], running: list[int], lock: threading.Lock) -> None:
        super().__init__()
        self._order, self._running, self._shared = order, running, lock

    def recognize(self, request: OcrRequest) -> OcrResult:
        with self._shared:
            self._order.append(request.data)
            self._running[0] += 1
            self._running[1] = max(self._running[1], self._running[0])
        try:
            time.sleep(CALL_SECONDS)
            return super().recognize(request)
        finally:
            with self._shared:
                self._running[0] -= 1


class SteppedEngine(TimedEngine):
    """An in-process engine's shape (``EngineThread``: one thread, calls interjected at its
    pauses): tenant a's calls pause step after step until ``gate`` opens; the others are
    one step (``seconds``: longer for some images). ``started``: the images whose calls
    began, in order; ``spans``: each call's image, start and end (monotonic)."""

    def __init__(
        self, order: list[bytes], running: list[int], lock: threading.Lock, gate: threading.Event
    ) -> None:
        super().__init__(order, running, lock)
        self._thread = EngineThread("stepped-engine")
        self._gate = gate
        self.started: list[bytes] = []
        self.spans: list[tuple[bytes, float, float]] = []
        self.seconds: dict[bytes, float] = {}
        self.held: set[bytes] = set()  # other tenants' pages held like a's

    can_interject = True

    def interject(self, call: Any) -> Future:
        return self._thread.interject(call)

    def recognize(self, request: OcrRequest) -> OcrResult:
        if self._thread.on_thread():
            return self._steps(request)
        return self._thread.submit(self._steps, request).result()

    def _steps(self, request: OcrRequest) -> OcrResult:
        self.started.append(request.data)
        began = time.monotonic()
        if request.namespace == "a" or request.data in self.held:
            while not self._gate.wait(0.005):
                self._thread.yield_point()
        time.sleep(self.seconds.get(request.data, 0.0))
        try:
            return super().recognize(request)
        finally:
            self.spans.append((request.data, began, time.monotonic()))


class Fleet:
    """A requesting front door (queues, computes nothing) and, once started, two workers;
    ``gate``: their engines are ``SteppedEngine``s held by it (and the front door's
    stand-in is not registered: it would count as an idle engine)."""

    def __init__(
        self, settings: Settings, book: TenantBook, gate: threading.Event | None = None
    ) -> None:
        self.order: list[bytes] = []
        self.running = [0, 0]  # now, most at once
        self._lock = threading.Lock()
        self._settings, self._book, self._gate = settings, book, gate
        self.engines: list[TimedEngine] = []
        self.front = make_cache(settings, self._engine(), book=book)
        self.front.close()  # takes no ticket (and leaves the live-engine register)
        if gate is None:
            self._stand_in()
        self.engines.clear()
        self.workers: list[OcrCache] = []

    def _stand_in(self) -> None:
        """The front door queues its misses until the workers start."""
        client = redis.Redis.from_url(self._settings.redis.url)
        stand_in_engine(client, self.front._misses._queue.names.engines)  # type: ignore[union-attr]
        client.close()

    def _engine(self) -> TimedEngine:
        if self._gate is None:
            engine = TimedEngine(self.order, self.running, self._lock)
        else:
            engine = SteppedEngine(self.order, self.running, self._lock, self._gate)
        self.engines.append(engine)
        return engine

    def started(self) -> list[bytes]:
        return [data for engine in self.engines for data in getattr(engine, "started", [])]

    def start_workers(self, count: int = 2) -> None:
        self.workers = [
            make_cache(self._settings, self._engine(), book=self._book) for _ in range(count)
        ]
        for worker in self.workers:
            assert worker.dispatch_ready(WAIT)

    def waiting(self, client: redis.Redis, lane: str) -> int:
        stream = self.front._misses._queue.names.stream(lane)  # type: ignore[union-attr]
        try:
            return client.xlen(stream) - client.xpending(stream, "engines")["pending"]
        except redis.ResponseError:
            return 0


def page(tenant: str, i: int) -> bytes:
    """A distinct small image per tenant and number."""
    img = Image.new("RGB", (32, 16), "white")
    img.putpixel((i % 32, i // 32 % 16), (ord(tenant[0]), i % 256, 0))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


@pytest.fixture()
def settings(base_settings: Settings, redis_client: redis.Redis) -> Settings:
    """Redis timeouts of a second, not the service's 50 ms: dozens of threads queue at once
    here, and on a busy host (a benchmark beside ``make test-fast``'s two workers) a slow
    answer opened the breaker, so misses were computed without the queue under test. A key
    prefix of its own, so its queue is its own: a feeder another test left in this process
    (one still in its engine call when stopped) never takes these tickets."""
    return base_settings.with_overrides(
        dispatch_queue_max=64, redis_timeout_ms=1000, redis_connect_timeout_ms=1000,
        cache_key_prefix=f"fair{uuid.uuid4().hex[:12]}",
    )  # fmt: skip


def ask(pool: ThreadPoolExecutor, cache: OcrCache, tenant: str, data: bytes) -> Future:
    return pool.submit(cache.get_or_compute, data, None, CacheControls(namespace=tenant))


@pytest.mark.parametrize("fairness", ["drr", "fifo"])
def test_one_new_page_is_not_held_behind_another_tenants_flood(
    settings: Settings, redis_client: redis.Redis, fairness: str
) -> None:
    """Tenant a queued 24 pages, then tenant b one: with deficit round robin b's page is
    among the first two the engines take; in arrival order (fifo) it waits for all of a's."""
    fleet = Fleet(settings.with_overrides(dispatch_fairness=fairness), TenantBook())
    a_lane, b_lane = ("a", "b") if fairness == "drr" else ("~", "~")
    flood = [page("a", i) for i in range(24)]
    with ThreadPoolExecutor(32) as pool:
        answers = [ask(pool, fleet.front, "a", data) for data in flood]
        wait_for(lambda: fleet.waiting(redis_client, a_lane) == 24, "a's flood was not queued")
        single = ask(pool, fleet.front, "b", page("b", 0))
        wait_for(
            lambda: fleet.waiting(redis_client, b_lane) == (1 if fairness == "drr" else 25),
            "b's page was not queued",
        )
        fleet.start_workers()
        outcomes = [future.result(WAIT) for future in [*answers, single]]
    assert all(o.status is CacheStatus.MISS for o in outcomes)
    position = fleet.order.index(page("b", 0))
    if fairness == "drr":
        assert position <= 1, f"b's page was the engines' call {position + 1} of 25"
    else:
        # Taken last; its call starts after a's 24th's on a quiet host, and may start just
        # before it on a loaded one (two engines: the last two taken start in either order).
        # The test tells the two apart: fifo is what the issue measured.
        assert position >= 23, f"b's page was the engines' call {position + 1} of 25"
    assert fleet.running[1] == 2  # both engines were busy throughout


def test_shares_divide_the_engines_time(settings: Settings, redis_client: redis.Redis) -> None:
    """Tenants a (share 3) and b (share 1) both back-filling: while both wait, the engines'
    time goes 3:1 (their lanes' costs known from a warm-up ticket each, evened out)."""
    book = TenantBook.of([Tenant("a", share=3.0), Tenant("b", share=1.0)])
    fleet = Fleet(settings, book)
    fleet.start_workers()
    # The lanes' ticket costs, known from a first ticket each. A call of the default lane goes
    # first: the workers' very first call can cost many times the others on a loaded machine,
    # and a, which paid it, then lost its share (b took all 16 first calls in 3 of 8 runs of
    # test-fast on three workers; none in 5 runs since).
    for tenant in ("", "a", "b"):
        assert fleet.workers[0].get_or_compute(
            page(tenant or "d", 999), None, CacheControls(namespace=tenant)
        ).status in (CacheStatus.MISS, CacheStatus.COALESCED)
    for worker in fleet.workers:
        worker.close()
    fleet.order.clear()
    # The learnt costs evened out: under a loaded `make test` one warm-up call can still cost
    # many times the other (b then had 15 of the first 16 calls once); this test is about the
    # split given the costs (how a lane's cost is learnt: test_scripts' finish).
    costs = fleet.front._misses._queue.names.costs  # type: ignore[union-attr]
    learnt = [float(v) for v in redis_client.hmget(costs, ["a", "b"])]
    redis_client.hset(costs, mapping=dict.fromkeys("ab", f"{sum(learnt) / 2:.6f}"))
    with ThreadPoolExecutor(48) as pool:
        futures = [ask(pool, fleet.front, t, page(t, i)) for i in range(20) for t in "ab"]
        both = lambda: [fleet.waiting(redis_client, lane) for lane in "ab"] == [20, 20]  # noqa: E731
        wait_for(both, "the back-fills were not queued")
        fleet.start_workers()
        for future in futures:
            future.result(WAIT)
    first = fleet.order[:16]
    b_pages = {page("b", i) for i in range(20)}
    from_b = sum(1 for data in first if data in b_pages)
    assert 3 <= from_b <= 5, f"b had {from_b} of the first 16 engine calls (expected 4)"


def test_one_tenant_alone_keeps_every_engine_busy(
    settings: Settings, redis_client: redis.Redis
) -> None:
    """Work-conserving: with nobody else waiting, one tenant's tickets take both engines."""
    fleet = Fleet(settings, TenantBook.of([Tenant("a", share=0.1)]))
    with ThreadPoolExecutor(16) as pool:
        futures = [ask(pool, fleet.front, "a", page("a", i)) for i in range(12)]
        wait_for(lambda: fleet.waiting(redis_client, "a") == 12, "a's tickets were not queued")
        fleet.start_workers()
        for future in futures:
            assert future.result(WAIT).status is CacheStatus.MISS
    assert fleet.running[1] == 2 and len(fleet.order) == 12


def plant(client: redis.Redis, names: Any, lane: str, ticket: Ticket) -> str:
    """A ticket written straight into a lane (as submitting leaves it, ring and lanes too)."""
    try:
        client.xgroup_create(names.stream(lane), "engines", id="0", mkstream=True)
    except redis.ResponseError:  # BUSYGROUP
        pass
    fields = ticket.fields()
    entry = client.xadd(names.stream(lane), dict(zip(fields[::2], fields[1::2], strict=True)))
    client.sadd(names.lanes, lane)
    client.rpush(names.ring, lane)
    return entry.decode()


def a_ticket(cache: OcrCache, tenant: str, n: int) -> Ticket:
    data = page(tenant, n)
    digest = digest_image(data)
    key = cache.keys.entry(digest, cache.keys.task(OcrParams()), tenant)
    return Ticket(key, digest.sha256, OcrParams(), tenant, 60, time.time() + 60, data)


def test_an_undeliverable_lane_does_not_stall_the_others(
    settings: Settings, redis_client: redis.Redis
) -> None:
    """A lane whose entries are neither pending nor deliverable (their consumer was deleted
    holding them) still counts as waiting: the round robin must pass it over, delete those
    entries (their waiters then submit again), and serve the next lane."""
    fleet = Fleet(settings, TenantBook())
    names = fleet.front._misses._queue.names  # type: ignore[union-attr]
    plant(redis_client, names, "x", a_ticket(fleet.front, "x", 0))
    redis_client.xreadgroup("engines", "gone", {names.stream("x"): ">"}, count=1)
    redis_client.xgroup_delconsumer(names.stream("x"), "engines", "gone")
    redis_client.hset(names.deficits, "x", "5.0")  # credit: it would be chosen first
    with ThreadPoolExecutor(1) as pool:
        single = ask(pool, fleet.front, "b", page("b", 0))
        wait_for(lambda: fleet.waiting(redis_client, "b") == 1, "b's page was not queued")
        fleet.start_workers()
        assert single.result(WAIT).status is CacheStatus.MISS
    assert redis_client.xlen(names.stream("x")) == 0


def test_queue_keys_taken_by_the_lru_cost_no_waiting_ticket(
    settings: Settings, redis_client: redis.Redis
) -> None:
    """allkeys-lru may take the ring, the lanes, the deficits, shares and costs: the tickets
    queued meanwhile are still taken (waiters and heartbeats put their lanes back)."""
    fleet = Fleet(settings, TenantBook.of([Tenant("a", share=2.0)]))
    names = fleet.front._misses._queue.names  # type: ignore[union-attr]
    with ThreadPoolExecutor(8) as pool:
        futures = [ask(pool, fleet.front, t, page(t, i)) for i in range(3) for t in "ab"]
        wait_for(lambda: fleet.waiting(redis_client, "b") == 3, "the tickets were not queued")
        redis_client.delete(names.ring, names.lanes, names.deficits, names.shares, names.costs)
        fleet.start_workers()
        assert all(f.result(WAIT).status is CacheStatus.MISS for f in futures)
    assert len(fleet.order) == 6


def test_a_rounding_remainder_never_leaves_the_engines_without_a_lane(
    settings: Settings, redis_client: redis.Redis
) -> None:
    """A deficit the rounds leave at exactly 0 (-0.29 with tickets of 0.01: a batch's charge)
    still gives a lane to serve: the one with the most credit."""
    cache = make_cache(settings, TimedEngine([], [0, 0], threading.Lock()))
    cache.close()
    feeders, names = cache._feeders, cache._misses._queue.names  # type: ignore[union-attr]
    assert feeders is not None
    entry = plant(redis_client, names, "a", a_ticket(cache, "a", 0))
    redis_client.rpush(names.ring, "b")  # an emptied lane still in the ring: the full pass
    redis_client.hset(names.deficits, "a", "-0.290000")
    redis_client.hset(names.costs, "a", "0.010000")
    tickets, cost = feeders.scheduler.take(redis_client, "consumer")
    # Served; and left alone in the ring (b had nothing), so charged nothing.
    assert [ticket.id for ticket in tickets] == [entry] and cost == -1


def test_a_tenant_holds_the_queue_only_while_others_wait_behind_it(
    settings: Settings, redis_client: redis.Redis
) -> None:
    """``ocr_tenant_queue_hold_seconds``: how long one tenant has had at least half of the
    waiting tickets while others waited too; a tenant alone in the queue holds nobody up."""
    from app import metrics

    cache = make_cache(settings, TimedEngine([], [0, 0], threading.Lock()),
                       book=TenantBook.of([Tenant("a"), Tenant("b")]))  # fmt: skip
    cache.close()
    feeders = cache._feeders
    assert feeders is not None

    def held(tenant: str) -> float:
        return metrics.TENANT_QUEUE_HOLD.labels(tenant=tenant)._value.get()

    feeders.heartbeat.report({"a": 9})
    time.sleep(0.05)
    feeders.heartbeat.report({"a": 9})
    assert held("a") == 0.0  # alone
    feeders.heartbeat.report({"a": 9, "b": 1})
    time.sleep(0.05)
    feeders.heartbeat.report({"a": 8, "b": 2, "~": 1})
    assert held("a") >= 0.05 and held("b") == 0.0 and held("default") == 0.0
    feeders.heartbeat.report({"a": 1, "b": 3})
    assert held("a") == 0.0 and held("b") == 0.0  # b's start


# Interjection --------------------------------------------------------------------------


def interjected() -> float:
    from app import metrics

    return metrics.DISPATCH_TICKETS.labels(outcome="interjected")._value.get()  # type: ignore[attr-defined]


def held_fleet(
    settings: Settings, flood: int, engines: int = 2, **overrides: object
) -> tuple[Fleet, Any]:
    """``engines`` stepped engines, each holding one of a's ``flood`` pages at its pauses."""
    gate = threading.Event()
    fleet = Fleet(settings.with_overrides(**overrides), TenantBook(), gate)
    fleet.start_workers(engines)
    pool = ThreadPoolExecutor(16)
    a_pages = [ask(pool, fleet.workers[0], "a", page("a", i)) for i in range(flood)]
    wait_for(lambda: len(fleet.started()) == min(flood, engines), "a's pages did not start")
    return fleet, (gate, pool, a_pages)


def test_a_single_page_is_interjected_while_a_flood_holds_every_engine(
    settings: Settings, redis_client: redis.Redis
) -> None:
    """Both engines computing a's long pages, two more of a's waiting: b's one page is
    computed inside one of a's calls (which then goes on) and answered before either
    ends; a's waiting pages are not (a's lane has pages running); once a's calls end,
    everything is answered, each image computed once."""
    fleet, (gate, pool, a_pages) = held_fleet(settings, 4)
    before = interjected()
    single = ask(pool, fleet.workers[1], "b", page("b", 0))
    assert single.result(WAIT).status is CacheStatus.MISS
    assert not gate.is_set() and not any(f.done() for f in a_pages)
    started = fleet.started()
    assert len(started) == 3 and page("b", 0) in started  # a's two waiting pages did not
    assert interjected() == before + 1
    gate.set()
    assert all(f.result(WAIT).status is CacheStatus.MISS for f in a_pages)
    assert sorted(fleet.order) == sorted([page("a", i) for i in range(4)] + [page("b", 0)])
    pool.shutdown()


# b's first page's time: far above a take's and a serving's own (milliseconds), so a second
# page started at once would start well before the twice-as-long mark the test asserts.
FIRST_SECONDS = 0.5


def test_a_call_is_paused_again_only_once_it_ran_as_long_on_its_own(
    settings: Settings, redis_client: redis.Redis
) -> None:
    """One engine, a's call held at its pauses. b's first page (0.5 s) is interjected; b's
    next two are too (a call may take several), but each only once a's call has run on its
    own at least as long as it was paused for b: the second starts no sooner than twice
    the first's time after the call began. So a paused page keeps at least half its engine
    and always ends."""
    fleet, (gate, pool, a_pages) = held_fleet(settings, 1, engines=1)
    (engine,) = fleet.engines
    assert isinstance(engine, SteppedEngine)
    feeders = fleet.workers[0]._feeders
    assert feeders is not None
    call_began = feeders.calls.running(0).began  # the feeders' clock: a's call, held by the gate
    before = interjected()
    engine.seconds[page("b", 0)] = FIRST_SECONDS
    for i in range(3):
        answer = ask(pool, fleet.workers[0], "b", page("b", i)).result(WAIT)
        assert answer.status is CacheStatus.MISS
    assert not gate.is_set() and not a_pages[0].done()  # all three inside a's one call
    assert interjected() == before + 3
    spans = {data: (start, end) for data, start, end in engine.spans}
    lent = 0.0
    for i in range(3):
        start, end = spans[page("b", i)]
        assert start - call_began >= 2 * lent, (i, start - call_began, lent)
        lent += end - start  # at least what the interjector counts (it adds the serving)
    assert lent >= FIRST_SECONDS
    gate.set()
    assert a_pages[0].result(WAIT).status is CacheStatus.MISS
    pool.shutdown()


def test_a_tenants_page_may_go_inside_its_own_running_call(
    settings: Settings, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines: a's page held on one, b's page held on the other. b's next page waits
    for nobody: it goes inside b's own call (pausing it takes nothing from a), never inside
    a's (b has a page running already). The ring reaches b's engine's interjector whichever
    interjector heard it (a's passes it on): none looks unrung here."""
    monkeypatch.setattr(interjection, "LOOK_SECONDS", 3600.0)
    fleet, (gate, pool, a_pages) = held_fleet(settings, 1)
    stepped = [e for e in fleet.engines if isinstance(e, SteppedEngine)]
    for engine in stepped:
        engine.held.add(page("b", 0))
    before = interjected()
    long_page = ask(pool, fleet.workers[1], "b", page("b", 0))
    wait_for(lambda: len(fleet.started()) == 2, "b's first page did not start")
    (b_engine,) = [e for e in stepped if page("b", 0) in e.started]
    second = ask(pool, fleet.workers[0], "b", page("b", 1)).result(WAIT)
    assert second.status is CacheStatus.MISS
    assert not gate.is_set() and not long_page.done() and not a_pages[0].done()
    assert b_engine.started == [page("b", 0), page("b", 1)]  # inside b's call, not a's
    assert interjected() == before + 1
    gate.set()
    assert long_page.result(WAIT).status is CacheStatus.MISS
    assert a_pages[0].result(WAIT).status is CacheStatus.MISS
    pool.shutdown()


def test_no_interjection_while_an_engine_is_idle(
    settings: Settings, redis_client: redis.Redis
) -> None:
    """One engine holds a's page, the other is free: b's page goes to the free one."""
    fleet, (gate, pool, a_pages) = held_fleet(settings, 1)
    before = interjected()
    assert ask(pool, fleet.workers[0], "b", page("b", 0)).result(WAIT).status is CacheStatus.MISS
    assert interjected() == before
    gate.set()
    assert a_pages[0].result(WAIT).status is CacheStatus.MISS
    pool.shutdown()


def test_interjection_off_leaves_the_single_page_waiting(
    settings: Settings, redis_client: redis.Redis
) -> None:
    """``DISPATCH_INTERJECT=false``: b's page waits for one of a's calls to end."""
    fleet, (gate, pool, a_pages) = held_fleet(settings, 2, dispatch_interject=False)
    single = ask(pool, fleet.workers[1], "b", page("b", 0))
    with pytest.raises(TimeoutError):
        single.result(0.5)
    gate.set()
    assert single.result(WAIT).status is CacheStatus.MISS
    assert all(f.result(WAIT).status is CacheStatus.MISS for f in a_pages)
    pool.shutdown()


def test_interjection_is_decided_by_the_queue_alone(
    settings: Settings, redis_client: redis.Redis
) -> None:
    """``_TAKE`` in interjection mode, on the queue's own keys: nothing while a live engine
    is idle, nor from a lane with a ticket running; else a ticket of the lane with the most
    credit among the others.
    A declined take leaves the ring as it was. A lane whose running tickets are all the call
    to pause (of that lane alone) may pause itself."""
    cache = make_cache(settings, TimedEngine([], [0, 0], threading.Lock()))
    cache.close()
    feeders, names = cache._feeders, cache._misses._queue.names  # type: ignore[union-attr]
    assert feeders is not None
    seconds, micros = redis_client.time()
    now = seconds * 1000 + micros // 1000
    redis_client.zadd(names.engines, {"e1": now, "e2": now})
    plant(redis_client, names, "a", a_ticket(cache, "a", 0))
    plant(redis_client, names, "a", a_ticket(cache, "a", 1))
    redis_client.xreadgroup("engines", "e1", {names.stream("a"): ">"}, count=1)  # e1 busy
    b_entry = plant(redis_client, names, "b", a_ticket(cache, "b", 0))
    redis_client.hset(names.deficits, "a", "0.000001")  # b's turn: it has the most credit
    redis_client.delete(names.ring)
    redis_client.rpush(names.ring, "a", "b")
    ring = redis_client.lrange(names.ring, 0, -1)

    assert feeders.scheduler.take(redis_client, "i", interject=True) == ([], 0.0)  # e2 is idle
    assert redis_client.lrange(names.ring, 0, -1) == ring
    redis_client.xreadgroup("engines", "e2", {names.stream("a"): ">"}, count=1)  # e2 busy
    tickets, _ = feeders.scheduler.take(redis_client, "i", interject=True)
    assert [ticket.id for ticket in tickets] == [b_entry]

    b_next = plant(redis_client, names, "b", a_ticket(cache, "b", 1))  # b has one running now
    assert feeders.scheduler.take(redis_client, "i", interject=True) == ([], 0.0)
    # Into b's own call (all b's running tickets held by the engine to pause, "i"), and only
    # there: not into e2's call (it holds none of b's), nor a call of a's, nor a mixed one.
    for paused in (("b", "e2"), ("a", "i"), ("", "i")):
        assert feeders.scheduler.take(redis_client, "j", True, paused) == ([], 0.0), paused
    tickets, _ = feeders.scheduler.take(redis_client, "j", True, ("b", "i"))
    assert [ticket.id for ticket in tickets] == [b_next]
    plant(redis_client, names, "b", a_ticket(cache, "b", 2))  # b: two running, one elsewhere
    assert feeders.scheduler.take(redis_client, "k", True, ("b", "i")) == ([], 0.0)


def test_a_failed_ticket_frees_its_key_before_its_requesters_hear(
    settings: Settings, redis_client: redis.Redis
) -> None:
    """``fail`` removes the key's marker (if it still names the ticket) before it publishes: a
    retry made on hearing the error queues a new ticket instead of joining the failed one
    (whose entry lives until ``_finish``); a newer ticket's marker is left alone."""
    cache = make_cache(settings, TimedEngine([], [0, 0], threading.Lock()))
    cache.close()
    feeders, queue = cache._feeders, cache._misses._queue  # type: ignore[union-attr]
    assert feeders is not None
    ticket = replace(a_ticket(cache, "b", 0), id="1-0")
    marker = queue.marker(ticket)
    redis_client.set(marker, "1-0")
    feeders.fail(ticket, "error:boom")
    assert redis_client.get(marker) is None
    assert redis_client.get(cache.keys.ticket_error(ticket.key, "1-0")) == b"error:boom"
    redis_client.set(marker, "2-0")  # a newer ticket of the same key
    feeders.fail(ticket, "error:boom")
    assert redis_client.get(marker) == b"2-0"
