"""A lease key nobody will release — written without a TTL, or of another type — is stale
after one lease period: its image waits about that long, not SINGLEFLIGHT_WAIT_SECONDS."""

from __future__ import annotations

import base64
import time

import pytest

from app.cache.keys import digest_image, lease_key
from tests.conftest import WORD_EN

LEASE_MS = 1500


@pytest.mark.parametrize(
    "plant",
    [
        lambda r, key: r.set(key, "someone-elses-token"),  # a string without TTL
        lambda r, key: r.rpush(key, "x"),  # another type
        lambda r, key: r.hset(key, "a", "b"),
    ],
    ids=["string-no-ttl", "list", "hash"],
)
def test_a_lease_without_ttl_is_stale_after_one_period(make_app, redis_client, plant):
    app = make_app(singleflight_lease_ms=LEASE_MS, singleflight_wait_seconds=60.0)
    cache = app.extensions["ocr"]["cache"]
    data = WORD_EN.read_bytes()
    key = lease_key(cache.key_for(digest_image(data), cache.engine.default_params))
    plant(redis_client, key)
    assert redis_client.pttl(key) == -1
    started = time.monotonic()
    resp = app.test_client().post("/v1/ocr", json={"image": base64.b64encode(data).decode()})
    elapsed = time.monotonic() - started
    assert resp.status_code == 200 and resp.headers["X-Cache"] == "MISS"
    # One lease period plus the engine call; the 60 s wait would be far over this.
    assert elapsed < 20, elapsed
    assert elapsed >= LEASE_MS / 1000 * 0.5  # it did respect the foreign lease for a while
