"""The cache front door, the cross-process election and the key space, without the real
engine: a real embedded Redis and a counting engine double whose calls the test holds and
releases with events (no sleeps). Part of `make test-fast`."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from app.cache.breaker import CircuitBreaker
from app.cache.keys import digest_image, lease_key
from app.cache.options import CacheOptions
from app.cache.region import OcrCache
from app.cache.store import RedisStore
from app.config import Settings
from app.engines.base import OcrRequest
from app.imaging import decode_image
from app.vocabulary import (
    CacheControls,
    CacheStatus,
    EngineError,
    OcrLine,
    OcrParams,
    OcrResult,
    UnsupportedParams,
)
from tests.conftest import PHOTOTEST, SHORT, WORD_CH, WORD_EN

IMAGES = [p.read_bytes() for p in (WORD_EN, WORD_CH, SHORT, PHOTOTEST)]
WAIT = 30.0  # generous bound for an event on a loaded host; never reached when it works


class CountingEngine:
    """Answers one line naming the image's SHA-256; counts calls; ``hold`` makes calls
    block until released; ``fail`` makes them raise."""

    kind = "double"
    fingerprint = "doublefingerprt"
    default_params = OcrParams()
    max_concurrency = 8

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
    return base_settings.with_overrides(singleflight_lease_ms=2000, singleflight_wait_seconds=20.0)


def make_cache(
    settings: Settings,
    double: CountingEngine,
    gate: Callable[[], None] | None = None,
    **overrides: object,
) -> OcrCache:
    """A front door as one process builds it: its own store, breaker and notifier;
    ``gate`` stands for the engine's loading (``wait_for_engine``)."""
    settings = settings.with_overrides(**overrides)
    store = RedisStore(
        settings.redis_url,
        settings.redis_timeout_ms,
        settings.redis_connect_timeout_ms,
        CircuitBreaker(settings.redis_breaker_failures, settings.redis_breaker_cooldown_seconds),
    )
    return OcrCache(
        CacheOptions.from_settings(settings),
        double,
        store,
        lambda data: decode_image(data, settings.max_image_pixels),
        wait_for_engine=gate or (lambda: None),
    )


@pytest.fixture()
def double() -> Iterator[CountingEngine]:
    double = CountingEngine()
    yield double
    double.release.set()


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
    assert lease_key(key) == key + ":lease"
    keys = cache.keys  # the one owner of every name: the other processes use the same ones
    assert keys.lease(key) == key + ":lease"
    assert keys.done(key) == f"ocr:done:{key}" and keys.done_pattern() == "ocr:done:*"
    assert keys.purge_channel() == "ocr:purge"
    assert keys.purge_pattern("acme") == "ocr.acme:*"
    assert keys.purge_pattern("", md5) == f"ocr:*{{{md5}}}*"
    assert keys.l1(digest_image(data), keys.task(OcrParams()))[-1] == digest_image(data).sha256


def test_a_miss_is_stored_under_its_key_and_then_hit(settings, double, redis_client):
    cache = make_cache(settings, double)
    first = cache.get_or_compute(IMAGES[0])
    assert first.status is CacheStatus.MISS and double.calls == 1
    assert redis_client.exists(cache.key_for(digest_image(IMAGES[0]), OcrParams())) == 1
    again = make_cache(settings, double).get_or_compute(IMAGES[0])  # another process: L2
    assert again.status is CacheStatus.HIT and again.result == first.result
    assert first.tier == "" and again.tier == "l2"
    assert double.calls == 1


def test_l1_answers_without_redis(settings, double, redis_client):
    cache = make_cache(settings, double, cache_l1_bytes=1 << 20)
    cache.get_or_compute(IMAGES[0])
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
    assert cache.purge("acme") == 1
    keys = sorted(k.decode().split(":", 1)[0] for k in redis_client.keys("*"))
    assert keys == ["ocr", "ocr.zeta"]
    cache.get_or_compute(IMAGES[1])
    assert cache.purge(md5=hashlib.md5(IMAGES[1]).hexdigest()) == 1
    assert cache.get_or_compute(IMAGES[0]).status is CacheStatus.HIT


