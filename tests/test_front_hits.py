"""The HTTP front answers REST L2 hits itself (app/front_hits.py), exactly as a worker would,
and forwards everything else. Against a real `python -m app serve` (two front processes, one
worker, L1 off, encrypted entries, the cache status hidden from untrusted callers), the real
engine and a private Redis. What gunicorn answered carries its ``Server: gunicorn`` header;
what the front answered does not: that is how these tests tell them apart."""

from __future__ import annotations

import base64
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis
import requests

from app.embedded_redis import EmbeddedRedis, free_port
from tests.conftest import PHOTOTEST, ROOT, SHORT, WORD_CH, WORD_EN
from tests.helpers import b64, metric_sum
from tests.test_serve import _wait_ready

TOKEN = "c" * 24  # CACHE_CONTROL_TOKEN: the tests are trusted only when they send it
ADMIN = "a" * 24
TRUSTED = {"X-Cache-Control-Token": TOKEN}
KEY = base64.b64encode(b"k" * 32).decode()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("front-hits")
    server = EmbeddedRedis().start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(
        HOST="127.0.0.1", HTTP_PORT=str(port), GRPC_PORT=str(free_port()),
        WEB_CONCURRENCY="1", WEB_THREADS="2", HTTP_FRONT_PROCESSES="2",
        REDIS_URL=server.url, CACHE_KEY_PREFIX="front-hits", CACHE_L1_BYTES="0",
        OCR_WORK_DIR=str(tmp / "models"), PROMETHEUS_MULTIPROC_DIR=str(tmp / "metrics"),
        CACHE_CONTROL_TOKEN=TOKEN, TRUSTED_NETWORKS="10.0.0.0/8",
        CACHE_STATUS_VISIBLE="trusted", CACHE_ENCRYPTION_KEYS=f"k1:{KEY}", ADMIN_TOKEN=ADMIN,
        REDIS_BREAKER_COOLDOWN_SECONDS="2",
    )  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "serve"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc)
        yield {"base": base, "redis": server, "proc": proc}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        server.cleanup()
        if os.environ.get('SHOW_OUTPUT'):
            print(output[-8000:])
        assert proc.returncode == 0, output[-3000:]
        assert "the HTTP front exited" not in output, output[-3000:]


def _post(base: str, data: bytes, headers: dict | None = None, **fields) -> requests.Response:
    resp = requests.post(
        f"{base}/v1/ocr", json={"image": b64(data), **fields}, headers=headers, timeout=120
    )
    assert resp.status_code == 200, resp.text
    return resp


def _by_front(resp: requests.Response) -> bool:
    return "Server" not in resp.headers


def _engine_calls(base: str) -> float:
    text = requests.get(f"{base}/metrics", headers=TRUSTED, timeout=10).text
    return metric_sum(text, "ocr_engine_calls_total")


def _hit_from_front(base: str, data: bytes, headers: dict | None = None) -> requests.Response:
    """The front learns the workers' spec within a second of their start: retry briefly."""
    for _ in range(20):
        resp = _post(base, data, headers)
        if _by_front(resp):
            return resp
        time.sleep(0.2)
    raise AssertionError("the front never answered the hit")


def test_a_hit_answered_by_the_front_is_the_workers_answer(service):
    base = service["base"]
    data = PHOTOTEST.read_bytes()
    miss = _post(base, data, TRUSTED)
    assert miss.headers["X-Cache"] == "MISS" and not _by_front(miss)
    front = _hit_from_front(base, data, TRUSTED)
    # X-Cache-Similar makes the front forward; on an exact hit it changes nothing.
    worker = _post(base, data, {**TRUSTED, "X-Cache-Similar": "on"})
    assert not _by_front(worker)
    assert front.content == worker.content  # byte for byte: same render, same entry
    assert front.json()["cache"] == "HIT" and front.json()["cache_tier"] == "l2"
    for name in ("X-Cache", "X-Cache-Tier", "Content-Type", "Content-Length"):
        assert front.headers[name] == worker.headers[name], name
    assert "Date" in front.headers


