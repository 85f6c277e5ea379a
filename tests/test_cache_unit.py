"""The cache front door, the tier chain, the miss path and the key space, without the real
engine: a real embedded Redis and a counting engine double whose calls the test holds and
releases with events. Each ``make_cache`` is one process's front door (its own store,
notifier and feeders)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import redis

from app.cache import assembly
from app.cache.breaker import CircuitBreaker
from app.cache.keys import digest_image
from app.cache.region import OcrCache
from app.cache.store import RedisStore
from app.config import Settings
from app.engine_side import feeders
from app.engine_side.connections import BLOCK_MS
from app.engines.base import EngineBase, OcrRequest
from app.imaging import decode_image
from app.queue.ticket import Ticket
from app.tenants import TenantBook
from app.vocabulary import (
    CacheControls,
    CacheStatus,
    EngineError,
    EngineTimeout,
    OcrLine,
    OcrParams,
    OcrResult,
    UnsupportedParams,
)
from tests import fleet
from tests.conftest import PHOTOTEST, SHORT, WORD_CH, WORD_EN
from tests.helpers import stand_in_engine

pytestmark = pytest.mark.unit

IMAGES = [p.read_bytes() for p in (WORD_EN, WORD_CH, SHORT, PHOTOTEST)]
WAIT = 30.0  # generous bound for an event on a loaded host; never reached when it works


class CountingEngine(EngineBase):
    """Answers one line naming the image's SHA-256; counts calls; ``hold`` makes calls
    block until released; ``fail`` makes them raise."""

    kind = "double"
    fingerprint = "doublefingerprt"
    default_params = OcrParams()
    slots = 8

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()
        self.entered = threading.Event()  # set when a call has started
        self.release = threading.Event()
        self.release.set()
        self.fail = 0  # how many of the next calls raise

    def hold(self) -> None:
        self.entered.clear()
        self.release.clear()

    def describe(self) -> dict[str, str]:
        return {"kind": self.kind}

    def check_params(self, params: OcrParams) -> None:
        if params.det_limit_type not in ("max", "min"):
            raise UnsupportedParams("det_limit_type")

    def prepare(self) -> None: ...

    def load(self) -> None: ...

    def recognize(self, request: OcrRequest) -> OcrResult:
        with self._lock:
            self.calls += 1
        self.entered.set()
        assert self.release.wait(WAIT), "the test never released the engine"
        with self._lock:
            failing, self.fail = self.fail > 0, max(0, self.fail - 1)
        if failing:
            raise EngineError("double failed")
        text = hashlib.sha256(request.data).hexdigest()[:8]
        box = ((0, 0), (10, 0), (10, 10), (0, 10))
        return OcrResult(request.image.width, request.image.height, (OcrLine(text, 0.9, box),))


@pytest.fixture()
def settings(base_settings: Settings, redis_client: redis.Redis) -> Settings:
    return base_settings


def only_error_markers(client: redis.Redis) -> bool:
    """Nothing a request reads stays behind a failure (no entry, no ticket marker): only the
    failed ticket's own error marker, expiring within a minute (``ticket.ERROR_TTL_S``)."""
    keys = client.keys("*")
    return all(b":error:" in k and 0 < client.ttl(k) <= 60 for k in keys)


