"""The global miss queue (``app/queue/``): the unit layer, against a
real embedded Redis with counting engine doubles held and released by events. Each
``make_cache`` is one process's front door (its own store, notifier and feeder threads); the
doubles here take one call at a time, as the in-process Paddle engine does."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest
import redis
from prometheus_client import REGISTRY

from app import tracing
from app.cache import redis_client as redis_clients
from app.cache.keys import QueueKeys, digest_image
from app.config import Settings
from app.embedded_redis import EmbeddedRedis
from app.engine_side import feeders
from app.engines.base import OcrRequest
from app.queue import inspect
from app.queue.ticket import Ticket
from app.vocabulary import (
    CacheControls,
    CacheStatus,
    EngineBusy,
    EngineError,
    EngineTimeout,
    OcrParams,
)
from tests.test_cache_unit import (
    IMAGES,
    WAIT,
    CountingEngine,
    joined,
    make_cache,
    only_error_markers,
    wait_for,
)

pytestmark = pytest.mark.unit


class SerialEngine(CountingEngine):
    """One call at a time (one feeder per front door), like the in-process Paddle engine."""

    slots = 1


class RemoteEngine(CountingEngine):
    """Several calls at once, one feeder per slot, as a remote engine (``OCR_ENGINE=serving``:
    16 slots per worker)."""

    slots = 4


class BatchingEngine(SerialEngine):
    """Also takes a list of images in one call (``ENGINE_BATCH_MAX``), recording its sizes."""

    batching = True

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def recognize_many(self, requests: list[OcrRequest]) -> list:
        self.batches.append(len(requests))
        return [self.recognize(r) for r in requests]


@pytest.fixture()
def settings(base_settings: Settings, redis_client: redis.Redis) -> Settings:
    return base_settings


def text_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:8]


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_free_engine_in_another_process_takes_the_next_miss(settings):
    """Two distinct misses from one process run at once on two processes' engines: the
    requesting process's engine is busy, the other's would otherwise idle."""
    first, second = SerialEngine(), SerialEngine()
    a, b = make_cache(settings, first), make_cache(settings, second)
    first.hold(), second.hold()
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(a.get_or_compute, IMAGES[0])
        wait_for(lambda: first.calls + second.calls == 1, "the first miss never started")
        two = pool.submit(a.get_or_compute, IMAGES[1])
        assert first.entered.wait(WAIT) and second.entered.wait(WAIT)  # both engines busy
        first.release.set(), second.release.set()
        outcomes = [one.result(WAIT), two.result(WAIT)]
    assert (first.calls, second.calls) == (1, 1)
    assert [o.status for o in outcomes] == [CacheStatus.MISS, CacheStatus.MISS]
    assert [o.result.lines[0].text for o in outcomes] == [text_of(d) for d in IMAGES[:2]]
    assert b.get_or_compute(IMAGES[1]).status is CacheStatus.HIT


def test_one_computation_per_distinct_image_over_three_processes(settings, redis_client):
    engines = [SerialEngine() for _ in range(3)]
    caches = [make_cache(settings, e) for e in engines]
    trace = [IMAGES[i % 4] for i in range(24)]
    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(lambda i: caches[i % 3].get_or_compute(trace[i]), range(24)))
    names = caches[0].keys.dispatch()
    stream = names.stream("~")
    wait_for(lambda: redis_client.xlen(stream) == 0, "tickets left in the queue")  # none runs late
    assert sum(e.calls for e in engines) == 4
    assert [o.result.lines[0].text for o in outcomes] == [text_of(d) for d in trace]
    # At least one MISS per image. One more is possible without a computation: a request
    # whose lookup missed just before another's entry was stored queues a ticket that a feeder
    # takes and finds stored (``already_stored``); its requester cannot tell and says MISS.
    statuses = [o.status for o in outcomes]
    assert statuses.count(CacheStatus.MISS) >= 4, statuses
    assert set(statuses) <= {CacheStatus.MISS, CacheStatus.COALESCED, CacheStatus.HIT}


def test_params_and_tenant_travel_with_the_ticket(settings, redis_client):
    """Computed by the other process's engine: stored under the requester's tenant and
    parameters, answering exactly that request."""
    engines = [SerialEngine(), SerialEngine()]
    a, _ = make_cache(settings, engines[0]), make_cache(settings, engines[1])
    params = replace(OcrParams(), det_limit_side_len=1216, return_word_box=True)
    for engine in engines:
        engine.hold()
    with ThreadPoolExecutor(2) as pool:
        blocker = pool.submit(a.get_or_compute, IMAGES[2])
        wait_for(lambda: sum(e.calls for e in engines) == 1, "the first miss never started")
        holder, other = engines if engines[0].calls else engines[::-1]
        other.release.set()  # the other process's engine is free; the holder is busy
        outcome = a.get_or_compute(IMAGES[0], params, CacheControls(namespace="acme"))
        holder.release.set()
        blocker.result(WAIT)
    assert other.calls == 1 and outcome.status is CacheStatus.MISS
    key = a.key_for(digest_image(IMAGES[0]), params, "acme")
    assert key.startswith("ocr.acme:") and redis_client.exists(key) == 1
    assert redis_client.exists(a.key_for(digest_image(IMAGES[0]), OcrParams())) == 0


def test_the_queue_is_bounded_and_its_depth_is_read_from_redis(settings):
    """A full lane refuses (503); the depth KEDA and the gauges read is the queue's own,
    read from Redis (``app/queue/backlog.py`` at each scrape)."""
    engine = SerialEngine()
    cache = make_cache(settings, engine, dispatch_queue_max=1)
    engine.hold()
    before = counter("ocr_engine_queue_dropped_total", reason="full")
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(cache.get_or_compute, IMAGES[0])
        assert engine.entered.wait(WAIT)
        waiting = pool.submit(cache.get_or_compute, IMAGES[1])
        names = cache.keys.dispatch()
        stream = names.stream("~")
        wait_for(lambda: cache.store.run("t", lambda c: c.xlen(stream))[1] == 2, "not queued")
        with pytest.raises(EngineBusy) as busy:
            cache.get_or_compute(IMAGES[2])  # one engine, one waiting ticket: full
        assert busy.value.retry_after >= 1
        picture = cache.store.run("t", lambda c: inspect.read(c, names, live_ms=10_000))[1]
        assert (picture.waiting, picture.running) == (1, 1)
        assert counter("ocr_engine_queue_dropped_total", reason="full") == before + 1
        engine.release.set()
        assert [running.result(WAIT).status, waiting.result(WAIT).status] == ["MISS", "MISS"]
    assert engine.calls == 2  # the refused image was never computed nor cached
    assert cache.get_or_compute(IMAGES[2]).status is CacheStatus.MISS


def test_a_ticket_whose_caller_gave_up_is_not_computed(settings, redis_client):
    engine = SerialEngine()
    cache = make_cache(settings, engine, ocr_timeout_seconds=1.5)
    engine.hold()
    gone = counter("ocr_engine_queue_dropped_total", reason="caller_gone")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(cache.get_or_compute, IMAGES[0])
        assert engine.entered.wait(WAIT)
        with pytest.raises(EngineTimeout):
            cache.get_or_compute(IMAGES[1])  # waits behind the held call, then gives up
        # Deleted from the queue by its requester, or (taken meanwhile) dropped unstarted.
        wait_for(lambda: counter("ocr_engine_queue_dropped_total", reason="caller_gone") > gone,
                 "the abandoned ticket was neither deleted nor dropped")  # fmt: skip
        engine.release.set()
        with pytest.raises(EngineTimeout):
            running.result(WAIT)  # it too waited longer than 1.5 s
    names = cache.keys.dispatch()
    stream = names.stream("~")
    wait_for(lambda: redis_client.xlen(stream) == 0, "the running ticket was never acked")
    assert engine.calls == 1  # the abandoned ticket never reached the engine


def plant(client: Any, names: QueueKeys, ticket: Ticket) -> None:
    """A ticket written straight into the default lane, as a writer to Redis could: its image
    in its key, the lane registered and in the round robin's ring, the idle engines' doorbell
    rung, as submitting does."""
    fields = ticket.fields()
    client.set(names.image(ticket.key, ticket.sha256), ticket.data, px=60_000)
    try:
        client.xgroup_create(names.stream("~"), "engines", id="0", mkstream=True)
    except redis.ResponseError:  # BUSYGROUP: it exists
        pass
    client.xadd(names.stream("~"), dict(zip(fields[::2], fields[1::2], strict=True)))
    client.sadd(names.lanes, "~")
    if client.lpos(names.ring, "~") is None:
        client.lpush(names.ring, "~")
    client.lpush(names.bell, "1")


def test_waiters_check_at_once_when_the_queue_keys_are_lost(settings, redis_client):
    """Every queue key unlinked (as the LRU, or an operator, may) while a miss waits: the
    engine's next report finds its own entry gone from the live register and says so, the
    waiter checks at once, submits again and is answered. Its fallback check (an hour away
    here) plays no part."""
    engine = SerialEngine()
    cache = make_cache(settings, engine, dispatch_check_seconds=3600)
    names = cache.keys.dispatch()
    engine.hold()
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(cache.get_or_compute, IMAGES[0])
        assert engine.entered.wait(WAIT)
        waiting = pool.submit(cache.get_or_compute, IMAGES[1])
        wait_for(lambda: redis_client.xlen(names.stream("~")) == 2, "the second miss never queued")
        lost = list(redis_client.scan_iter(match=f"{names.tag}*", count=1000))
        assert names.engines.encode() in lost and redis_client.unlink(*lost) == len(lost)
        engine.release.set()
        assert running.result(WAIT).status is CacheStatus.MISS
        assert waiting.result(WAIT).status is CacheStatus.MISS
    assert engine.calls == 2


def test_a_superseded_ticket_is_dropped_by_its_consumer(settings, redis_client):
    """Its key's marker names another ticket: its requesters moved on to that one."""
    engine = SerialEngine()
    cache = make_cache(settings, engine)
    names = cache.keys.dispatch()
    wait_for(lambda: redis_client.exists(names.engines), "the feeder never started")
    gone = counter("ocr_dispatch_tickets_total", outcome="caller_gone")
    key = cache.key_for(digest_image(IMAGES[0]), OcrParams())
    orphan = Ticket(key, digest_image(IMAGES[0]).sha256, OcrParams(), "", 60, time.time() + 60,
                 IMAGES[0])  # fmt: skip
    marker = names.marker(key, orphan.sha256)
    redis_client.set(marker, "9999999999999-0", px=60_000)  # the newer ticket
    plant(redis_client, names, orphan)
    wait_for(lambda: redis_client.xlen(names.stream("~")) == 0, "the orphan was never taken")
    assert engine.calls == 0 and redis_client.exists(key) == 0
    redis_client.delete(marker)
    assert counter("ocr_dispatch_tickets_total", outcome="caller_gone") == gone + 1


