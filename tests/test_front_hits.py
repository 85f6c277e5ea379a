"""The HTTP front answers REST and pipeline L2 hits itself (app/front_hits.py), exactly as a
worker would, and forwards everything else. Against a real `python -m app serve` (two front
processes, one worker, L1 off, encrypted entries, a tenant header, the cache status hidden
from untrusted callers), the real engine and a private Redis. Which side answered is read
from ``ocr_front_hits_total`` around each request (the answers themselves do not say)."""

from __future__ import annotations

import base64
import hashlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import orjson
import pytest
import redis
import requests

from app.cache.codec import Codec
from app.embedded_redis import EmbeddedRedis, free_port
from tests.conftest import PHOTOTEST, SHORT, WORD_CH, WORD_EN
from tests.helpers import b64, metric_sum
from tests.test_serve import _wait_ready, serving

TOKEN = "c" * 24  # CACHE_CONTROL_TOKEN: the tests are trusted only when they send it
ADMIN = "a" * 24
TRUSTED = {"X-Cache-Control-Token": TOKEN}
KEY = base64.b64encode(b"k" * 32).decode()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("front-hits")
    server = EmbeddedRedis().start()
    port = free_port()
    overrides = dict(
        HOST="127.0.0.1", HTTP_PORT=str(port), GRPC_PORT=str(free_port()),
        WEB_CONCURRENCY="1", WEB_THREADS="2", HTTP_FRONT_PROCESSES="2",
        REDIS_URL=server.url, CACHE_KEY_PREFIX="front-hits", CACHE_L1_BYTES="0",
        OCR_WORK_DIR=str(tmp / "models"), PROMETHEUS_MULTIPROC_DIR=str(tmp / "metrics"),
        CACHE_CONTROL_TOKEN=TOKEN, TRUSTED_NETWORKS="10.0.0.0/8",
        CACHE_STATUS_VISIBLE="trusted", CACHE_ENCRYPTION_KEYS=f"k1:{KEY}", ADMIN_TOKEN=ADMIN,
        REDIS_BREAKER_COOLDOWN_SECONDS="2", CACHE_TENANT_HEADER="X-Tenant",
    )  # fmt: skip
    try:
        with serving(overrides, stop_seconds=90) as (proc, base):
            yield {"base": base, "redis": server, "proc": proc}
    finally:
        server.cleanup()


def _front_count(base: str) -> float:
    text = requests.get(f"{base}/metrics", headers=TRUSTED, timeout=10).text
    return metric_sum(text, "ocr_front_hits_total")


def _answered(base: str, send: Callable[[], requests.Response]) -> tuple[requests.Response, bool]:
    """``send()``'s answer, and whether the front answered it (requests here are sequential)."""
    before = _front_count(base)
    resp = send()
    return resp, _front_count(base) > before