def make_cache(
    settings: Settings,
    double: object,
    gate: Callable[[], None] | None = None,
    book: TenantBook | None = None,
    client: object = None,
    ready: bool = True,
    **overrides: object,
) -> OcrCache:
    """A front door as one process builds it (``app.service.build`` without the engine's
    loader): ``gate`` stands for the engine's loading (``wait_for_engine``); ``book``: the
    tenants (none: the settings' file, if any); ``client``: the store's redis-py client
    (default: one for the settings' URL). Without a ``gate`` and with ``ready``, returned once
    its engine's feeders took their place in the global queue (``dispatch_ready``): a miss
    asked before that is computed here, which on a loaded host made tests about the queue
    race their own feeders' start; ``ready=False`` for a Redis that cannot answer."""
    settings = settings.with_overrides(**overrides)
    r = settings.redis
    store = RedisStore(
        r.url,
        r.timeout_ms,
        r.connect_timeout_ms,
        CircuitBreaker(r.breaker_failures, r.breaker_cooldown_seconds),
        client=client,
    )
    cache = assembly.for_settings(
        settings,
        double,  # type: ignore[arg-type]
        store,
        lambda data: decode_image(data, settings.server.max_image_pixels),
        wait_for_engine=gate or (lambda: None),
        book=book,
    )
    if gate is None and ready:
        assert cache.dispatch_ready(WAIT), "the engine's feeders never reported in"
    return cache


@pytest.fixture()
def double() -> Iterator[CountingEngine]:
    double = CountingEngine()
    yield double
    double.release.set()


def wait_for(check: Callable[[], object], what: str) -> None:
    """``check`` true within ``WAIT``, else fail saying ``what`` and the last value polled."""
    fleet.wait_for(check, WAIT, what)


# The key space -----------------------------------------------------------------------


def test_key_format_and_params_digest_are_those_of_existing_entries(settings, double):
    """Entries written before stay readable: the layout and the digest are pinned."""
    cache = make_cache(settings, double)
    data = IMAGES[0]
    md5 = hashlib.md5(data).hexdigest()
    assert OcrParams().digest() == "62f08dc5d1f8"
    assert OcrParams(return_word_box=True).digest() == "4181c8d50329"
    key = cache.key_for(digest_image(data), OcrParams())
    assert key == f"ocr:v1:doublefingerprt:ocr-62f08dc5d1f8:{{{md5}}}"
    assert cache.key_for(digest_image(data), OcrParams(), "acme").startswith("ocr.acme:v1:")
    keys = cache.keys  # the one owner of every name: the other processes use the same ones
    assert keys.done(key) == f"ocr:done:{key}" and keys.done_pattern() == "ocr:done:*"
    assert keys.purge_channel() == "ocr:purge"
    # A purge reaches the cache's root only (tests/test_purge_scope.py: never quotas, limits
    # or the queue).
    assert keys.purge_pattern("acme") == "ocr.acme:v[0-9]*"
    assert keys.purge_pattern("", md5) == f"ocr:v[0-9]*{{{md5}}}*"
    assert keys.l1(digest_image(data), keys.task(OcrParams()))[-1] == digest_image(data).sha256
    names = keys.dispatch()
    tag = "{ocr:dispatch:v3:doublefingerprt}"
    assert (names.stream("~"), names.stream("acme"), names.engines) == (
        f"{tag}:jobs:~", f"{tag}:jobs:acme", f"{tag}:engines"
    )  # fmt: skip
    assert {
        names.ring, names.deficits, names.shares, names.costs, names.lanes, names.bell,
        names.interject_bell,
    } == {
        f"{tag}:{name}"
        for name in ("ring", "deficits", "shares", "costs", "lanes", "bell", "interject")
    }  # fmt: skip
    # A ticket marker lives in the queue's slot (its hash tag comes first), whatever the entry's.
    sha = digest_image(data).sha256
    assert names.marker(key, sha) == f"{tag}:job:{key}:{sha}"


# The front door ----------------------------------------------------------------------