def test_a_ticket_whose_entry_is_already_stored_is_not_computed(settings, redis_client):
    """Queued in the instant another ticket of the image finished: the engine's side looks in
    L2 first and answers its waiters from the entry."""
    engine = SerialEngine()
    cache = make_cache(settings, engine)
    assert cache.get_or_compute(IMAGES[0]).status is CacheStatus.MISS and engine.calls == 1
    names = cache.keys.dispatch()
    stream = names.stream("~")
    stored = counter("ocr_dispatch_tickets_total", outcome="already_stored")
    key = cache.key_for(digest_image(IMAGES[0]), OcrParams())
    late = Ticket(key, digest_image(IMAGES[0]).sha256, OcrParams(), "", 60, time.time() + 60,
               IMAGES[0])  # fmt: skip
    # The first ticket finished (its waiter is answered before): its finish would remove
    # the image the late one shares, as its marker still names it.
    wait_for(lambda: redis_client.xlen(stream) == 0, "the first ticket was never finished")
    plant(redis_client, names, late)
    wait_for(lambda: redis_client.xlen(stream) == 0, "the late ticket was never taken")
    assert engine.calls == 1
    assert counter("ocr_dispatch_tickets_total", outcome="already_stored") == stored + 1


@pytest.mark.parametrize("forgery", ["other_image", "other_params", "other_tenant"])
def test_a_forged_ticket_is_refused_and_nothing_is_stored(settings, redis_client, forgery):
    """A Redis writer queues a ticket whose key is not what its bytes, params and tenant make
    (e.g. image B's default entry with a translation or other thresholds): the consumer
    refuses it, so no entry a later request would read is ever written."""
    engine = SerialEngine()
    cache = make_cache(settings, engine)
    names = cache.keys.dispatch()
    wait_for(lambda: redis_client.exists(names.engines), "the feeder never started")
    failed = counter("ocr_dispatch_tickets_total", outcome="failed")
    key = cache.key_for(digest_image(IMAGES[0]), OcrParams())
    data, params, tenant = IMAGES[0], OcrParams(), ""
    if forgery == "other_image":
        data = IMAGES[1]
    elif forgery == "other_params":
        params = dataclasses.replace(OcrParams(), det_thresh=0.9)
    else:
        tenant = "acme"
    forged = Ticket(key, digest_image(data).sha256, params, tenant, 60, time.time() + 60, data)
    plant(redis_client, names, forged)
    wait_for(lambda: redis_client.xlen(names.stream("~")) == 0, "the forged ticket was never taken")
    wait_for(lambda: counter("ocr_dispatch_tickets_total", outcome="failed") == failed + 1,
             "the forged ticket was not refused")  # fmt: skip
    assert engine.calls == 0 and redis_client.exists(key) == 0


