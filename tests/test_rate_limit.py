"""RATE_LIMIT for gRPC (app/cache/rate_limit.py): one budget per client address counted in a
real Redis across limiters (workers, replicas), nginx's ``limit_req burst=B nodelay``
semantics, keys that expire, fail-open when Redis is down; and two gRPC servers on one Redis
sharing a client's budget. No real engine: the counting double of test_cache_unit.

Rates are chosen so that no outcome depends on how fast this machine runs: a budget that
must not refill during a test refills once a minute (RATE_LIMIT=1/60)."""

from __future__ import annotations

import base64
import time

import grpc
import pytest
import redis

from app import grpc_server, metrics
from app.cache.breaker import CircuitBreaker
from app.cache.keys import KeySpace
from app.cache.rate_limit import RateLimiter
from app.cache.store import NullStore, RedisStore
from app.config import RateLimit, Settings
from app.ports import free_port
from app.protocols.pipeline_stubs import pb2, pb2_grpc
from tests.conftest import WORD_CH, WORD_EN
from tests.helpers import metric_sum
from tests.test_cache_unit import CountingEngine, make_cache

pytestmark = pytest.mark.unit

PER_MINUTE = 1 / 60  # the slowest rate RATE_LIMIT takes: no refill within a test
WAIT = 10.0  # a generous bound for something that happens within a fraction of a second


def _store(url: str, timeout_ms: int = 2000) -> RedisStore:
    """One process's store (its own client and breaker); a timeout no loaded host reaches."""
    return RedisStore(url, timeout_ms, timeout_ms, CircuitBreaker(3, 2.0))


def _limiter(url: str, rate: float, burst: int, prefix: str = "rl") -> RateLimiter:
    return RateLimiter(_store(url), KeySpace(prefix, "fp"), rate, burst, "grpc")


def _metric(name: str, **labels: str) -> float:
    return metric_sum(metrics.render()[0].decode(), name, **labels)


def test_the_key_is_per_client_under_the_base_prefix():
    keys = KeySpace("ocr", "fp")
    assert keys.rate_limit("10.1.2.3") == "ocr:ratelimit:{10.1.2.3}"
    assert keys.rate_limit("::1") == "ocr:ratelimit:{::1}"
    assert keys.rate_limit("") == "ocr:ratelimit:{unknown}"  # a peer that is no address
    assert keys.purge_pattern() == "ocr:v[0-9]*"  # a purge never resets budgets


def test_burst_plus_one_at_once_then_refused_with_retry_after(redis_server, redis_client):
    """nginx's ``limit_req rate=R burst=B nodelay``: B+1 requests at once, then refused."""
    limiter = _limiter(redis_server.url, PER_MINUTE, 2)
    before = _metric("ocr_rate_limited_total", protocol="grpc")
    decisions = [limiter.check("10.0.0.1") for _ in range(5)]
    assert [d.allowed for d in decisions] == [True, True, True, False, False]
    assert all(d.retry_after == 0 for d in decisions[:3])
    # The next one is allowed a minute after the first (1/R), less what has passed.
    assert all(55 <= d.retry_after <= 60 for d in decisions[3:]), decisions
    assert _metric("ocr_rate_limited_total", protocol="grpc") == before + 2
    # Another client has its own budget.
    assert [limiter.check("10.0.0.2").allowed for _ in range(4)] == [True, True, True, False]


def test_no_burst_allows_one_and_retry_after_is_a_whole_minute(redis_server, redis_client):
    limiter = _limiter(redis_server.url, PER_MINUTE, 0)
    first, second = limiter.check("10.0.0.1"), limiter.check("10.0.0.1")
    assert first.allowed and not second.allowed
    assert 59 <= second.retry_after <= 60


def test_two_limiters_share_one_budget(redis_server, redis_client):
    """Two workers (or replicas): their own clients and breakers, one Redis, one budget."""
    one = _limiter(redis_server.url, PER_MINUTE, 3)
    two = _limiter(redis_server.url, PER_MINUTE, 3)
    allowed = [(one if i % 2 else two).check("192.0.2.7").allowed for i in range(8)]
    assert allowed == [True] * 4 + [False] * 4
    assert not one.check("192.0.2.7").allowed and not two.check("192.0.2.7").allowed
    # A limiter with another prefix (another deployment) counts apart.
    assert _limiter(redis_server.url, PER_MINUTE, 3, prefix="other").check("192.0.2.7").allowed


def test_the_budget_refills_at_the_rate(redis_server, redis_client):
    """RATE_LIMIT=10:0: one request per 100 ms; a refused client is allowed again later."""
    limiter = _limiter(redis_server.url, 10, 0)
    began = time.monotonic()
    assert limiter.check("10.0.0.9").allowed
    refused = 0
    deadline = time.monotonic() + WAIT
    while not limiter.check("10.0.0.9").allowed:
        refused += 1
        assert time.monotonic() < deadline, "never allowed again"
        time.sleep(0.01)
    # The first retry came within the interval (at once) and was refused; unless a loaded
    # host held both checks 100 ms apart, when it is rightly allowed.
    assert refused >= 1 or time.monotonic() - began >= 0.1, "allowed within the interval"


