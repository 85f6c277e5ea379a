"""Tenants (issue 26 §1-2) without the engine: the tenants file (its checks, its reload, keys
compared in constant time), the key a request presents, and the quotas counted in a real
Redis by two front doors at once, as two workers or replicas would."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client import REGISTRY

from app import tenants
from app.cache.breaker import CircuitBreaker
from app.cache.keys import KeySpace
from app.cache.quotas import Quotas
from app.cache.store import NullStore, RedisStore
from app.env import ConfigError, RateLimit
from app.tenants import Tenant, TenantBook, presented_key
from app.vocabulary import QuotaExceeded

pytestmark = pytest.mark.unit


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tenants_file(path: Path, *entries: dict[str, Any]) -> Path:
    path.write_text(json.dumps({"tenants": list(entries)}))
    return path


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# The file ---------------------------------------------------------------------------------


def test_a_file_names_tenants_their_keys_and_limits(tmp_path: Path) -> None:
    path = tenants_file(
        tmp_path / "t.json",
        {"name": "expenses", "key_sha256": digest("k1"), "rate": "20:40", "misses_in_flight": 4,
         "engine_seconds_per_minute": 60, "share": 2},
        {"name": "hr", "key_sha256": [digest("k2"), digest("k3").upper()]},
    )  # fmt: skip
    book = TenantBook(str(path))
    expenses = book.get("expenses")
    assert expenses is not None and expenses.rate == RateLimit(20.0, 40)
    assert (expenses.misses_in_flight, expenses.engine_seconds_per_minute) == (4, 60.0)
    assert book.share("expenses") == 2.0 and book.share("hr") == 1.0 and book.share("x") == 1.0
    hr = book.get("hr")
    assert hr is not None and hr.rate is None and hr.misses_in_flight is None  # unlimited
    # Two keys at once (a rotation), a digest in either case.
    assert [book.identify(k) for k in ("k1", "k2", "k3", "nope")] == [expenses, hr, hr, None]
    assert book.labels() == ["default", "expenses", "hr", "other"]
    assert [book.label(n) for n in ("", "hr", "stranger")] == ["default", "hr", "other"]


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        ([{"name": "a", "key_sha256": "abc"}], "64 hex digits"),
        ([{"name": "a b", "key_sha256": digest("k")}], "tenants.0.name"),
        ([{"name": "default"}], "reserved"),
        ([{"name": "other"}], "reserved"),
        ([{"name": "a"}, {"name": "a"}], "appears twice"),
        ([{"name": "a", "key_sha256": digest("k")}, {"name": "b", "key_sha256": digest("k")}],
         "one key belongs to"),
        ([{"name": "a", "rate": "fast"}], "a.rate"),
        ([{"name": "a", "misses_in_flight": 0}], "misses_in_flight"),
        ([{"name": "a", "share": 0}], "share"),
        ([{"name": "a", "key": "plaintext"}], "tenants.0.key"),  # never the key itself
    ],
)  # fmt: skip
def test_a_bad_file_stops_start_up_saying_what_is_wrong(
    tmp_path: Path, entries: list[dict[str, Any]], says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        TenantBook(str(tenants_file(tmp_path / "t.json", *entries)))


def test_a_changed_file_is_reloaded_and_a_broken_one_is_not_taken(tmp_path: Path) -> None:
    """A key rotated, a tenant added, one revoked: seen after the reload interval, without a
    restart. A file that no longer parses leaves the tenants as they were, counted."""
    path = tenants_file(tmp_path / "t.json", {"name": "a", "key_sha256": digest("old")})
    clock = Clock()
    book = TenantBook(str(path), reload_seconds=5.0, clock=clock)
    assert book.identify("old") is not None
    tenants_file(path, {"name": "a", "key_sha256": [digest("old"), digest("new")]},
                 {"name": "b", "key_sha256": digest("b")})  # fmt: skip
    assert book.identify("new") is None  # not yet looked at again
    clock.now = 5.0
    assert book.identify("new").name == "a" and book.identify("old").name == "a"  # type: ignore[union-attr]
    assert book.identify("b").name == "b"  # type: ignore[union-attr]
    tenants_file(path, {"name": "a", "key_sha256": digest("new")})  # the old key retired
    clock.now = 10.0
    assert book.identify("old") is None and book.identify("b") is None
    errors = REGISTRY.get_sample_value("ocr_api_keys_reloads_total", {"result": "error"}) or 0
    path.write_text("{not json")
    clock.now = 15.0
    assert book.identify("new").name == "a"  # type: ignore[union-attr]
    assert (
        REGISTRY.get_sample_value("ocr_api_keys_reloads_total", {"result": "error"}) == errors + 1
    )


def test_every_digest_is_compared_whichever_key_is_presented(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Constant time: the first tenant's key, the last one's and an unknown key cost the same
    comparisons (every digest, ``hmac.compare_digest``), so timing tells nothing."""
    entries = [
        {"name": f"t{i}", "key_sha256": [digest(f"k{i}"), digest(f"r{i}")]} for i in range(5)
    ]
    book = TenantBook(str(tenants_file(tmp_path / "t.json", *entries)))
    calls: list[int] = []
    real = tenants.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls[-1] += 1
        return real(a, b)

    monkeypatch.setattr(tenants.hmac, "compare_digest", counting)
    for key in ("k0", "r4", "unknown", ""):
        calls.append(0)
        book.identify(key)
    assert calls == [10, 10, 10, 10]


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ({"Authorization": "Bearer s3cret"}, "s3cret"),
        ({"Authorization": "bearer  s3cret "}, "s3cret"),
        ({"authorization": "Bearer s3cret"}, "s3cret"),  # gRPC metadata is lower-case
        ({"X-Api-Key": "s3cret"}, "s3cret"),
        ({"x-api-key": "s3cret"}, "s3cret"),
        ({"Authorization": "Basic dTpw", "X-Api-Key": "s3cret"}, "s3cret"),
        ({"Authorization": "Bearer "}, None),
        ({}, None),
    ],
)
def test_the_key_a_request_presents(headers: dict[str, str], key: str | None) -> None:
    assert presented_key(headers) == key