def test_a_ticket_whose_consumer_died_is_reclaimed(settings, redis_client):
    """A consumer read the ticket and died (it never acks, never touches it): after
    DISPATCH_CLAIM_MS a live feeder claims it, computes it, and the requester is answered."""
    engine = SerialEngine()
    gate = threading.Event()
    cache = make_cache(settings, engine, gate=gate.wait, dispatch_claim_ms=1000)
    names = cache.keys.dispatch()
    stream, engines = names.stream("~"), names.engines
    redis_client.xgroup_create(stream, "engines", id="0", mkstream=True)
    now_ms = int(redis_client.time()[0]) * 1000
    redis_client.zadd(engines, {"dead-consumer": now_ms})  # it was live when the ticket came
    reclaimed = counter("ocr_dispatch_tickets_total", outcome="reclaimed")
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(cache.get_or_compute, IMAGES[0])
        taken = redis_client.xreadgroup("engines", "dead-consumer", {stream: ">"}, count=1,
                                        block=int(WAIT * 1000))  # fmt: skip
        assert taken, "the requester never queued its ticket"
        gate.set()  # this process's engine is ready now: its feeder starts
        outcome = asked.result(WAIT)
    assert outcome.status is CacheStatus.MISS and outcome.result.lines[0].text == text_of(IMAGES[0])
    assert engine.calls == 1
    assert counter("ocr_dispatch_tickets_total", outcome="reclaimed") == reclaimed + 1
    wait_for(lambda: redis_client.xlen(stream) == 0, "the reclaimed ticket was never acked")


