"""Shared-state controls only from trusted callers, when configured (app/protocols/trust.py).

Real app, real Redis, real engine; the caller's address is the WSGI REMOTE_ADDR (HTTP) or the
gRPC peer (loopback here)."""

from __future__ import annotations

import base64
import ipaddress

import grpc
import pytest

from app import grpc_server
from app.cache.keys import digest_image
from app.config import ConfigError, Settings
from tests.conftest import SHORT, WORD_EN

pytestmark = pytest.mark.integration

IMAGE = base64.b64encode(WORD_EN.read_bytes()).decode()
TOKEN = "c" * 24
UNTRUSTED = {"REMOTE_ADDR": "192.0.2.10"}
TRUSTED = {"REMOTE_ADDR": "10.1.2.3"}
POLICY = {
    "trusted_networks": (ipaddress.ip_network("10.0.0.0/8"),),
    "cache_control_token": TOKEN,
    "cache_status_visible": "trusted",
    "cache_tenant_header": "X-Tenant",
}


@pytest.fixture()
def app(make_app):
    return make_app(**POLICY)


def _entry_ttl(app, redis_client, data: bytes) -> int:
    cache = app.extensions["ocr"]["cache"]
    return redis_client.ttl(cache.key_for(digest_image(data), cache.engine.default_params))


def test_untrusted_callers_cannot_change_shared_state(app, redis_client):
    client = app.test_client()
    first = client.post("/v1/ocr", json={"image": IMAGE}, environ_base=TRUSTED)
    assert first.headers["X-Cache"] == "MISS" and first.get_json()["cache"] == "MISS"
    default_ttl = _entry_ttl(app, redis_client, WORD_EN.read_bytes())
    assert default_ttl > 3600
    hostile = {"X-Cache-TTL": "5", "Cache-Control": "no-cache"}
    resp = client.post("/v1/ocr", json={"image": IMAGE}, headers=hostile, environ_base=UNTRUSTED)
    assert resp.status_code == 200
    assert "X-Cache" not in resp.headers and "cache" not in resp.get_json()  # hidden
    assert "X-Cache-Tier" not in resp.headers and "cache_tier" not in resp.get_json()
    assert _entry_ttl(app, redis_client, WORD_EN.read_bytes()) > 3600  # TTL not shortened
    resp = client.post("/v1/ocr", json={"image": IMAGE}, headers={"X-Tenant": "acme"},
                       environ_base=UNTRUSTED)  # fmt: skip
    assert resp.status_code == 400 and resp.get_json()["error"]["code"] == "untrusted_control"
    # pipeline.profile (a cache bypass) is ignored for an untrusted caller: answered from cache.
    body = {"key": ["image", "pipeline.profile"], "value": [IMAGE, "1"]}
    before = redis_client.info("stats")["keyspace_hits"]
    assert client.post("/ocr/prediction", json=body, environ_base=UNTRUSTED).json["err_no"] == 0
    assert redis_client.info("stats")["keyspace_hits"] > before


def test_trusted_callers_by_network_or_token(app, redis_client):
    client = app.test_client()
    data = SHORT.read_bytes()
    image = base64.b64encode(data).decode()
    client.post("/v1/ocr", json={"image": image}, environ_base=TRUSTED)
    resp = client.post("/v1/ocr", json={"image": image}, environ_base=TRUSTED,
                       headers={"Cache-Control": "no-cache", "X-Cache-TTL": "50"})  # fmt: skip
    assert resp.headers["X-Cache"] == "MISS"  # recomputed
    assert 0 < _entry_ttl(app, redis_client, data) <= 50
    resp = client.post("/v1/ocr", json={"image": image}, environ_base=UNTRUSTED,
                       headers={"X-Cache-Control-Token": TOKEN, "X-Cache-TTL": "20"})  # fmt: skip
    assert resp.headers["X-Cache"] == "HIT"
    resp = client.post("/v1/ocr", json={"image": image}, environ_base=UNTRUSTED,
                       headers={"X-Cache-Control-Token": TOKEN, "Cache-Control": "no-cache",
                                "X-Cache-TTL": "20"})  # fmt: skip
    assert resp.headers["X-Cache"] == "MISS" and _entry_ttl(app, redis_client, data) <= 20
    wrong = client.post("/v1/ocr", json={"image": image}, environ_base=UNTRUSTED,
                        headers={"X-Cache-Control-Token": TOKEN[:-1] + "x"})  # fmt: skip
    assert "X-Cache" not in wrong.headers
    tenant = client.post("/v1/ocr", json={"image": image}, environ_base=TRUSTED,
                         headers={"X-Tenant": "acme"})  # fmt: skip
    assert tenant.headers["X-Cache"] == "MISS"  # its own namespace


def test_grpc_peer_is_checked_the_same_way(grpc_front):
    _, endpoint = grpc_front(**POLICY)  # the test's loopback peer is not in 10.0.0.0/8
    stub = grpc_server.pb2_grpc.PipelineServiceStub(grpc.insecure_channel(endpoint))
    request = grpc_server.pb2.Request(key=["image"], value=[IMAGE])
    reply, call = stub.inference.with_call(request, timeout=60)
    assert reply.err_no == 0 and "x-cache" not in dict(call.trailing_metadata())
    reply = stub.inference(request, metadata=[("x-tenant", "acme")], timeout=60)
    assert reply.err_no == 5000
    reply, call = stub.inference.with_call(
        request, metadata=[("x-cache-control-token", TOKEN)], timeout=60
    )
    assert dict(call.trailing_metadata())["x-cache"] == "HIT"


def test_without_a_policy_everyone_is_trusted(client):
    resp = client.post("/v1/ocr", json={"image": IMAGE}, environ_base=UNTRUSTED,
                       headers={"Cache-Control": "no-cache"})  # fmt: skip
    assert resp.headers["X-Cache"] == "MISS"


def test_policy_configuration_is_validated():
    settings = Settings.from_env({"TRUSTED_NETWORKS": "10.0.0.0/8, 192.168.1.7,fd00::/8"})
    assert len(settings.controls.trusted_networks) == 3
    for bad in ("10.0.0.0/33", "nope", "10.0.0.1/8/2"):
        with pytest.raises(ConfigError, match="TRUSTED_NETWORKS"):
            Settings.from_env({"TRUSTED_NETWORKS": bad})
    with pytest.raises(ConfigError, match="CACHE_CONTROL_TOKEN"):
        Settings.from_env({"CACHE_CONTROL_TOKEN": "short"})


def test_hidden_cache_status_hides_the_hit_counters_too(app, make_app):
    """Comparing /metrics or /v1/stats before and after one's own request would tell whether
    an image was cached: with CACHE_STATUS_VISIBLE=trusted they are for trusted callers."""
    client = app.test_client()
    for path in ("/metrics", "/v1/stats"):
        refused = client.get(path, environ_base=UNTRUSTED)
        assert refused.status_code == 403 and refused.get_json()["error"]["code"] == "forbidden"
        assert client.get(path, environ_base=TRUSTED).status_code == 200
        token = {"X-Cache-Control-Token": TOKEN}
        assert client.get(path, headers=token, environ_base=UNTRUSTED).status_code == 200
    shown = make_app(**{**POLICY, "cache_status_visible": "all"}).test_client()
    assert shown.get("/metrics", environ_base=UNTRUSTED).status_code == 200