def test_an_untrusted_caller_sees_no_cache_status_from_the_front_either(service):
    base = service["base"]
    data = WORD_EN.read_bytes()
    _post(base, data, TRUSTED)
    front = _hit_from_front(base, data)
    worker = _post(base, data, {"X-Cache-Similar": "on"})
    assert front.content == worker.content
    assert "cache" not in front.json() and "cache_tier" not in front.json()
    for resp in (front, worker):
        assert "X-Cache" not in resp.headers and "X-Cache-Tier" not in resp.headers


def test_the_front_forwards_what_it_does_not_answer(service):
    base = service["base"]
    data = PHOTOTEST.read_bytes()
    _hit_from_front(base, data, TRUSTED)
    body = {"image": b64(data)}
    forwarded = [
        requests.post(f"{base}/v1/ocr", json={**body, "min_score": 0.9}, timeout=60),
        requests.post(f"{base}/v1/ocr?x=1", json=body, timeout=60),
        requests.post(f"{base}/v1/ocr", files={"file": ("p.png", data)}, timeout=60),
        requests.post(f"{base}/v1/ocr", json=body, headers={"Cache-Control": "no-store"}),
        requests.post(f"{base}/v1/ocr", data=iter([b'{"image": "', b64(data).encode(), b'"}'])),
    ]  # fmt: skip
    for resp in forwarded:
        assert resp.status_code == 200, resp.text
        assert not _by_front(resp), resp.request.url
    # Errors keep their worker-side answers.
    bad_ttl = requests.post(f"{base}/v1/ocr", json=body, headers={**TRUSTED, "X-Cache-TTL": "x"})
    assert bad_ttl.status_code == 400 and not _by_front(bad_ttl)
    assert requests.get(f"{base}/v1/ocr", timeout=10).status_code == 405
    # A trusted no-cache recomputes (the worker decides), an untrusted one is a plain hit.
    before = _engine_calls(base)
    again = _post(base, data, {**TRUSTED, "Cache-Control": "no-cache"})
    assert again.headers["X-Cache"] == "MISS" and _engine_calls(base) == before + 1


def _pipeline(base: str, images: list[bytes], headers: dict | None = None):
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
            front = _pipeline(base, images, TRUSTED)
            if _by_front(front):
                break
            time.sleep(0.2)
        worker = _pipeline(base, images, {**TRUSTED, "X-Cache-Similar": "on"})
        assert _by_front(front) and not _by_front(worker)
        assert front.json()["err_no"] == 0 and len(front.json()["value"]) == len(images)
        assert front.content == worker.content
        for name in ("X-Cache", "X-Cache-Tier", "Content-Type"):
            assert front.headers[name] == worker.headers[name], name
    untrusted = _pipeline(base, [one])
    assert _by_front(untrusted) and "X-Cache" not in untrusted.headers


def test_pipeline_requests_the_front_does_not_answer(service):
    base = service["base"]
    # (Not a copy of another test's image with a byte appended: that would be a pixel-tier
    # hit of this one's entry for the other, which only a worker answers.)
    cached, cold = PHOTOTEST.read_bytes(), WORD_CH.read_bytes()
    _pipeline(base, [cached], TRUSTED)
    assert _by_front(_pipeline(base, [cached], TRUSTED))
    mixed = _pipeline(base, [cached, cold], TRUSTED)  # one miss: the worker answers all
    assert not _by_front(mixed) and mixed.json()["err_no"] == 0
    profiled = requests.post(f"{base}/ocr/prediction", headers=TRUSTED, timeout=120, json={
        "key": ["image", "pipeline.profile"], "value": [b64(cached), "1"]})  # fmt: skip
    assert not _by_front(profiled) and "pipeline.profile" in profiled.json()["key"]
    other = requests.post(f"{base}/other/prediction", json={"key": ["image"],
                          "value": [b64(cached)]}, timeout=60)  # fmt: skip
    assert not _by_front(other) and other.json()["err_no"] != 0
    broken = requests.post(f"{base}/ocr/prediction", data=b"{not json", timeout=60)
    assert broken.status_code == 400 and not _by_front(broken)
    refused = requests.post(f"{base}/ocr/prediction", json={"key": ["image"], "value": ["@@"]})
    assert refused.status_code == 200 and refused.json()["err_no"] != 0
    assert not _by_front(refused)