def test_a_call_longer_than_the_live_window_stays_its_engines(settings, redis_client):
    """Nothing keeps a running ticket but its engine's process reporting in: a call longer
    than the live window (here 3 s: the claim time's floor) is not reclaimed, though another
    engine idles and the waiter checks on its ticket every 0.2 s; one engine call."""
    first, second = SerialEngine(), SerialEngine()
    asking = make_cache(settings, first, dispatch_claim_ms=300, dispatch_check_seconds=0.2)
    make_cache(settings, second, dispatch_claim_ms=300, dispatch_check_seconds=0.2)
    first.hold()
    second.hold()
    reclaimed = counter("ocr_dispatch_tickets_total", outcome="reclaimed")
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(asking.get_or_compute, IMAGES[0])
        wait_for(lambda: first.entered.is_set() or second.entered.is_set(), "never taken")
        time.sleep(4.5)  # one and a half live windows
        first.release.set()
        second.release.set()
        outcome = asked.result(WAIT)
    assert outcome.status is CacheStatus.MISS
    assert first.calls + second.calls == 1
    assert counter("ocr_dispatch_tickets_total", outcome="reclaimed") == reclaimed


def test_a_ticket_its_live_engine_does_not_know_it_holds_is_reclaimed(
    settings, redis_client, monkeypatch
):
    """A take whose answer a fail-over lost (or a finish that failed) leaves a ticket pending
    under an engine that reports in but does not run it: an orphan. Its own process's sweep
    claims it (nothing else would: its holder is live), and the requester is answered."""
    monkeypatch.setattr(feeders, "LISTEN_MS", 300)  # an idle slot comes round sooner
    engine = SerialEngine()
    gate = threading.Event()
    cache = make_cache(settings, engine, gate=gate.wait, dispatch_claim_ms=300)
    names = cache.keys.dispatch()
    stream = names.stream("~")
    redis_client.xgroup_create(stream, "engines", id="0", mkstream=True)
    consumer = f"{cache._feeders._name}-0"  # type: ignore[union-attr]  # its first slot
    reclaimed = counter("ocr_dispatch_tickets_total", outcome="reclaimed")
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(cache.get_or_compute, IMAGES[0])
        taken = redis_client.xreadgroup("engines", consumer, {stream: ">"}, count=1,
                                        block=int(WAIT * 1000))  # fmt: skip
        assert taken, "the requester never queued its ticket"
        gate.set()  # the engine is ready: its slots report in (its holder is live), and sweep
        outcome = asked.result(WAIT)
    assert outcome.status is CacheStatus.MISS and engine.calls == 1
    assert counter("ocr_dispatch_tickets_total", outcome="reclaimed") == reclaimed + 1


