"""The HTTP API against a real Redis server and the real engine."""

from __future__ import annotations

import ast
import io
import json

import numpy as np
import pytest

from app.cache.keys import digest_image
from app.embedded_redis import EmbeddedRedis
from tests.conftest import PHOTOTEST, SHARED, SHORT, WORD_CH, WORD_EN
from tests.fleet import wait_for
from tests.helpers import b64, entry_keys, metric_sum, stored_keys

pytestmark = pytest.mark.integration


def engine_calls(client) -> float:
    return metric_sum(client.get("/metrics").text, "ocr_engine_calls_total")


def ocr_json(client, data: bytes, **headers):
    return client.post("/v1/ocr", json={"image": b64(data)}, headers=headers)


def ocr_multipart(client, data: bytes, name: str = "img.png"):
    return client.post(
        "/v1/ocr", data={"file": (io.BytesIO(data), name)}, content_type="multipart/form-data"
    )


def pipeline(client, data: bytes, path: str = "/ocr/prediction"):
    body = json.dumps({"key": ["image"], "value": [b64(data)], "logid": 7})
    return client.post(path, data=body)  # no Content-Type, as official clients send


def test_miss_then_hit_identical(client):
    data = PHOTOTEST.read_bytes()
    first = ocr_json(client, data)
    second = ocr_json(client, data)
    assert first.status_code == second.status_code == 200
    assert first.headers["X-Cache"] == "MISS" and second.headers["X-Cache"] == "HIT"
    assert "X-Cache-Tier" not in first.headers and second.headers["X-Cache-Tier"] in ("l1", "l2")
    a, b = first.get_json(), second.get_json()
    assert (a.pop("cache"), b.pop("cache")) == ("MISS", "HIT")
    assert "cache_tier" not in a and b.pop("cache_tier") == second.headers["X-Cache-Tier"]
    assert a == b
    assert a["width"] == 640 and a["height"] == 480
    assert a["lines"][0]["text"].startswith("This is a lot of 12 point text")
    assert a["engine"]["kind"] == "paddle" and len(a["engine"]["fingerprint"]) == 16


def test_multipart_and_pipeline_share_the_entry(client):
    data = WORD_EN.read_bytes()
    assert ocr_multipart(client, data).headers["X-Cache"] == "MISS"
    assert ocr_json(client, data).headers["X-Cache"] == "HIT"
    resp = pipeline(client, data)
    assert resp.status_code == 200 and resp.headers["X-Cache"] == "HIT"
    assert resp.headers["X-Cache-Tier"] in ("l1", "l2")
    body = json.loads(resp.data)
    assert list(body) == ["err_no", "err_msg", "key", "value", "tensors"]
    assert body["err_no"] == 0 and body["key"] == ["result"] and body["tensors"] == []
    lines = ast.literal_eval(body["value"][0])
    rest_lines = ocr_json(client, data).get_json()["lines"]
    # pdserving prints float32 digits (as upstream): the same float32 score as REST's
    assert [(t, np.float32(s)) for (t, s), _ in lines] == [
        (ln["text"], np.float32(ln["score"])) for ln in rest_lines
    ]
    assert lines[0][1] == [[float(x), float(y)] for x, y in rest_lines[0]["box"]]


def test_one_engine_call_per_distinct_image(client):
    before = engine_calls(client)
    images = [WORD_EN.read_bytes(), WORD_CH.read_bytes(), SHORT.read_bytes()]
    for _ in range(3):
        for data in images:
            assert ocr_json(client, data).status_code == 200
            assert pipeline(client, data).status_code == 200
    assert engine_calls(client) - before == len(images)


def test_entry_has_ttl_with_jitter(client, redis_client, base_settings):
    assert ocr_json(client, WORD_CH.read_bytes()).status_code == 200
    (key,) = entry_keys(redis_client)
    ttl = redis_client.ttl(key)
    assert base_settings.cache.ttl_seconds * 0.9 - 5 <= ttl <= base_settings.cache.ttl_seconds
    assert key.decode().endswith("{" + digest_image(WORD_CH.read_bytes()).md5 + "}")


def test_configured_ttl_and_prefix(make_app, redis_client):
    client = make_app(cache_ttl_seconds=100, cache_ttl_jitter=0.0, cache_key_prefix="tenantA")
    assert ocr_json(client.test_client(), WORD_CH.read_bytes()).status_code == 200
    (key,) = entry_keys(redis_client, "*")
    assert key.startswith(b"tenantA:") and 95 <= redis_client.ttl(key) <= 100


def test_engine_fingerprint_change_is_a_miss(make_app, base_settings):
    from app.engines.paddle import PaddleOcrEngine

    data = WORD_EN.read_bytes()
    assert ocr_json(make_app().test_client(), data).headers["X-Cache"] == "MISS"
    assert ocr_json(make_app().test_client(), data).headers["X-Cache"] == "HIT"
    other = PaddleOcrEngine.from_settings(base_settings.with_overrides(ocr_cpu_threads=2))
    other.load()
    client = make_app(engine_override=other).test_client()
    resp = ocr_json(client, data)
    assert resp.headers["X-Cache"] == "MISS"
    assert resp.get_json()["engine"]["fingerprint"] == other.fingerprint
    assert ocr_json(client, data).headers["X-Cache"] == "HIT"


def test_corrupt_entry_is_a_miss_and_is_overwritten(client, redis_client):
    data = WORD_EN.read_bytes()
    good = ocr_json(client, data).get_json()
    (key,) = entry_keys(redis_client)
    for bad in (b"garbage", redis_client.get(key)[:-5], b"OCR1j{}"):
        redis_client.set(key, bad)
        resp = ocr_json(client, data)
        assert resp.headers["X-Cache"] == "MISS"
        assert resp.get_json()["lines"] == good["lines"]
        assert redis_client.get(key).startswith(b"OCR1")
        assert ocr_json(client, data).headers["X-Cache"] == "HIT"