def test_unsupported_params_fail_before_the_engine(settings, double, redis_client):
    cache = make_cache(settings, double)
    with pytest.raises(UnsupportedParams):
        cache.get_or_compute(IMAGES[0], OcrParams(det_limit_type="side"))
    assert double.calls == 0 and redis_client.dbsize() == 0


def test_errors_are_never_cached(settings, double, redis_client):
    cache = make_cache(settings, double)
    double.fail = 1
    with pytest.raises(EngineError):
        cache.get_or_compute(IMAGES[0])
    assert redis_client.dbsize() == 0  # no entry, and the lease was released
    assert cache.get_or_compute(IMAGES[0]).status is CacheStatus.MISS
    assert double.calls == 2


def test_redis_down_costs_hits_not_answers(settings, double):
    cache = make_cache(settings, double, redis_url="redis://127.0.0.1:1/0")
    assert [cache.get_or_compute(IMAGES[0]).status for _ in range(2)] == ["MISS", "MISS"]
    assert double.calls == 2


def test_cache_disabled_is_a_bypass(settings, double, redis_client):
    cache = make_cache(settings, double, cache_enabled=False)
    assert cache.get_or_compute(IMAGES[0]).status is CacheStatus.BYPASS
    assert cache.peek(IMAGES[0], OcrParams()) is None
    assert redis_client.dbsize() == 0


# The election ------------------------------------------------------------------------


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


def test_processes_elect_one_computer_and_the_others_are_notified(settings, double, redis_client):
    owner, waiter = make_cache(settings, double), make_cache(settings, double)
    key = owner.key_for(digest_image(IMAGES[0]), OcrParams())
    double.hold()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(owner.get_or_compute, IMAGES[0])
        assert double.entered.wait(WAIT)
        assert redis_client.pttl(lease_key(key)) > 0  # the owner holds the lease
        second = pool.submit(waiter.get_or_compute, IMAGES[0])
        assert not second.done()  # it waits for the owner rather than computing
        double.release.set()
        assert first.result(WAIT).status is CacheStatus.MISS
        assert second.result(WAIT).status in (CacheStatus.COALESCED, CacheStatus.HIT)
    assert double.calls == 1
    assert redis_client.exists(lease_key(key)) == 0  # released by its owner


def test_a_failed_owner_hands_over_to_a_waiter(settings, double, redis_client):
    owner, waiter = make_cache(settings, double), make_cache(settings, double)
    double.hold()
    double.fail = 1
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(owner.get_or_compute, IMAGES[0])
        assert double.entered.wait(WAIT)
        double.entered.clear()
        second = pool.submit(waiter.get_or_compute, IMAGES[0])
        double.release.set()
        with pytest.raises(EngineError):
            first.result(WAIT)
        # The waiter does not wait out SINGLEFLIGHT_WAIT_SECONDS: released, it takes over.
        assert second.result(WAIT).status in (CacheStatus.MISS, CacheStatus.COALESCED)
    assert double.calls in (1, 2)
    assert owner.get_or_compute(IMAGES[0]).status is CacheStatus.HIT


def test_a_foreign_lease_is_waited_for_then_taken_over(settings, double, redis_client):
    """A lease nobody renews expires: a waiter then computes (bounded by the lease)."""
    cache = make_cache(settings, double, singleflight_lease_ms=300)
    key = cache.key_for(digest_image(IMAGES[0]), OcrParams())
    redis_client.set(lease_key(key), "someone-elses-token", px=300)
    assert cache.get_or_compute(IMAGES[0]).status is CacheStatus.MISS
    assert double.calls == 1 and redis_client.exists(lease_key(key)) == 0


# The request-controls parser ---------------------------------------------------------


def test_controls_parser(settings):
    from app.protocols import controls
    from app.protocols.errors import BadRequest

    tenanted = settings.with_overrides(cache_tenant_header="X-Tenant")
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
    assert controls.parse({"X-Tenant": "acme"}, settings).namespace == ""  # header not set