# Quotas across two front doors ----------------------------------------------------------


@pytest.fixture()
def store(redis_client: redis.Redis, base_settings: Any) -> RedisStore:
    r = base_settings.redis
    return RedisStore(r.url, 200, 200, CircuitBreaker(3, 1.0))


def quotas(store: Any, *limited: Tenant, slot_seconds: float = 60.0) -> Quotas:
    return Quotas(
        store, KeySpace("ocr", "fp"), TenantBook.of(list(limited)),
        failure_limit=RateLimit(1.0, 2), slot_seconds=slot_seconds,
    )  # fmt: skip


def refused(call: Any, *args: Any) -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as caught:
        call(*args)
    assert caught.value.retry_after >= 1
    return caught.value


def test_a_tenants_request_rate_is_one_budget_for_every_worker(store: RedisStore) -> None:
    tenant = Tenant("a", rate=RateLimit(0.5, 2))  # three at once, then one per 2 s
    one, two = quotas(store, tenant), quotas(store, tenant)
    one.admit("a"), two.admit("a"), one.admit("a")
    assert refused(two.admit, "a").reason == "rate"
    one.admit("b"), one.admit("")  # other tenants, and unconfigured ones, are not held back


def test_misses_in_flight_are_counted_across_workers_and_freed(store: RedisStore) -> None:
    tenant = Tenant("a", misses_in_flight=2)
    one, two = quotas(store, tenant), quotas(store, tenant)
    with one.miss("a"), two.miss("a"):
        error = refused(lambda: one.miss("a").__enter__())
        assert error.reason == "misses_in_flight"
        with one.miss("b"):  # another tenant has its own
            pass
    with one.miss("a"), two.miss("a"):  # freed when each ended
        pass


def test_a_killed_workers_slots_expire_with_its_deadline(store: RedisStore) -> None:
    tenant = Tenant("a", misses_in_flight=1)
    held = quotas(store, tenant, slot_seconds=0.3).miss("a")
    held.__enter__()  # never left: its process was killed
    refused(lambda: quotas(store, tenant).miss("a").__enter__())
    time.sleep(0.4)
    with quotas(store, tenant).miss("a"):
        pass


def test_engine_seconds_per_minute_refuse_misses_not_hits(store: RedisStore) -> None:
    tenant = Tenant("a", rate=RateLimit(100.0, 100), engine_seconds_per_minute=60.0)
    one, two = quotas(store, tenant), quotas(store, tenant)
    one.charge("a", 45.0)
    with two.miss("a"):  # 45 of 60 spent: still allowed
        pass
    two.charge("a", 20.0)
    error = refused(lambda: one.miss("a").__enter__())
    assert error.reason == "engine_seconds" and 1 <= error.retry_after <= 6
    one.admit("a")  # the request itself (a hit) meets its rate only, not the miss quotas
    with one.miss("b"):
        pass


def test_refused_keys_from_one_address_are_slowed_down(store: RedisStore) -> None:
    """AUTH_FAILURE_LIMIT 1:2: three refusals at once, then the address is refused first."""
    one, two = quotas(store), quotas(store)
    for _ in range(3):
        one.key_refusals_allowed("10.0.0.1")
        two.key_refused("10.0.0.1")
    assert refused(one.key_refusals_allowed, "10.0.0.1").reason == "auth_failures"
    one.key_refusals_allowed("10.0.0.2")


def test_without_redis_each_process_counts_its_own() -> None:
    local = quotas(NullStore(), Tenant("a", misses_in_flight=1, engine_seconds_per_minute=1.0))
    with local.miss("a"):
        refused(lambda: local.miss("a").__enter__())
    local.charge("a", 5.0)
    assert refused(lambda: local.miss("a").__enter__()).reason == "engine_seconds"