def unique_image() -> bytes:
    """A PNG no other test sends (random pixels): its entry key, ticket and marker are this
    test's alone. IMAGES[0]'s key is every test's that uses this double (and the files that
    import it): a computation or a waiter another test left behind (a feeder stopped in the
    middle of a call, a request still waiting) can write its entry or marker into the next
    test's flushed Redis, and a miss that finds either counts as COALESCED."""
    import io
    import os

    from PIL import Image

    img = Image.new("RGB", (32, 16), "white")
    noise = os.urandom(24)
    for i in range(0, len(noise), 3):
        img.putpixel((i // 3, 0), tuple(noise[i : i + 3]))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def test_a_miss_is_stored_under_its_key_and_then_hit(settings, double, redis_client):
    data = unique_image()
    cache = make_cache(settings, double)
    first = cache.get_or_compute(data)
    assert first.status is CacheStatus.MISS and double.calls == 1
    assert redis_client.exists(cache.key_for(digest_image(data), OcrParams())) == 1
    again = make_cache(settings, double).get_or_compute(data)  # another process: L2
    assert again.status is CacheStatus.HIT and again.result == first.result
    assert first.tier == "" and again.tier == "l2"
    assert double.calls == 1


def test_an_l2_hit_is_written_back_to_l1(settings, double, redis_client):
    make_cache(settings, double).get_or_compute(IMAGES[0])
    cache = make_cache(settings, double, cache_l1_bytes=1 << 20)
    assert cache.get_or_compute(IMAGES[0]).tier == "l2"
    redis_client.flushdb()
    hit = cache.get_or_compute(IMAGES[0])
    assert hit.status is CacheStatus.HIT and hit.tier == "l1"
    assert double.calls == 1


def test_many_images_keep_request_order(settings, double):
    cache = make_cache(settings, double)
    cache.get_or_compute(IMAGES[1])
    outcomes = cache.get_or_compute_many(IMAGES)
    assert [o.status for o in outcomes] == [
        CacheStatus.MISS, CacheStatus.HIT, CacheStatus.MISS, CacheStatus.MISS
    ]  # fmt: skip
    texts = [o.result.lines[0].text for o in outcomes]
    assert texts == [hashlib.sha256(d).hexdigest()[:8] for d in IMAGES]


def test_controls_bypass_no_cache_no_store(settings, double, redis_client):
    cache = make_cache(settings, double)
    assert cache.get_or_compute(IMAGES[0], None, CacheControls(bypass=True)).status == "BYPASS"
    assert redis_client.dbsize() == 0
    assert cache.get_or_compute(IMAGES[0], None, CacheControls(no_store=True)).status == "MISS"
    assert redis_client.dbsize() == 0
    cache.get_or_compute(IMAGES[0])
    assert cache.get_or_compute(IMAGES[0], None, CacheControls(no_cache=True)).status == "MISS"
    assert double.calls == 4
    assert cache.get_or_compute(IMAGES[0]).status is CacheStatus.HIT


def test_ttl_override_is_written(settings, double, redis_client):
    cache = make_cache(settings, double)
    cache.get_or_compute(IMAGES[0], None, CacheControls(ttl=77))
    key = cache.key_for(digest_image(IMAGES[0]), OcrParams())
    assert 70 <= redis_client.ttl(key) <= 77


def test_tenants_have_their_own_keys_and_purge(settings, double, redis_client):
    cache = make_cache(settings, double)
    for tenant in ("", "acme", "zeta"):
        cache.get_or_compute(IMAGES[0], None, CacheControls(namespace=tenant))
    assert double.calls == 3
    assert cache.purge("acme") >= 1
    prefixes = {k.decode().split(":", 1)[0] for k in redis_client.keys("*")}
    assert prefixes == {"ocr", "ocr.zeta"}
    cache.get_or_compute(IMAGES[1])
    assert cache.purge(md5=hashlib.md5(IMAGES[1]).hexdigest()) == 1
    assert cache.get_or_compute(IMAGES[0]).status is CacheStatus.HIT


def test_unsupported_params_fail_before_the_engine(settings, double, redis_client):
    cache = make_cache(settings, double)
    with pytest.raises(UnsupportedParams):
        cache.get_or_compute(IMAGES[0], OcrParams(det_limit_type="side"))
    assert double.calls == 0 and redis_client.dbsize() == 0


@pytest.fixture()
def quick_recovery(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that failed pauses its feeders 0.2 s between tickets, not 5: what these tests
    check comes after the pause, whatever its length."""
    monkeypatch.setattr(feeders, "UNHEALTHY_PAUSE_SECONDS", 0.2)


def test_errors_are_never_cached(settings, double, redis_client, quick_recovery):
    cache = make_cache(settings, double)
    double.fail = 1
    with pytest.raises(EngineError):
        cache.get_or_compute(IMAGES[0])
    assert only_error_markers(redis_client)  # no entry, and the error is never read again
    assert cache.get_or_compute(IMAGES[0]).status is CacheStatus.MISS
    assert double.calls == 2


def test_redis_down_costs_hits_not_answers(settings, double):
    cache = make_cache(settings, double, redis_url="redis://127.0.0.1:1/0", ready=False)
    assert [cache.get_or_compute(IMAGES[0]).status for _ in range(2)] == ["MISS", "MISS"]
    assert double.calls == 2


def test_cache_disabled_is_a_bypass(settings, double, redis_client):
    cache = make_cache(settings, double, cache_enabled=False)
    assert cache.get_or_compute(IMAGES[0]).status is CacheStatus.BYPASS
    assert redis_client.dbsize() == 0


# The tier chain ----------------------------------------------------------------------


class PixelReader(CountingEngine):
    """An engine that recognizes the decoded pixels (as the in-process Paddle engine)."""

    reads_decoded_pixels = True


def test_the_chain_is_assembled_in_the_documented_order(settings, double):
    names = [tier.name for tier in make_cache(settings, double).chain.tiers]
    assert names == ["extraction", "l1", "l2"]  # a remote engine: no pixel tier
    full = make_cache(settings, PixelReader(), cache_similar=True).chain.tiers
    assert [tier.name for tier in full] == ["extraction", "l1", "l2", "pixel", "similar"]
    off = make_cache(settings, double, cache_enabled=False).chain.tiers
    assert [tier.name for tier in off] == ["l1", "l2"]  # the store holds nothing


def test_a_pixel_hit_is_written_back_to_l1_but_not_l2(settings, redis_client):
    """Other bytes, the same pixels: answered from the first image's entry; L1 keeps it
    under the new bytes (exact), L2 does not (the entry is the other image's)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.open(WORD_EN).save(buf, "BMP")
    double = PixelReader()
    cache = make_cache(settings, double, cache_l1_bytes=1 << 20)
    cache.get_or_compute(IMAGES[0])
    hit = cache.get_or_compute(buf.getvalue())
    assert hit.status is CacheStatus.HIT and hit.tier == "pixel" and double.calls == 1
    assert redis_client.exists(cache.key_for(digest_image(buf.getvalue()), OcrParams())) == 0
    assert cache.get_or_compute(buf.getvalue()).tier == "l1"


# The miss path: one computation per image across threads and processes ---------------


def test_threads_of_one_process_share_one_computation(settings, double):
    cache = make_cache(settings, double)
    double.hold()
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(cache.get_or_compute, IMAGES[0]) for _ in range(6)]
        assert double.entered.wait(WAIT)
        double.release.set()
        statuses = [f.result(WAIT).status for f in futures]
    assert double.calls == 1
    assert statuses.count(CacheStatus.MISS) == 1
    assert set(statuses) <= {CacheStatus.MISS, CacheStatus.COALESCED, CacheStatus.HIT}


def test_a_second_process_joins_the_queued_ticket(settings, double, redis_client):
    """Submitting is idempotent per key: the second process becomes a waiter on the ticket the
    first one queued (its marker names it while it runs, and goes with it)."""
    first, second = make_cache(settings, double), make_cache(settings, double)
    key = first.key_for(digest_image(IMAGES[0]), OcrParams())
    names = first.keys.dispatch()
    stream = names.stream("~")
    marker = names.marker(key, digest_image(IMAGES[0]).sha256)
    double.hold()
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(first.get_or_compute, IMAGES[0])
        assert double.entered.wait(WAIT)
        ticket_id = redis_client.get(marker)
        assert ticket_id is not None and redis_client.xrange(stream, ticket_id, ticket_id)
        second_joined = joined(second)
        b = pool.submit(second.get_or_compute, IMAGES[0])
        assert second_joined.wait(WAIT)
        double.release.set()
        outcomes = [a.result(WAIT), b.result(WAIT)]
    assert double.calls == 1
    assert [o.status for o in outcomes] == [CacheStatus.MISS, CacheStatus.COALESCED]
    assert outcomes[0].result == outcomes[1].result
    wait_for(lambda: not redis_client.exists(marker), "the marker outlived its ticket")


def joined(cache: OcrCache) -> threading.Event:
    """Set once this front door's next submission to the queue has been answered."""
    queue, done = cache._misses._queue, threading.Event()
    submit = queue._submit

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        answer = submit(*args, **kwargs)
        done.set()
        return answer

    queue._submit = recorded
    return done


def failing_ticket_joined(
    pool: ThreadPoolExecutor, first: OcrCache, second: OcrCache, double: CountingEngine
) -> tuple[Future, Future]:
    """A ticket of ``first``'s whose engine calls will fail (held until the caller releases the
    double; the ticket is handed back once, and fails on the other front door's engine too),
    joined by ``second``: both requests' futures."""
    second_joined = joined(second)
    double.hold()
    double.fail = 2
    a = pool.submit(first.get_or_compute, IMAGES[0])
    assert double.entered.wait(WAIT)
    b = pool.submit(second.get_or_compute, IMAGES[0])
    assert second_joined.wait(WAIT)
    return a, b


def test_a_failed_ticket_fails_every_waiter_at_once(settings, double, redis_client, quick_recovery):
    first = make_cache(settings, double, ocr_timeout_seconds=3600.0)
    second = make_cache(settings, double, ocr_timeout_seconds=3600.0)
    with ThreadPoolExecutor(2) as pool:
        futures = failing_ticket_joined(pool, first, second, double)
        double.release.set()
        for future in futures:
            with pytest.raises(EngineError):
                future.result(WAIT)  # not after an hour: the consumer said so
    assert double.calls == 2 and only_error_markers(redis_client)  # its first call, and a retry
    assert first.get_or_compute(IMAGES[0]).status is CacheStatus.MISS


def test_a_failure_announced_late_is_still_the_joiners_error(settings, double, redis_client):
    """A joiner that wakes (its poll) after the failed ticket left the queue and before its copy
    of the announcement arrives (its notifier's own connection) finds the ticket's error
    marker, and does not take the vanished ticket for one to submit again, which would compute
    the failing image a second time."""
    first = make_cache(settings, double, ocr_timeout_seconds=3600.0)
    second = make_cache(settings, double, ocr_timeout_seconds=3600.0)
    notifier = second._misses._queue._notifier  # type: ignore[union-attr]
    wake, gate = notifier._wake, threading.Event()

    def held_back(channel: object, data: object = None) -> None:
        if "error:" in str(data):
            gate.wait(WAIT)  # the announcement is late
        wake(channel, data)  # type: ignore[arg-type]

    notifier._wake = held_back  # type: ignore[method-assign]
    with ThreadPoolExecutor(2) as pool:
        a, b = failing_ticket_joined(pool, first, second, double)
        double.release.set()
        with pytest.raises(EngineError):
            a.result(WAIT)
        stream = first.keys.dispatch().stream("~")
        wait_for(lambda: not redis_client.xlen(stream), "the failed ticket never left the queue")
        for events in list(notifier._waiters.values()):
            for event in events:
                event.set()  # the joiner's poll comes round now
        time.sleep(0.05)
        gate.set()
        with pytest.raises(EngineError):
            b.result(WAIT)
    assert double.calls == 2  # the first call and one retry, never a resubmission's third


@pytest.mark.parametrize("evicted", ["marker", "stream"])
def test_evicted_queue_keys_cost_a_resubmission_not_the_deadline(
    settings, double, redis_client, evicted
):
    """Under allkeys-lru the queue's keys are ordinary keys: a waiter whose ticket's marker (or
    the whole stream) vanished submits again rather than wait for its deadline (an hour)."""
    busy = CountingEngine()
    make_cache(settings, busy)  # another process's engine, which takes the first ticket
    cache = make_cache(settings, double, ocr_timeout_seconds=3600.0)
    cache.close()  # its own engine takes no tickets: the other process's busy one does
    names = cache.keys.dispatch()
    stream = names.stream("~")
    key = cache.key_for(digest_image(IMAGES[0]), OcrParams())
    busy.hold()
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(cache.get_or_compute, IMAGES[0])
        assert busy.entered.wait(WAIT)
        marker = names.marker(key, digest_image(IMAGES[0]).sha256)
        redis_client.delete(marker if evicted == "marker" else stream)
        busy.release.set()
        outcome = asked.result(WAIT)
    assert outcome.status is CacheStatus.MISS
    assert outcome.result.lines[0].text == hashlib.sha256(IMAGES[0]).hexdigest()[:8]


def test_a_joiner_outlives_the_creators_deadline(settings, double, redis_client):
    """A ticket runs on its creator's deadline; a waiter that joined it with more time left is
    not failed by that deadline: it submits again and is answered."""
    first = make_cache(settings, double, ocr_timeout_seconds=1.0)
    second = make_cache(settings, double, ocr_timeout_seconds=3600.0)
    second_joined = joined(second)
    double.hold()
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(first.get_or_compute, IMAGES[0])
        assert double.entered.wait(WAIT)
        b = pool.submit(second.get_or_compute, IMAGES[0])
        assert second_joined.wait(WAIT)
        with pytest.raises(EngineTimeout):
            a.result(WAIT)  # the creator, at its own deadline
        wait_for(lambda: double.calls == 2, "the joiner never submitted again")
        double.release.set()
        outcome = b.result(WAIT)
    assert outcome.result.lines[0].text == hashlib.sha256(IMAGES[0]).hexdigest()[:8]


def test_images_with_one_md5_never_share_a_ticket(settings, redis_client):
    """Two files with one MD5 share an entry key but are two tickets: the second is not made a
    waiter on the first's computation (whose result or error is not its own)."""
    from tests.conftest import CORPUS
    from tests.md5_collisions import colliding_jpegs

    a, b = colliding_jpegs((CORPUS / "mmocr_rec_1036169.jpg").read_bytes(),
                           (CORPUS / "paddleocr_word_ru_1.jpg").read_bytes(), b"unit")  # fmt: skip
    assert digest_image(a).md5 == digest_image(b).md5
    engine = CountingEngine()
    make_cache(settings, engine)  # the engines' process
    first, second = make_cache(settings, engine), make_cache(settings, engine)
    first.close(), second.close()  # requesters only
    engine.hold()
    with ThreadPoolExecutor(2) as pool:
        x = pool.submit(first.get_or_compute, a)
        assert engine.entered.wait(WAIT)
        y = pool.submit(second.get_or_compute, b)
        wait_for(lambda: engine.calls == 2, "the second image joined the first's ticket")
        engine.release.set()
        answers = [f.result(WAIT).result.lines[0].text for f in (x, y)]
    assert answers == [hashlib.sha256(d).hexdigest()[:8] for d in (a, b)]


def test_a_ticket_made_redundant_by_a_stored_entry_is_withdrawn(settings, double, redis_client):
    """The entry appeared between the second look and the submission (another process
    stored it): the ticket just queued is deleted before any engine computes it again."""
    cache = make_cache(settings, double)
    cache.close()  # takes no ticket
    queue = cache._misses._queue
    assert queue is not None
    stand_in_engine(redis_client, queue.names.engines)  # tickets are queued, not computed here
    probe_key = cache.key_for(digest_image(IMAGES[0]), OcrParams())
    ticket = Ticket(probe_key, digest_image(IMAGES[0]).sha256, OcrParams(), "", 60,
              time.time() + 60, IMAGES[0])  # fmt: skip
    stored = OcrResult(1, 1, ())
    result, joined_other = queue.request(ticket, lambda ticket_id: (True, stored, None), 60)
    assert result is stored and joined_other  # another ticket computed it: COALESCED
    assert redis_client.xlen(queue.stream(ticket)) == 0
    assert not redis_client.exists(queue.marker(ticket))


def test_a_feeder_survives_redis_failing_while_it_checks_its_tickets(settings, double):
    """The check of who still waits is a Redis read: when it fails, the feeder computes the
    tickets still in time instead of dying (which would leave its engine out of the queue)."""
    cache = make_cache(settings, double)
    feeders = cache._feeders
    assert feeders is not None
    # A feeder's kind of client (``Connections.open``: the store's, with the service's one
    # immediate retry) for a port nothing listens on: every command fails at once (redis-py's
    # default client would first back off for seconds per command; the service's does not).
    r = settings.redis
    store = RedisStore("redis://127.0.0.1:1/0", r.timeout_ms, 200, CircuitBreaker(3, 30.0))
    dead = store.pubsub_client(BLOCK_MS / 1000 + 5)
    ticket = Ticket("k", "s", OcrParams(), "", 60, time.time() + 60, IMAGES[0], id="1-0")
    late = Ticket("k2", "s", OcrParams(), "", 60, time.time() - 1, IMAGES[1], id="2-0")
    served: list[list[Ticket]] = []

    def serve(tickets: list[Ticket]) -> dict[str, float]:
        served.append(tickets)
        return {}

    feeders.claims.serve(dead, "consumer", [ticket, late], 0.0, serve)
    assert served == [[ticket]]


def test_with_no_live_engine_a_miss_waits_for_one(settings, double, redis_client):
    """The live-engine register is empty (engines scaled to zero, or none reported yet, or
    it was evicted): the miss is queued all the same and waits, and the engine that reports
    in later computes it."""
    cache = make_cache(settings, double)
    cache.close()  # its feeders stop; the register is then evicted
    redis_client.delete(cache.keys.dispatch().engines)
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(cache.get_or_compute, IMAGES[0])
        stream = cache.keys.dispatch().stream("~")
        wait_for(lambda: redis_client.xlen(stream) == 1, "the miss never queued")
        assert not asked.done() and double.calls == 0  # nobody computes it here
        later = CountingEngine()
        make_cache(settings, later)  # an engine starts: its feeder takes the ticket
        assert asked.result(WAIT).status is CacheStatus.MISS
    assert later.calls == 1 and double.calls == 0


def test_calls_made_here_queue_in_the_worker_and_are_refused_when_it_is_full(settings):
    """A miss computed by this process's own engine (``no-store`` here; also Redis down)
    waits in the worker's bounded queue: one runs, ``WEB_THREADS`` wait, more are
    refused at once (``EngineBusy``: 503 + Retry-After)."""
    from app.vocabulary import EngineBusy

    class Serial(CountingEngine):
        slots = 1

    serial = Serial()
    cache = make_cache(settings, serial, web_threads=1)
    no_store = CacheControls(no_store=True)
    serial.hold()
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(cache.get_or_compute, IMAGES[0], None, no_store)
        assert serial.entered.wait(WAIT)
        waiting = pool.submit(cache.get_or_compute, IMAGES[1], None, no_store)
        wait_for(lambda: cache._computer.runner.waiting == 1, "the second call never queued")
        with pytest.raises(EngineBusy) as busy:
            cache.get_or_compute(IMAGES[2], None, no_store)
        assert busy.value.retry_after >= 1
        serial.release.set()
        assert [running.result(WAIT).status, waiting.result(WAIT).status] == ["MISS", "MISS"]
    assert serial.calls == 2


@pytest.mark.parametrize(
    "plant",
    [
        lambda r, key: r.set(key, "0-1"),  # a string without TTL naming no ticket
        lambda r, key: r.rpush(key, "x"),  # another type
        lambda r, key: r.hset(key, "a", "b"),
    ],
    ids=["string-no-ttl", "list", "hash"],
)
def test_a_foreign_ticket_marker_costs_nothing(settings, double, redis_client, plant):
    """A marker key nobody will clear, written by something else: its image is computed at
    once (a new ticket replaces a marker naming no ticket; a marker Redis refuses to read is a
    failed submission, so this process computes), never after OCR_TIMEOUT_SECONDS."""
    cache = make_cache(settings, double, ocr_timeout_seconds=3600.0)
    names = cache.keys.dispatch()
    key = cache.key_for(digest_image(IMAGES[0]), OcrParams())
    plant(redis_client, names.marker(key, digest_image(IMAGES[0]).sha256))
    with ThreadPoolExecutor(1) as pool:
        outcome = pool.submit(cache.get_or_compute, IMAGES[0]).result(WAIT)
    assert outcome.status is CacheStatus.MISS and double.calls == 1


# The request-controls parser ---------------------------------------------------------


def test_controls_parser(settings):
    from app.protocols import controls
    from app.protocols.errors import BadRequest

    tenanted = settings.with_overrides(cache_tenant_header="X-Tenant").controls
    parsed = controls.parse(
        {"Cache-Control": "No-Cache, no-store", "X-Cache-TTL": " 60", "X-Tenant": "acme_1"},
        tenanted,
    )
    assert parsed == CacheControls(no_cache=True, no_store=True, ttl=60, namespace="acme_1")
    untrusted = controls.parse({"cache-control": "no-cache", "x-cache-ttl": "5"}, tenanted,
                               trusted=False)  # fmt: skip
    assert untrusted == CacheControls(trusted=False)  # shared-state controls ignored
    for headers, code in [
        ({"X-Cache-TTL": "0"}, "invalid_ttl"),
        ({"X-Cache-TTL": "²"}, "invalid_ttl"),
        ({"X-Cache-TTL": "1_0"}, "invalid_ttl"),
        ({"X-Tenant": "a/b"}, "invalid_tenant"),
        ({"X-Tenant": "a" * 65}, "invalid_tenant"),
    ]:
        with pytest.raises(BadRequest) as raised:
            controls.parse(headers, tenanted)
        assert raised.value.code == code, headers
    with pytest.raises(BadRequest):
        controls.parse({"X-Tenant": "acme"}, tenanted, trusted=False)
    assert controls.parse({"X-Tenant": "acme"}, settings.controls).namespace == ""


def test_a_cluster_error_outside_redis_error_is_a_failed_call_not_an_exception():
    """redis-py's cluster client raises some errors outside ``RedisError``
    (``SlotNotCoveredError``): the store answers a miss and counts a failure, as for any."""

    class Uncovered:
        def mget(self, keys: list[str]) -> list[bytes | None]:
            raise redis.exceptions.SlotNotCoveredError("no node covers the slot")

        def set(self, *args: object, **kwargs: object) -> bool:
            raise redis.exceptions.SlotNotCoveredError("no node covers the slot")

    breaker = CircuitBreaker(1, 60.0)
    store = RedisStore("redis://unused:1", 100, 100, breaker, client=Uncovered())
    assert store.get_many(["a", "b"]) == (False, [None, None])
    assert not store.set("a", b"x", 10)
    assert breaker.state == "open"