def test_a_ticket_nothing_tells_of_is_reclaimed_by_the_sweep(settings, redis_client, monkeypatch):
    """A ticket still held by a consumer that left the register cleanly (a stopping slot
    whose finish failed): no engine is seen to die, no waiter is left, no ring. The engines'
    sweep (twice the claim time) reclaims it, and the queue drains (the backlog KEDA reads
    returns to 0)."""
    monkeypatch.setattr(feeders, "LISTEN_MS", 300)  # an idle slot comes round sooner
    engine = SerialEngine()
    gate = threading.Event()
    cache = make_cache(
        settings, engine, gate=gate.wait, dispatch_claim_ms=300, ocr_timeout_seconds=1.0
    )
    names = cache.keys.dispatch()
    stream = names.stream("~")
    redis_client.xgroup_create(stream, "engines", id="0", mkstream=True)
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(cache.get_or_compute, IMAGES[0])
        taken = redis_client.xreadgroup("engines", "left", {stream: ">"}, count=1,
                                        block=int(WAIT * 1000))  # fmt: skip
        assert taken, "the requester never queued its ticket"
        with pytest.raises(EngineTimeout):
            asked.result(WAIT)
    redis_client.delete(names.bell)  # its waiter's rings: gone, nothing tells of it now
    assert redis_client.xlen(stream) == 1 and not redis_client.zscore(names.engines, "left")
    reclaimed = counter("ocr_dispatch_tickets_total", outcome="reclaimed")
    gate.set()  # the engine is ready: its feeders start, and its sweep runs
    wait_for(lambda: redis_client.xlen(stream) == 0, "the ticket was never swept")
    assert counter("ocr_dispatch_tickets_total", outcome="reclaimed") == reclaimed + 1
    assert engine.calls == 0  # its caller had gone: dropped, not computed


