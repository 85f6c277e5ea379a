"""A purge reaches cache entries and their indexes, never the service's own state.

A real Redis is filled through the real code paths: entries of the default namespace and of
tenants, their pixel and similarity indexes and an error marker; a tenant's request rate
spent, its miss slot held, another's engine time spent; a gRPC client's rate limit and an
address's failed-key budget spent; the miss queue with one ticket running and one waiting in
another tenant's lane. Then every purge form runs (the admin API by namespace, by MD5 and
both, ``{}``; ``ocr-cache purge --all | --namespace | --md5``; ``OcrCache.purge``): each
removes exactly the cache keys in its scope, and afterwards every throttled tenant, client
and address is still refused and both queued misses are answered.

One tenant is named as an image's MD5 (a valid tenant name): its quota keys carry that MD5
as their hash tag, as the image's entries do.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from flask import Flask
from werkzeug.serving import make_server

from app import admin, cli
from app.cache.keys import KeySpace
from app.cache.rate_limit import RateLimiter
from app.cache.region import OcrCache
from app.config import Settings
from app.embedded_redis import EmbeddedRedis
from app.engine_state import EngineState
from app.env import RateLimit
from app.tenants import Tenant, TenantBook
from app.vocabulary import CacheControls, CacheStatus, EngineError, QuotaExceeded
from tests.test_cache_unit import IMAGES, WAIT, CountingEngine, make_cache, wait_for

pytestmark = pytest.mark.unit

TOKEN = "purge-scope-token"
PER_MINUTE = 1 / 60  # no refill within a test
MD5 = hashlib.md5(IMAGES[0]).hexdigest()
TWIN = MD5  # a tenant named as IMAGES[0]'s MD5
CLIENT = "10.0.0.7"  # a gRPC client over its rate limit
PROBER = "10.0.0.9"  # an address over its failed-key budget

# What the cache writes: ``{prefix}:v<schema>:``, the prefix the base one or a tenant's.
CACHE_KEY = re.compile(r"ocr(\.[A-Za-z0-9_-]{1,64})?:v[0-9]+:")
# The service's own state: quotas, rate limits, the miss queue (its hash tag first).
SERVICE_ROOTS = ("ocr:quota:", "ocr:ratelimit:", "{ocr:dispatch:")


class Serial(CountingEngine):
    """One call at a time (one feeder), reading decoded pixels (so the pixel tier is on)."""

    slots = 1
    reads_decoded_pixels = True


class Broken(Serial):
    """Another engine (its own entries and queue), made to fail."""

    fingerprint = "brokenfingerpr"


def book() -> TenantBook:
    return TenantBook.of(
        [
            Tenant("acme", rate=RateLimit(PER_MINUTE, 0), misses_in_flight=1),
            Tenant("zeta"),
            Tenant(TWIN, rate=RateLimit(PER_MINUTE, 0), engine_seconds_per_minute=60.0),
        ]
    )


def refused(call: Callable[..., Any], *args: Any) -> str:
    with pytest.raises(QuotaExceeded) as caught:
        call(*args)
    return caught.value.reason


def names(raw: redis.Redis) -> set[str]:
    return {k.decode() for k in raw.scan_iter(count=1000)}


@pytest.fixture()
def raw(redis_server: EmbeddedRedis, redis_client: redis.Redis) -> Iterator[redis.Redis]:
    """A plain client (``redis_client`` hides the queue's keys), on a flushed database."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture()
def admin_url(request: pytest.FixtureRequest) -> Callable[[OcrCache, Any], str]:
    """The admin API of a front over HTTP (what ``ocr-cache purge`` calls)."""

    def serve(cache: OcrCache, engine: Any) -> str:
        app = Flask(__name__)
        admin.register(app, TOKEN, cache, EngineState(engine, 1.0))
        server = make_server("127.0.0.1", 0, app, threaded=True)
        threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        request.addfinalizer(server.shutdown)
        return f"http://127.0.0.1:{server.server_port}"

    return serve


def test_every_purge_form_reaches_cache_keys_only(
    base_settings: Settings,
    raw: redis.Redis,
    admin_url: Callable[[OcrCache, Any], str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    engine = Serial()
    cache = make_cache(
        base_settings, engine, book=book(), cache_similar=True, dispatch_interject=False,
        auth_failure_limit=RateLimit(PER_MINUTE, 2),
    )  # fmt: skip
    assert cache.dispatch_ready(WAIT)
    quotas, keys = cache.quotas, cache.keys

    # Entries and their indexes, in the default namespace and three tenants'.
    for namespace in ("", "acme", "zeta", TWIN):
        cache.get_or_compute(IMAGES[0], controls=CacheControls(namespace=namespace))
    cache.get_or_compute(IMAGES[1])
    # A failed ticket's marker, from another engine's front (a failure pauses its feeder).
    broken = Broken()
    other = make_cache(base_settings, broken, book=book())
    assert other.dispatch_ready(WAIT)
    broken.fail = 1
    with pytest.raises(EngineError):
        other.get_or_compute(IMAGES[1], controls=CacheControls(namespace="zeta"))
    other.close()

    # Rate limits and quotas, spent.
    quotas.admit("acme")
    quotas.admit(TWIN)
    assert refused(quotas.admit, "acme") == refused(quotas.admit, TWIN) == "rate"
    grpc = RateLimiter(cache.store, keys, PER_MINUTE, 0, "grpc")
    assert grpc.check(CLIENT).allowed and not grpc.check(CLIENT).allowed
    for _ in range(3):
        quotas.key_refused(PROBER)
    assert refused(quotas.key_refusals_allowed, PROBER) == "auth_failures"
    quotas.charge(TWIN, 120.0)  # two minutes of engine time on a minute's budget
    assert refused(lambda: quotas.miss(TWIN).__enter__()) == "engine_seconds"

    # The queue: acme's miss running on the engine (its one slot held), zeta's waiting.
    queue = keys.dispatch()  # no CACHE_ENCRYPTION_KEYS: no writer in its name
    engine.hold()
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(
            cache.get_or_compute, IMAGES[3], controls=CacheControls(namespace="acme")
        )
        assert engine.entered.wait(WAIT)
        waiting = pool.submit(
            cache.get_or_compute, IMAGES[2], controls=CacheControls(namespace="zeta")
        )
        wait_for(lambda: raw.xlen(queue.stream("zeta")) == 1, "zeta's miss never queued")
        assert refused(lambda: quotas.miss("acme").__enter__()) == "misses_in_flight"

        everything = names(raw)
        cached = {k for k in everything if CACHE_KEY.match(k)}
        service = everything - cached
        assert all(k.startswith(SERVICE_ROOTS) for k in service), sorted(service)
        for kind in (":px2:", ":simband:", ":simref", ":error:"):
            assert any(kind in k for k in cached), kind
        assert {
            keys.quota("inflight", "acme"), keys.quota("engine", TWIN),
            keys.rate_limit("tenant:acme"), keys.rate_limit(f"tenant:{TWIN}"),
            keys.rate_limit(CLIENT), keys.rate_limit(f"authfail:{PROBER}"),
            queue.stream("acme"), queue.stream("zeta"), queue.engines, queue.lanes, queue.ring,
        } <= service  # fmt: skip
        assert sum(k.startswith(queue.tag + ":job:") for k in service) == 2  # both markers
        saved = {k: (int(raw.pttl(k)), bytes(raw.dump(k) or b"")) for k in cached}

        def scheduling(key: str) -> bool:
            tickets = (queue.tag + ":jobs:", queue.tag + ":job:")
            return key.startswith(queue.tag) and not key.startswith(tickets)

        base = admin_url(cache, engine)
        monkeypatch.setenv("OCR_CACHE_ADMIN_TOKEN", TOKEN)

        def api(body: dict[str, str]) -> Callable[[], int]:
            def call() -> int:
                answer = cli.Client(base, 30.0).request(
                    "POST", "/admin/purge", json=body,
                    headers={"Authorization": f"Bearer {TOKEN}"},
                )  # fmt: skip
                assert answer.status_code == 200, answer.text
                return int(answer.json()["removed"])

            return call

        def command(*args: str) -> Callable[[], int]:
            def call() -> int:
                capsys.readouterr()
                assert cli.main(["purge", *args, "--server", base]) == 0
                said = capsys.readouterr().out
                return int(re.match(r"removed (\d+) entries", said).group(1))  # type: ignore[union-attr]

            return call

        forms: list[tuple[str, Callable[[], int], str, str | None]] = [
            ("POST /admin/purge {}", api({}), "", None),
            ('{"namespace": ""}', api({"namespace": ""}), "", None),
            ('{"namespace": "acme"}', api({"namespace": "acme"}), "acme", None),
            ("a tenant named as an MD5", api({"namespace": TWIN}), TWIN, None),
            ('{"md5": ...}', api({"md5": MD5}), "", MD5),
            ("namespace and md5", api({"namespace": TWIN, "md5": MD5}), TWIN, MD5),
            ("ocr-cache purge --all", command("--all"), "", None),
            ("--namespace zeta", command("--namespace", "zeta"), "zeta", None),
            ("--md5", command("--md5", MD5.upper()), "", MD5),
            ("--namespace --md5", command("--namespace", "acme", "--md5", MD5), "acme", MD5),
            ("OcrCache.purge()", lambda: cache.purge(), "", None),
            ("OcrCache.purge(ns, md5)", lambda: cache.purge(TWIN, MD5), TWIN, MD5),
        ]
        for form, purge, namespace, md5 in forms:
            for key, (ttl, value) in saved.items():  # every cache key back, as it was
                raw.restore(key, max(ttl, 0), value, replace=True)
            before = names(raw)
            removed = purge()
            # The scheduler's own keys (ring, deficits, bells, register) are rewritten by the
            # feeders as they run, whatever a purge does; the tickets and their markers are
            # compared with the rest.
            gone = {k for k in before - names(raw) if not scheduling(k)}
            scope = {
                k for k in cached
                if k.split(":", 1)[0] == keys.prefix(namespace)
                and (md5 is None or f"{{{md5}}}" in k)
            }  # fmt: skip
            assert scope, form
            assert gone == scope, (form, sorted(gone ^ scope))
            assert removed == len(scope), form
            assert service <= names(raw), (form, sorted(service - names(raw)))

        # Everyone throttled before the purges still is.
        assert refused(quotas.admit, "acme") == refused(quotas.admit, TWIN) == "rate"
        assert not grpc.check(CLIENT).allowed
        assert refused(quotas.key_refusals_allowed, PROBER) == "auth_failures"
        assert refused(lambda: quotas.miss(TWIN).__enter__()) == "engine_seconds"
        assert refused(lambda: quotas.miss("acme").__enter__()) == "misses_in_flight"
        # And the queue kept both misses: the running one and the one waiting in its lane.
        engine.release.set()
        outcomes = [running.result(WAIT), waiting.result(WAIT)]
    assert [o.status for o in outcomes] == [CacheStatus.MISS, CacheStatus.MISS]
    texts = [o.result.lines[0].text for o in outcomes]
    assert texts == [hashlib.sha256(d).hexdigest()[:8] for d in (IMAGES[3], IMAGES[2])]


def test_a_throttled_tenant_stays_throttled_after_a_purge_of_the_default_namespace(
    base_settings: Settings, raw: redis.Redis
) -> None:
    """The user's report: ``{"namespace": ""}`` let a throttled tenant through at once."""
    engine = Serial()
    cache = make_cache(base_settings, engine, book=book())
    cache.get_or_compute(IMAGES[0])
    cache.quotas.admit("acme")
    assert refused(cache.quotas.admit, "acme") == "rate"
    app = Flask(__name__)
    admin.register(app, TOKEN, cache, EngineState(engine, 1.0))
    answer = app.test_client().post(
        "/admin/purge", json={"namespace": ""}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert answer.status_code == 200 and answer.get_json()["removed"] >= 1  # entry, index
    assert refused(cache.quotas.admit, "acme") == "rate"


@pytest.mark.parametrize("prefix", ["ocr", "my:ocr", "o*r", "x?y", "a[b]c", "p\\q"])
def test_no_purge_pattern_matches_service_state_whatever_the_prefix(
    raw: redis.Redis, prefix: str
) -> None:
    """Every pattern a purge can send, against every name of service state: none matches,
    even with glob characters in ``CACHE_KEY_PREFIX`` or a tenant named as an MD5; and each
    still matches the cache keys of its scope."""
    keys, other = KeySpace(prefix, "fp"), KeySpace(prefix + "x", "fp")
    tenants = ("", "acme", TWIN)
    queue = keys.dispatch()
    service = {
        *(keys.quota(kind, t) for kind in ("inflight", "engine") for t in tenants),
        *(keys.rate_limit(c) for c in ("", CLIENT, f"tenant:{TWIN}", f"authfail:{PROBER}")),
        *(queue.stream(lane) for lane in ("~", "acme", TWIN)),
        queue.engines, queue.ring, queue.deficits, queue.shares, queue.costs, queue.lanes,
        queue.bell, queue.interject_bell, queue.marker(f"{prefix}:v1:fp:ocr-x:{{{MD5}}}", "s"),
    }  # fmt: skip
    task = "ocr-62f08dc5d1f8"
    cache = {
        t: {
            f"{keys.prefix(t)}:v1:fp:{task}:{{{MD5}}}",
            keys.ticket_error(f"{keys.prefix(t)}:v1:fp:{task}:{{{MD5}}}", "j1"),
            keys.pixel_bucket("abcd", task, t),
            keys.similar_band(0, "ff", task, t),
        }
        for t in tenants
    }
    elsewhere = {f"{other.prefix()}:v1:fp:{task}:{{{MD5}}}"}  # a longer prefix's deployment
    for name in (*service, *elsewhere, *(k for ks in cache.values() for k in ks)):
        raw.set(name, b"1")
    for namespace in tenants:
        for md5 in (None, MD5):
            pattern = keys.purge_pattern(namespace, md5)
            matched = {k.decode() for k in raw.scan_iter(match=pattern, count=1000)}
            expected = {k for k in cache[namespace] if md5 is None or f"{{{md5}}}" in k}
            assert matched == expected, (pattern, sorted(matched ^ expected))
