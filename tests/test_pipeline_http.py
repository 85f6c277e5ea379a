"""Paddle Serving pipeline HTTP semantics beyond the basic round trip (docs/PROTOCOLS.md §2)."""

from __future__ import annotations

import ast
import json

import pytest

from tests.conftest import PHOTOTEST, SHORT, WORD_CH, WORD_EN
from tests.helpers import b64, metric_sum, stored_keys

pytestmark = pytest.mark.integration


def post(client, body, path="/ocr/prediction", **kw):  # type: ignore[no-untyped-def]
    resp = client.post(path, data=json.dumps(body), **kw)
    assert resp.status_code == 200
    return resp, json.loads(resp.data)


def mget_calls(redis_client) -> int:
    return int(redis_client.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))


def test_several_images_one_redis_round_trip(client, redis_client):
    images = [WORD_EN.read_bytes(), WORD_CH.read_bytes(), SHORT.read_bytes()]
    body = {"key": ["a", "b", "c"], "value": [b64(d) for d in images]}
    _, first = post(client, body)
    assert first["err_no"] == 0 and first["key"] == ["a", "b", "c"] and len(first["value"]) == 3
    before = mget_calls(redis_client)
    resp, second = post(client, body)
    assert mget_calls(redis_client) - before == 1  # one MGET for all three images
    assert resp.headers["X-Cache"] == "HIT" and second["value"] == first["value"]
    # Each image's answer is its own: the same as asking for it alone.
    _, alone = post(client, {"key": ["image"], "value": [b64(images[0])]})
    assert alone["value"][0] == first["value"][0]


def test_method_is_free_and_content_type_ignored(client):
    data = b64(WORD_EN.read_bytes())
    for path, headers in (
        ("/ocr/prediction", {}),
        ("/ocr/anything", {"Content-Type": "text/plain"}),
        ("/ocr/predict", {"Content-Type": "application/x-www-form-urlencoded"}),
    ):
        _, body = post(client, {"key": ["image"], "value": [data]}, path, headers=headers)
        assert body["err_no"] == 0


def test_tensor_form_matches_key_value_form(client):
    data = b64(PHOTOTEST.read_bytes())
    _, kv = post(client, {"key": ["image"], "value": [data]})
    pieces = [data[i : i + 1000] for i in range(0, len(data), 1000)]
    resp, tensors = post(
        client, {"tensors": [{"name": "image", "elem_type": 12, "str_data": pieces}]}
    )
    assert resp.headers["X-Cache"] == "HIT" and tensors["value"] == kv["value"]
    _, pickled = post(
        client, {"tensors": [{"name": "image", "elem_type": 13, "byte_data": "gA=="}]}
    )
    assert pickled["err_no"] == 7000


def test_logid_and_clientip_are_not_in_the_key(client):
    data = b64(WORD_CH.read_bytes())
    post(client, {"key": ["image"], "value": [data], "logid": 1, "clientip": "10.0.0.1"})
    resp, _ = post(client, {"key": ["image"], "value": [data], "logid": 2, "clientip": "x"})
    assert resp.headers["X-Cache"] == "HIT"


def test_profile_bypasses_the_cache(client, redis_client):
    data = b64(WORD_EN.read_bytes())
    body = {"key": ["image", "pipeline.profile"], "value": [data, "1"]}
    for _ in range(2):
        resp, answer = post(client, body)
        assert resp.headers["X-Cache"] == "BYPASS"
        assert answer["key"] == ["result", "pipeline.profile"]
    assert stored_keys(redis_client) == []
    calls = metric_sum(client.get("/metrics").text, "ocr_cache_requests_total", result="bypass")
    assert calls >= 2


def test_too_many_images_is_err_no(make_app):
    client = make_app(max_images_per_request=2).test_client()
    data = b64(WORD_EN.read_bytes())
    _, body = post(client, {"key": ["a", "b", "c"], "value": [data] * 3})
    assert body["err_no"] == 5000 and "over the limit" in body["err_msg"]


def test_upstream_error_message_form(client):
    _, body = post(client, {"key": ["image"], "value": [b64(b"no image here")], "logid": 42})
    assert body["err_no"] == 10000
    assert body["err_msg"].startswith("Log_id: 42  Raise_msg: ")
    assert "  ClassName: " in body["err_msg"] and "  FunctionName: " in body["err_msg"]


def test_result_string_renders_floats_and_parses(client):
    _, body = post(client, {"key": ["image"], "value": [b64(PHOTOTEST.read_bytes())]})
    text = body["value"][0]
    assert "np.float" not in text
    lines = ast.literal_eval(text)
    (first_text, score), box = lines[0]
    assert isinstance(score, float) and all(isinstance(v, float) for pt in box for v in pt)
    assert all(s >= 0.5 for (_, s), _ in lines)  # pdserving's drop score


def test_scores_print_with_float32_digits(client):
    """Upstream's scores are numpy float32, printed (numpy < 2) with float32's shortest digits."""
    import re

    import numpy as np

    _, body = post(client, {"key": ["image"], "value": [b64(PHOTOTEST.read_bytes())]})
    printed = re.findall(r"', ([0-9.e-]+)\)", body["value"][0])
    assert printed
    for text in printed:
        assert text == str(np.float32(float(text)))  # shortest float32 digits, no more
        assert len(text.replace("0.", "", 1)) <= 9


def test_only_the_image_key_is_read_when_present(client):
    data = b64(WORD_EN.read_bytes())
    _, alone = post(client, {"key": ["image"], "value": [data]})
    _, extra = post(
        client, {"key": ["image", "request_id", "x"], "value": [data, "req-1", "not base64!"]}
    )
    assert extra["err_no"] == 0 and extra["key"] == ["result"]
    assert extra["value"] == alone["value"]
    tensors = [
        {"name": "image", "elem_type": 12, "str_data": [data]},
        {"name": "request_id", "elem_type": 12, "str_data": ["req-1"]},
    ]
    _, tensor = post(client, {"tensors": tensors})
    assert tensor["err_no"] == 0 and tensor["value"] == alone["value"]