def test_md5_collision_is_not_served_for_the_other_image(client):
    folder = SHARED / "testdata" / "md5-collision"
    a, b = (folder / "md5-1.jpg").read_bytes(), (folder / "md5-2.jpg").read_bytes()
    assert digest_image(a).md5 == digest_image(b).md5 and a != b
    assert ocr_json(client, a).headers["X-Cache"] == "MISS"
    assert ocr_json(client, b).headers["X-Cache"] == "MISS"  # same key, other SHA-256
    assert ocr_json(client, b).headers["X-Cache"] == "HIT"


def test_redis_stopped_mid_run_then_recovers(make_app, engine):
    data = WORD_CH.read_bytes()
    with EmbeddedRedis() as server:
        app = make_app(
            redis_url=server.url, redis_breaker_failures=1, redis_breaker_cooldown_seconds=0.2
        )
        client = app.test_client()
        assert ocr_json(client, data).headers["X-Cache"] == "MISS"
        assert ocr_json(client, data).headers["X-Cache"] == "HIT"
        server.stop()
        for _ in range(3):
            resp = ocr_json(client, data)
            assert resp.status_code == 200 and resp.headers["X-Cache"] == "MISS"
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.get_json()["redis"]["state"] == "down"
        server.start()  # same port, empty memory
        # Past the breaker's cool-down a request probes Redis again and stores its answer,
        # and the next ones hit (on a loaded machine the first probe may come too early).
        statuses: list[str] = []

        def hits_again() -> bool:
            statuses.append(ocr_json(client, data).headers["X-Cache"])
            return statuses[-2:] == ["HIT", "HIT"]

        wait_for(hits_again, 60, "two hits in a row once Redis is back", lambda: str(statuses))
        assert client.get("/readyz").get_json()["redis"]["state"] == "up"


def test_cache_disabled_is_bypass(make_app, redis_client):
    client = make_app(cache_enabled=False).test_client()
    for _ in range(2):
        assert ocr_json(client, WORD_EN.read_bytes()).headers["X-Cache"] == "BYPASS"
    assert stored_keys(redis_client) == []


def test_cache_control_no_store_and_no_cache(client, redis_client):
    data = WORD_EN.read_bytes()
    assert ocr_json(client, data, **{"Cache-Control": "no-store"}).headers["X-Cache"] == "MISS"
    assert stored_keys(redis_client) == []
    assert ocr_json(client, data).headers["X-Cache"] == "MISS"
    assert ocr_json(client, data, **{"Cache-Control": "no-cache"}).headers["X-Cache"] == "MISS"
    assert ocr_json(client, data).headers["X-Cache"] == "HIT"


@pytest.mark.parametrize(
    "kwargs,code",
    [
        ({"json": {"image": "%%%not base64%%%"}}, "invalid_base64"),
        ({"json": {"image": b64(b"plain text, not an image")}}, "invalid_image"),
        ({"json": {"picture": "abc"}}, "missing_field"),
        ({"json": {"image": 42}}, "invalid_base64"),
        ({"data": b"{not json"}, "invalid_json"),
        ({"data": {"other": "x"}, "content_type": "multipart/form-data"}, "missing_field"),
    ],
)
def test_bad_rest_input_is_400_and_not_cached(client, redis_client, kwargs, code):
    resp = client.post("/v1/ocr", **kwargs)
    assert resp.status_code == 400
    assert resp.get_json()["error"]["code"] == code
    assert stored_keys(redis_client) == []


def test_body_over_limit_is_413(make_app):
    client = make_app(max_request_bytes=4096).test_client()
    resp = ocr_json(client, PHOTOTEST.read_bytes())
    assert resp.status_code == 413 and resp.get_json()["error"]["code"] == "too_large"


def test_pipeline_errors_use_err_no(client, redis_client):
    data = b64(WORD_EN.read_bytes())
    cases = [
        ("/wrong/prediction", {"key": ["image"], "value": [data]}, 3002),
        ("/ocr/prediction", {"key": ["image"], "value": ["@@@@"]}, 10000),
        ("/ocr/prediction", {"key": ["image"], "value": [b64(b"not an image")]}, 10000),
        ("/ocr/prediction", {"key": ["image", "x"], "value": [data]}, 8000),
        ("/ocr/prediction", {"key": [], "value": []}, 5000),
        ("/ocr/prediction", {"key": "image", "value": data}, 7000),
    ]
    for path, body, err_no in cases:
        resp = client.post(path, data=json.dumps(body))
        assert resp.status_code == 200
        parsed = json.loads(resp.data)
        assert parsed["err_no"] == err_no, (body, parsed)
        assert parsed["value"] == [] and parsed["err_msg"]
    resp = client.post("/ocr/prediction", data=b"{oops")  # the gateway's own 400
    assert resp.status_code == 400 and json.loads(resp.data)["code"] == 3
    assert json.loads(client.post("/wrong/x", data=b"{}").data)["err_msg"] == (
        "Failed to inference: Service name error."
    )
    assert stored_keys(redis_client) == []


def test_health_ready_metrics(client):
    assert client.get("/healthz").status_code == 200
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.get_json()["engine"] == "ready" and ready.get_json()["redis"]["state"] == "up"
    ocr_json(client, WORD_EN.read_bytes())
    text = client.get("/metrics").text
    assert "ocr_engine_calls_total" in text
    assert 'ocr_cache_requests_total{result="' in text