def _post(base: str, data: bytes, headers: dict | None = None) -> requests.Response:
    resp = requests.post(f"{base}/v1/ocr", json={"image": b64(data)}, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp


def _by_front(
    base: str, data: bytes, headers: dict | None = None
) -> tuple[requests.Response, bool]:
    return _answered(base, lambda: _post(base, data, headers))


def _engine_calls(base: str) -> float:
    text = requests.get(f"{base}/metrics", headers=TRUSTED, timeout=10).text
    return metric_sum(text, "ocr_engine_calls_total")


def _hit_from_front(base: str, data: bytes, headers: dict | None = None) -> requests.Response:
    """The front learns the workers' spec within a second of their start: retry briefly."""
    for _ in range(20):
        resp, front = _by_front(base, data, headers)
        if front:
            return resp
        time.sleep(0.2)
    raise AssertionError("the front never answered the hit")


def test_a_hit_answered_by_the_front_is_the_workers_answer(service):
    base = service["base"]
    data = PHOTOTEST.read_bytes()
    miss, front = _by_front(base, data, TRUSTED)
    assert miss.headers["X-Cache"] == "MISS" and not front
    hit = _hit_from_front(base, data, TRUSTED)
    # X-Cache-Similar makes the front forward; on an exact hit it changes nothing.
    worker, front = _by_front(base, data, {**TRUSTED, "X-Cache-Similar": "on"})
    assert not front
    assert hit.content == worker.content  # byte for byte: same render, same entry
    assert hit.json()["cache"] == "HIT" and hit.json()["cache_tier"] == "l2"
    for name in ("X-Cache", "X-Cache-Tier", "Content-Type", "Content-Length"):
        assert hit.headers[name] == worker.headers[name], name
    assert "Date" in hit.headers and "Server" not in hit.headers and "Server" not in worker.headers


def test_an_untrusted_caller_cannot_tell_a_front_hit_from_a_miss(service):
    """With CACHE_STATUS_VISIBLE=trusted: no status, and the same header names either way."""
    base = service["base"]
    data, fresh = WORD_EN.read_bytes(), SHORT.read_bytes()
    _post(base, data, TRUSTED)
    hit = _hit_from_front(base, data)
    worker = _post(base, data, {"X-Cache-Similar": "on"})
    assert hit.content == worker.content
    assert "cache" not in hit.json() and "cache_tier" not in hit.json()
    miss, front = _by_front(base, fresh)
    assert not front
    for resp in (hit, worker, miss):
        assert "X-Cache" not in resp.headers and "X-Cache-Tier" not in resp.headers
        assert sorted(resp.headers) == sorted(hit.headers)


def test_the_front_forwards_what_it_does_not_answer(service):
    base = service["base"]
    data = PHOTOTEST.read_bytes()
    _hit_from_front(base, data, TRUSTED)
    body = {"image": b64(data)}
    url = f"{base}/v1/ocr"
    forwarded = [
        lambda: requests.post(url, json={**body, "min_score": 0.9}, timeout=60),
        lambda: requests.post(f"{url}?x=1", json=body, timeout=60),
        lambda: requests.post(url, files={"file": ("p.png", data)}, timeout=60),
        lambda: requests.post(url, json=body, headers={"Cache-Control": "no-store"}, timeout=60),
        lambda: requests.post(url, data=iter([b'{"image": "', b64(data).encode(), b'"}']),
                              timeout=60),
        lambda: requests.post(url, json=body, headers={**TRUSTED, "X-Tenant": "acme"}, timeout=120),
    ]  # fmt: skip
    for send in forwarded:
        resp, front = _answered(base, send)
        assert resp.status_code == 200, resp.text
        assert not front, resp.request.url
    # What a worker refuses, the front does not answer either.
    refused = [
        (lambda: requests.post(url, json=body, headers={**TRUSTED, "X-Cache-TTL": "x"},
                               timeout=60), 400),
        (lambda: requests.post(url, data=orjson.dumps(body), timeout=60,
                               headers={"Content-Type": "multipart/form-data; boundary=b"}), 400),
        (lambda: requests.get(url, timeout=10), 405),
        (lambda: requests.post(url, json=body, timeout=60,
                               headers={f"X-Pad-{i}": "x" for i in range(120)}), 431),
    ]  # fmt: skip
    for send, status in refused:
        resp, front = _answered(base, send)
        assert resp.status_code == status and not front, resp.text
    # A no-cache recomputes for a trusted caller (the worker decides), not for another one.
    before = _engine_calls(base)
    untrusted, front = _answered(base, lambda: _post(base, data, {"Cache-Control": "no-cache"}))
    assert not front and _engine_calls(base) == before
    again = _post(base, data, {**TRUSTED, "Cache-Control": "no-cache"})
    assert again.headers["X-Cache"] == "MISS" and _engine_calls(base) == before + 1


def _pipeline(base: str, images: list[bytes], headers: dict | None = None) -> requests.Response:
    body = {"key": [f"image_{i}" for i in range(len(images))],
            "value": [b64(data) for data in images], "logid": 7}  # fmt: skip
    resp = requests.post(f"{base}/ocr/prediction", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp


def test_pipeline_hits_answered_by_the_front_are_the_workers_answers(service):
    """Paddle Serving's HTTP clients: one image and several, all hits -> the front; the same
    request through the worker (X-Cache-Similar forwards it) renders the same bytes."""
    base = service["base"]
    one, two = PHOTOTEST.read_bytes(), WORD_EN.read_bytes()
    _pipeline(base, [one, two], TRUSTED)
    for images in ([one], [one, two]):
        for _ in range(20):
            hit, front = _answered(base, lambda images=images: _pipeline(base, images, TRUSTED))
            if front:
                break
            time.sleep(0.2)
        worker, by_front = _answered(
            base,
            lambda images=images: _pipeline(base, images, {**TRUSTED, "X-Cache-Similar": "on"}),
        )
        assert front and not by_front
        assert hit.json()["err_no"] == 0 and len(hit.json()["value"]) == len(images)
        assert hit.content == worker.content
        for name in ("X-Cache", "X-Cache-Tier", "Content-Type"):
            assert hit.headers[name] == worker.headers[name], name
    untrusted, front = _answered(base, lambda: _pipeline(base, [one]))
    assert front and "X-Cache" not in untrusted.headers


def test_pipeline_requests_the_front_does_not_answer(service):
    base = service["base"]
    # (Not a copy of another test's image with a byte appended: that would be a pixel-tier
    # hit of this one's entry for the other, which only a worker answers.)
    cached, cold = PHOTOTEST.read_bytes(), WORD_CH.read_bytes()
    _pipeline(base, [cached], TRUSTED)
    assert _answered(base, lambda: _pipeline(base, [cached], TRUSTED))[1]
    mixed, front = _answered(base, lambda: _pipeline(base, [cached, cold], TRUSTED))
    assert not front and mixed.json()["err_no"] == 0  # one miss: the worker answers all
    one = {"key": ["image"], "value": [b64(cached)]}
    cases = [
        lambda: requests.post(f"{base}/ocr/prediction", headers=TRUSTED, timeout=120, json={
            "key": ["image", "pipeline.profile"], "value": [b64(cached), "1"]}),
        lambda: requests.post(f"{base}/other/prediction", json=one, timeout=60),
        lambda: requests.post(f"{base}/ocr/predic%2Ftion", json=one, timeout=60),
        lambda: requests.post(f"{base}/ocr/prediction", data=b"{not json", timeout=60),
        lambda: requests.post(f"{base}/ocr/prediction", json={"key": ["image"], "value": ["@@"]},
                              timeout=60),
    ]  # fmt: skip
    for send in cases:
        resp, front = _answered(base, send)
        assert not front, resp.text
    profiled = cases[0]()
    assert "pipeline.profile" in profiled.json()["key"]


def test_the_front_counts_its_hits_in_the_service_metrics(service):
    base = service["base"]
    data = WORD_EN.read_bytes()
    _post(base, data, TRUSTED)
    _hit_from_front(base, data, TRUSTED)
    text = requests.get(f"{base}/metrics", headers=TRUSTED, timeout=10).text
    before = metric_sum(text, "ocr_cache_tier_hits_total", tier="l2")
    requests_before = metric_sum(text, "ocr_requests_total", protocol="rest", status="200")
    front_before = metric_sum(text, "ocr_front_hits_total", protocol="rest")
    for _ in range(5):
        _post(base, data, TRUSTED)
    text = requests.get(f"{base}/metrics", headers=TRUSTED, timeout=10).text
    assert metric_sum(text, "ocr_front_hits_total", protocol="rest") == front_before + 5
    assert metric_sum(text, "ocr_cache_tier_hits_total", tier="l2") == before + 5
    assert metric_sum(text, "ocr_requests_total", protocol="rest", status="200") == (
        requests_before + 5
    )
    # The front imports the metrics module, gauges included: its copies must not count.
    assert metric_sum(text, "ocr_engine_ready") == 1
    assert metric_sum(text, "ocr_redis_breaker_open") == 0


def test_the_front_never_serves_one_images_entry_for_another(service):
    """Under image B's key: (a) image A's stored value (sealed for A's key: decryption fails),
    (b) A's result sealed for B's key with the right key (decrypts; its SHA-256 is A's). The
    front refuses both, as the worker does; B is computed."""
    base, client = service["base"], redis.Redis.from_url(service["redis"].url)
    a, b = WORD_EN.read_bytes(), WORD_CH.read_bytes()
    _post(base, a, TRUSTED)
    expected_b = _post(base, b, TRUSTED).json()["lines"]
    (key_a,) = client.keys(f"front-hits:*{{{hashlib.md5(a).hexdigest()}}}")
    (key_b,) = client.keys(f"front-hits:*{{{hashlib.md5(b).hexdigest()}}}")
    codec = Codec(0, (("k1", base64.b64decode(KEY)),))
    fingerprint = key_a.decode().split(":")[2]
    entry = codec.decode(client.get(key_a), hashlib.sha256(a).hexdigest(), fingerprint,
                         key_a.decode())  # fmt: skip
    assert entry is not None
    forged = codec.encode(entry.result, hashlib.sha256(a).hexdigest(), fingerprint, 3600,
                          key_b.decode())  # fmt: skip
    for value in (client.get(key_a), forged):
        client.set(key_b, value)
        before = _engine_calls(base)
        resp, front = _by_front(base, b, TRUSTED)
        assert not front and resp.headers["X-Cache"] == "MISS"
        assert resp.json()["lines"] == expected_b and _engine_calls(base) == before + 1


def test_a_purged_entry_is_not_answered_by_the_front(service):
    base = service["base"]
    data = PHOTOTEST.read_bytes()
    _hit_from_front(base, data, TRUSTED)
    purge = requests.post(
        f"{base}/admin/purge", json={"md5": hashlib.md5(data).hexdigest()},
        headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30,
    )  # fmt: skip
    assert purge.status_code == 200 and purge.json()["removed"] >= 1
    resp, front = _by_front(base, data, TRUSTED)
    assert resp.headers["X-Cache"] == "MISS" and not front


def test_a_worker_that_exits_leaves_the_fronts_and_redis_running(service):
    """gunicorn's workers are forks that unwind through ``serve``: a worker exiting (here
    SIGTERM, as at a max-requests restart) once stopped both fronts, and the service."""
    base, proc = service["base"], service["proc"]
    workers = subprocess.run(
        ["pgrep", "-P", str(proc.pid), "-f", "app serve"], capture_output=True, text=True
    ).stdout.split()
    assert len(workers) == 1
    os.kill(int(workers[0]), signal.SIGTERM)
    _wait_ready(base, proc)  # the service itself stays up: the master forks a new worker
    _post(base, WORD_EN.read_bytes(), TRUSTED)
    _hit_from_front(base, WORD_EN.read_bytes(), TRUSTED)


def test_with_redis_down_the_front_forwards_and_the_engine_answers(service):
    """Last in this module: it stops the module's Redis."""
    base = service["base"]
    data = PHOTOTEST.read_bytes()
    _post(base, data, TRUSTED)
    _hit_from_front(base, data, TRUSTED)
    service["redis"].cleanup()
    for _ in range(3):
        resp = _post(base, data, TRUSTED)
        assert resp.json()["lines"]