def test_an_engine_error_reaches_the_requester_at_once_and_is_not_cached(settings, redis_client):
    """The engines' error comes back as an error (not after OCR_TIMEOUT_SECONDS, set to an
    hour here) once the second engine failed the ticket too (the first hands it back, once),
    and nothing a request reads stays in Redis: no entry, no ticket marker (the error marker
    expires on its own)."""
    failing, other = SerialEngine(), SerialEngine()
    a = make_cache(settings, failing, ocr_timeout_seconds=3600.0)
    make_cache(settings, other, ocr_timeout_seconds=3600.0)
    failing.fail = other.fail = 1
    with pytest.raises(EngineError) as raised:
        a.get_or_compute(IMAGES[0])
    assert not isinstance(raised.value, EngineTimeout)
    assert failing.calls == other.calls == 1  # run once more, on the other engine, not again
    assert only_error_markers(redis_client)  # no entry: the next request computes it anew


def test_redis_down_while_waiting_the_requester_computes_itself(base_settings):
    """The queue's Redis stops while the ticket is on another process's busy engine: the
    requester computes it with its own engine, which was still loading until then."""
    with EmbeddedRedis() as server:
        settings = base_settings.with_overrides(redis_url=server.url, redis_timeout_ms=200)
        own, busy = SerialEngine(), SerialEngine()
        loaded = threading.Event()
        a = make_cache(settings, own, gate=loaded.wait)  # no feeder until its engine loads
        make_cache(settings, busy)
        engines = a.keys.dispatch().engines
        probe = redis.Redis.from_url(server.url)
        wait_for(lambda: probe.zcard(engines) == 1, "the other process never reported in")
        busy.hold()
        with ThreadPoolExecutor(1) as pool:
            asked = pool.submit(a.get_or_compute, IMAGES[0])
            assert busy.entered.wait(WAIT)  # the ticket runs on the other process's engine
            server.stop()
            loaded.set()
            outcome = asked.result(WAIT)
            busy.release.set()
    assert outcome.status is CacheStatus.MISS
    assert outcome.result.lines[0].text == text_of(IMAGES[0]) and own.calls == 1


def test_batches_take_up_to_engine_batch_max_waiting_tickets(settings):
    engine = BatchingEngine()
    cache = make_cache(settings, engine, engine_batch_max=4)
    engine.hold()
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(cache.get_or_compute, IMAGES[0])
        assert engine.entered.wait(WAIT)
        rest = [pool.submit(cache.get_or_compute, d) for d in IMAGES[1:]]
        names = cache.keys.dispatch()
        stream = names.stream("~")
        wait_for(lambda: cache.store.run("t", lambda c: c.xlen(stream))[1] == 4, "not queued")
        engine.release.set()
        outcomes = [f.result(WAIT) for f in [first, *rest]]
    assert engine.batches[-1] == 3  # the three waiting tickets went in one call
    assert [o.result.lines[0].text for o in outcomes] == [text_of(d) for d in IMAGES]


def test_a_feeder_opens_one_redis_connection_whatever_it_computes(
    settings, redis_client, monkeypatch
):
    """The soak's ``OCR_ENGINE=serving`` workers (16 feeders each) gained two Redis
    connections per feeder as tickets reached it, one feeder after another: the markers'
    pipeline took a second connection from the feeder's own client, the L2 re-check a read
    connection for the feeder's thread. Each feeder connects once, for all it does
    (docs/RELIABILITY.md, "Soak"). The shared pool is filled beforehand, so that a thread
    borrowing from it never has to connect and every connect counted is a feeder's own."""
    opened: collections.Counter[str] = collections.Counter()
    connect = socket.socket.connect

    def counted(sock: socket.socket, address: object) -> None:
        opened[threading.current_thread().name] += 1
        connect(sock, address)

    r = settings.redis
    shared = redis_clients.connect(r.url, r.timeout_ms / 1000, r.connect_timeout_ms / 1000)
    spare = [shared.connection_pool.get_connection() for _ in range(32)]
    for connection in spare:
        shared.connection_pool.release(connection)
    monkeypatch.setattr(socket.socket, "connect", counted)
    engine = RemoteEngine()
    cache = make_cache(settings, engine, client=shared)
    engines = cache.keys.dispatch().engines
    wait_for(lambda: redis_client.zcard(engines) == 4, "the feeders never reported")
    engine.hold()
    with ThreadPoolExecutor(4) as pool:
        asked = [pool.submit(cache.get_or_compute, data) for data in IMAGES]
        wait_for(lambda: engine.calls == 4, "not every feeder took a ticket")  # each holds one
        engine.release.set()
        outcomes = [f.result(WAIT) for f in asked]
    assert [o.result.lines[0].text for o in outcomes] == [text_of(d) for d in IMAGES]
    feeders = {name: n for name, n in opened.items() if re.fullmatch(r"dispatch-\d+", name)}
    assert feeders == {f"dispatch-{slot}": 1 for slot in range(4)}