def test_keys_expire_once_the_budget_is_full_again(redis_server, redis_client):
    limiter = _limiter(redis_server.url, PER_MINUTE, 2)
    for _ in range(3):
        limiter.check("10.0.0.3")
    key = "rl:ratelimit:{10.0.0.3}"
    # Full again (B+1)/R after the burst: 3 minutes, and no longer.
    assert 170_000 < redis_client.pttl(key) <= 180_001
    fast = _limiter(redis_server.url, 10, 1)  # full again 200 ms after its burst
    assert fast.check("10.0.0.4").allowed and fast.check("10.0.0.4").allowed
    fast_key = "rl:ratelimit:{10.0.0.4}"
    assert 0 < redis_client.pttl(fast_key) <= 201
    deadline = time.monotonic() + WAIT
    while redis_client.exists(fast_key):
        assert time.monotonic() < deadline, "the key never expired"
        time.sleep(0.02)
    # Refused requests write nothing: a refused client's key is not kept alive by them.
    slow = _limiter(redis_server.url, PER_MINUTE, 0)
    slow.check("10.0.0.5")
    ttl = redis_client.pttl("rl:ratelimit:{10.0.0.5}")
    assert not slow.check("10.0.0.5").allowed
    assert redis_client.pttl("rl:ratelimit:{10.0.0.5}") <= ttl


def test_redis_down_allows_and_counts_the_failure():
    """Fail open: a Redis outage costs the limit, never requests; each failure is counted
    (``ocr_redis_errors_total{op="rate_limit"}``, the breaker's skips as circuit_open)."""
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    limiter = RateLimiter(_store(url, timeout_ms=200), KeySpace("rl", "fp"), PER_MINUTE, 0, "grpc")
    errors = _metric("ocr_redis_errors_total", op="rate_limit")
    refused = _metric("ocr_rate_limited_total", protocol="grpc")
    assert all(limiter.check("10.0.0.1").allowed for _ in range(6))
    assert _metric("ocr_redis_errors_total", op="rate_limit") == errors + 6
    assert _metric("ocr_redis_errors_total", op="rate_limit", reason="circuit_open") >= 3
    assert _metric("ocr_rate_limited_total", protocol="grpc") == refused


def test_caching_off_counts_in_the_process():
    """No Redis at all (CACHE_ENABLED=false): the same algorithm, per process."""
    limiter = RateLimiter(NullStore(), KeySpace("rl", "fp"), PER_MINUTE, 1, "grpc")
    assert [limiter.check("10.0.0.1").allowed for _ in range(3)] == [True, True, False]
    assert limiter.check("10.0.0.2").allowed
    refused = limiter.check("10.0.0.1")
    assert 59 <= refused.retry_after <= 60


# gRPC ---------------------------------------------------------------------------------


@pytest.fixture()
def grpc_settings(base_settings: Settings, redis_client: redis.Redis) -> Settings:
    return base_settings.with_overrides(
        host="127.0.0.1", redis_timeout_ms=2000, redis_connect_timeout_ms=2000,
    )  # fmt: skip


def _serve_two(settings: Settings) -> tuple[CountingEngine, list[grpc.Server], list[str]]:
    """Two "workers": their own cache (store, breaker) and gRPC server, one Redis."""
    double = CountingEngine()
    servers, endpoints = [], []
    for _ in range(2):
        server, port = grpc_server.start(make_cache(settings, double), settings, port=0)
        servers.append(server)
        endpoints.append(f"127.0.0.1:{port}")
    return double, servers, endpoints


def test_two_grpc_workers_share_a_client_budget(grpc_settings):
    settings = grpc_settings.with_overrides(rate_limit=RateLimit(PER_MINUTE, 2))
    double, servers, endpoints = _serve_two(settings)
    try:
        stubs = [pb2_grpc.PipelineServiceStub(grpc.insecure_channel(e)) for e in endpoints]
        images = [WORD_EN.read_bytes(), WORD_CH.read_bytes(), WORD_EN.read_bytes()]
        caches = []
        for i, data in enumerate(images):  # miss, miss, hit: each counts, on either worker
            request = pb2.Request(key=["image"], value=[base64.b64encode(data).decode()])
            reply, call = stubs[i % 2].inference.with_call(request, timeout=30)
            assert reply.err_no == 0, reply.err_msg
            caches.append(dict(call.trailing_metadata())["x-cache"])
        assert caches == ["MISS", "MISS", "HIT"]
        calls = double.calls
        request = pb2.Request(key=["image"], value=[base64.b64encode(images[0]).decode()])
        for stub in stubs:  # over the budget on both workers
            with pytest.raises(grpc.RpcError) as refused:
                stub.inference(request, timeout=30)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "rate limit" in refused.value.details()
            retry_after = dict(refused.value.trailing_metadata())["retry-after"]
            assert 55 <= int(retry_after) <= 60
        assert double.calls == calls  # refused before any work
    finally:
        for server in servers:
            server.stop(grace=None)


def test_grpc_without_rate_limit_is_unlimited(grpc_settings, redis_client):
    assert grpc_settings.edge.rate_limit is None
    _, servers, endpoints = _serve_two(grpc_settings)
    try:
        stub = pb2_grpc.PipelineServiceStub(grpc.insecure_channel(endpoints[0]))
        request = pb2.Request(
            key=["image"], value=[base64.b64encode(WORD_EN.read_bytes()).decode()]
        )
        assert all(stub.inference(request, timeout=30).err_no == 0 for _ in range(8))
        assert not redis_client.keys("*ratelimit*")
    finally:
        for server in servers:
            server.stop(grace=None)
