"""L1: the in-process, bytes-bounded LRU in front of Redis."""

from __future__ import annotations

import time

import pytest

from app.cache.l1 import L1Cache, result_size
from app.embedded_redis import EmbeddedRedis
from app.vocabulary import OcrLine, OcrResult
from tests.conftest import PHOTOTEST, SHORT, WORD_CH, WORD_EN
from tests.helpers import b64

pytestmark = pytest.mark.integration


def ocr(client, data):  # type: ignore[no-untyped-def]
    return client.post("/v1/ocr", json={"image": b64(data)})


def mget_calls(redis_client) -> int:
    return int(redis_client.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))


def test_hot_image_costs_no_redis_round_trip(make_app, redis_client):
    client = make_app(cache_l1_bytes=1 << 20).test_client()
    data = PHOTOTEST.read_bytes()
    first = ocr(client, data)
    before = mget_calls(redis_client)
    for _ in range(5):
        again = ocr(client, data)
        assert again.headers["X-Cache"] == "HIT"
        assert again.get_json()["lines"] == first.get_json()["lines"]
    assert mget_calls(redis_client) == before


def test_l1_fills_from_redis_and_serves_while_redis_is_down(make_app, engine):
    data = WORD_EN.read_bytes()
    with EmbeddedRedis() as server:
        writer = make_app(redis_url=server.url).test_client()
        assert ocr(writer, data).headers["X-Cache"] == "MISS"
        reader = make_app(redis_url=server.url, cache_l1_bytes=1 << 20).test_client()
        assert ocr(reader, data).headers["X-Cache"] == "HIT"  # from Redis, now in L1
        server.stop()
        assert ocr(reader, data).headers["X-Cache"] == "HIT"  # from L1


def test_entries_expire_with_their_ttl(make_app):
    client = make_app(cache_l1_bytes=1 << 20, cache_ttl_seconds=1, cache_ttl_jitter=0.0)
    client = client.test_client()
    data = WORD_CH.read_bytes()
    assert ocr(client, data).headers["X-Cache"] == "MISS"
    assert ocr(client, data).headers["X-Cache"] == "HIT"
    time.sleep(1.2)  # gone from L1 and from Redis
    assert ocr(client, data).headers["X-Cache"] == "MISS"


def test_bytes_bound_and_lru_order():
    line = OcrLine("x" * 100, 0.9, ((0, 0), (1, 0), (1, 1), (0, 1)))
    result = OcrResult(1, 1, (line,) * 3)
    size = result_size(result)
    l1 = L1Cache(max_bytes=size * 3, max_age_seconds=60)
    for name in "abc":
        l1.put(("fp", "t", name), result, 60)
    assert l1.get(("fp", "t", "a")) is result  # a is now the most recent
    l1.put(("fp", "t", "d"), result, 60)
    assert l1.get(("fp", "t", "b")) is None  # least recently used went first
    assert all(l1.get(("fp", "t", k)) is result for k in "acd")
    assert l1.size_bytes <= size * 3 and len(l1) == 3
    l1.put(("fp", "t", "huge"), OcrResult(1, 1, (line,) * 1000), 60)  # larger than the bound
    assert l1.get(("fp", "t", "huge")) is None and len(l1) == 3


def test_max_age_bounds_staleness():
    l1 = L1Cache(max_bytes=1 << 20, max_age_seconds=0.05)
    l1.put(("fp", "t", "k"), OcrResult(1, 1), 3600)
    assert l1.get(("fp", "t", "k")) is not None
    time.sleep(0.06)
    assert l1.get(("fp", "t", "k")) is None


def test_zero_bytes_is_off(make_app, redis_client):
    client = make_app(cache_l1_bytes=0).test_client()
    data = SHORT.read_bytes()
    ocr(client, data)
    before = mget_calls(redis_client)
    assert ocr(client, data).headers["X-Cache"] == "HIT"
    assert mget_calls(redis_client) == before + 1