def test_front_worker_exit_stops_the_feeders(settings, redis_client):
    """A front worker's exit (``app.front_server.worker_exit``) reaches the real
    ``OcrService``: the worker's feeders leave the consumer group and take no more tickets."""
    from app import front_server
    from app.service import OcrService

    # Feeders of this cache only: one of an earlier test may still be ending its call.
    earlier = {t for t in threading.enumerate() if t.name.startswith("dispatch-")}
    cache = make_cache(settings, SerialEngine())
    names = cache.keys.dispatch()
    wait_for(lambda: redis_client.exists(names.engines), "the feeder never started")

    def feeders() -> list[str]:
        return [t.name for t in threading.enumerate()
                if t.name.startswith("dispatch-") and t not in earlier]  # fmt: skip

    assert feeders()
    service = OcrService(settings, cache, None, {}, OcrParams(), "ocr", 0.5, None)  # type: ignore[arg-type]
    front_server.worker_exit(service)
    assert feeders() == []


def test_fronts_with_other_encryption_keys_never_compute_for_each_other(settings, redis_client):
    """Amid a key rotation a front cannot open entries sealed with a key it lacks: its
    misses go only to engines that seal with its own key (their own queue), never to a
    process whose entry it would wait for in vain."""
    sealed = make_cache(settings, SerialEngine(), cache_encryption_keys=(("a", b"a" * 32),))
    other = make_cache(settings, SerialEngine(), cache_encryption_keys=(("b", b"b" * 32),))
    plain = make_cache(settings, SerialEngine())
    streams = {cache._misses._queue.names.tag for cache in (sealed, other, plain)}
    assert len(streams) == 3
    for cache, data in ((sealed, IMAGES[0]), (other, IMAGES[1]), (plain, IMAGES[2])):
        assert cache.get_or_compute(data).status is CacheStatus.MISS
        assert cache.get_or_compute(data).status is CacheStatus.HIT


def test_a_request_joining_another_fronts_ticket_links_to_its_trace(settings, traced):
    """Two front doors (two processes' worth): the second request for an image finds the
    first's ticket queued and waits on it; its ``queue.wait`` span links to the trace of the
    request that queued it, read from beside the ticket."""
    engine = SerialEngine()
    first, second = make_cache(settings, engine), make_cache(settings, engine)
    second_joined = joined(second)
    engine.hold()

    def traced_get(cache: Any, name: str) -> Any:
        with tracing.TRACER.span(name):
            return cache.get_or_compute(IMAGES[0])

    with ThreadPoolExecutor(2) as pool:
        queued = pool.submit(traced_get, first, "queuer")
        assert engine.entered.wait(WAIT)
        waiting = pool.submit(traced_get, second, "joiner")
        assert second_joined.wait(WAIT)
        engine.release.set()
        outcomes = [queued.result(WAIT), waiting.result(WAIT)]
    assert engine.calls == 1
    assert [o.status for o in outcomes] == [CacheStatus.MISS, CacheStatus.COALESCED]
    spans = traced.get_finished_spans()
    root = {span.name: span.context.trace_id for span in spans if span.parent is None}
    waits = [span for span in spans if span.name == "queue.wait"]
    joiner = [span for span in waits if span.context.trace_id == root["joiner"]]
    assert [link.context.trace_id for span in joiner for link in span.links] == [root["queuer"]]