def test_the_front_counts_its_hits_in_the_service_metrics(service):
    base = service["base"]
    data = SHORT.read_bytes()
    _post(base, data, TRUSTED)
    _hit_from_front(base, data, TRUSTED)
    text = requests.get(f"{base}/metrics", headers=TRUSTED, timeout=10).text
    before = metric_sum(text, "ocr_cache_tier_hits_total", tier="l2")
    requests_before = metric_sum(text, "ocr_requests_total", protocol="rest", status="200")
    for _ in range(5):
        assert _by_front(_post(base, data, TRUSTED))
    text = requests.get(f"{base}/metrics", headers=TRUSTED, timeout=10).text
    assert metric_sum(text, "ocr_cache_tier_hits_total", tier="l2") == before + 5
    assert metric_sum(text, "ocr_requests_total", protocol="rest", status="200") == (
        requests_before + 5
    )


def test_the_front_never_serves_one_images_entry_for_another(service):
    """Image B's key holding image A's (valid, encrypted) entry: the codec's checks (SHA-256,
    the key it was sealed for) refuse it in the front as in the worker; B is computed."""
    base, client = service["base"], redis.Redis.from_url(service["redis"].url)
    a, b = WORD_EN.read_bytes(), WORD_CH.read_bytes()
    expected_b = _post(base, b, TRUSTED).json()["lines"]
    (key_a,) = client.keys(f"front-hits:*{{{hashlib.md5(a).hexdigest()}}}")
    (key_b,) = client.keys(f"front-hits:*{{{hashlib.md5(b).hexdigest()}}}")
    client.set(key_b, client.get(key_a))
    before = _engine_calls(base)
    resp = _post(base, b, TRUSTED)
    assert not _by_front(resp) and resp.headers["X-Cache"] == "MISS"
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
    resp = _post(base, data, TRUSTED)
    assert resp.headers["X-Cache"] == "MISS" and not _by_front(resp)


def test_a_worker_that_exits_leaves_the_fronts_and_redis_running(service):
    """gunicorn's workers are forks that unwind through ``serve``: a worker exiting (here
    SIGTERM, as at a max-requests restart) once stopped both fronts, and the service."""
    base, proc = service["base"], service["proc"]
    workers = subprocess.run(
        ["pgrep", "-P", str(proc.pid), "-f", "app serve"], capture_output=True, text=True
    ).stdout.split()
    assert len(workers) == 1
    os.kill(int(workers[0]), signal.SIGTERM)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{base}/readyz", timeout=5).ok:
                break
        except requests.RequestException:
            pass
        time.sleep(0.5)
    assert proc.poll() is None
    _post(base, WORD_EN.read_bytes(), TRUSTED)
    assert _by_front(_post(base, WORD_EN.read_bytes(), TRUSTED))


def test_with_redis_down_the_front_forwards_and_the_engine_answers(service):
    """Last in this module: it stops the module's Redis."""
    base = service["base"]
    data = PHOTOTEST.read_bytes()
    _post(base, data, TRUSTED)
    _hit_from_front(base, data, TRUSTED)
    service["redis"].cleanup()
    for _ in range(3):
        resp = _post(base, data, TRUSTED)
        assert not _by_front(resp)
        assert resp.json()["lines"]
