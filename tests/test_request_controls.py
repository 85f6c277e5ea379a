"""Request controls from a hostile client: numbers parsed with an exact pattern, names
validated with fullmatch (``$`` accepts a trailing newline), never a 5xx. Generated inputs
(hypothesis) plus the reviewer's examples, over every protocol."""

from __future__ import annotations

import base64
import re

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app import grpc_server
from app.config import Settings
from app.protocols import controls
from app.protocols.errors import BadRequest
from tests.conftest import WORD_EN

pytestmark = pytest.mark.integration

IMAGE = base64.b64encode(WORD_EN.read_bytes()).decode()
SETTINGS = Settings.from_env({}).with_overrides(cache_tenant_header="X-Tenant")
FUZZ = settings(
    max_examples=400, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)  # fmt: skip

# Unicode digits str.isdigit() accepts and int() may or may not: "²" crashed int() -> 500.
HOSTILE_TTLS = [
    "²", "³", "١٢", "٣", "𝟗", "1\n", "\n1", "1_000", "+5", "-1", "0", " ", "1e3", "0x10",
    "9" * 30, "1.5", "١",
]  # fmt: skip
HOSTILE_TENANTS = ["acme\n", "acme\r\n", " ", "a" * 65, "ac me", "acmé", "../x", "a:b", "{x}"]
# An HTTP header value cannot hold a newline (it ends the field): those are parse-level only.
SENDABLE_TTLS = [v for v in HOSTILE_TTLS if "\n" not in v]
SENDABLE_TENANTS = [v for v in HOSTILE_TENANTS if "\n" not in v]
header_text = st.text(st.characters(max_codepoint=0x2FF), max_size=24) | st.sampled_from(
    HOSTILE_TTLS + HOSTILE_TENANTS
)


@FUZZ
@given(ttl=header_text, tenant=header_text, cache_control=header_text)
def test_controls_accept_only_exact_forms(ttl: str, tenant: str, cache_control: str) -> None:
    headers = {"X-Cache-TTL": ttl, "X-Tenant": tenant, "Cache-Control": cache_control}
    try:
        parsed = controls.parse(headers, SETTINGS.controls)
    except BadRequest as exc:
        assert exc.code in {"invalid_ttl", "invalid_tenant"}
        return
    if ttl == "":  # an empty header is an absent one
        assert parsed.ttl is None
    else:
        assert re.fullmatch(r"[0-9]{1,10}", ttl.strip(" \t"))
        assert parsed.ttl == int(ttl) and 1 <= parsed.ttl <= SETTINGS.controls.ttl_max_seconds
    if tenant == "":
        assert parsed.namespace == ""
    else:
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", tenant) and parsed.namespace == tenant


@pytest.fixture()
def http(make_app):
    app = make_app(cache_tenant_header="X-Tenant")
    client = app.test_client()
    assert client.post("/v1/ocr", json={"image": IMAGE}).status_code == 200  # warm: a hit
    return app, client


def _post_all(client, headers: dict[str, str]) -> list[tuple[int, object]]:
    """(status, protocol error code) of the same request over the three HTTP protocols."""
    rest = client.post("/v1/ocr", json={"image": IMAGE}, headers=headers)
    pipe = client.post("/ocr/prediction", json={"key": ["image"], "value": [IMAGE]},
                       headers=headers)  # fmt: skip
    paddlex = client.post("/ocr", json={"file": IMAGE, "fileType": 1}, headers=headers)
    return [
        (rest.status_code, (rest.get_json().get("error") or {}).get("code")),
        (pipe.status_code, pipe.get_json()["err_no"]),
        (paddlex.status_code, paddlex.get_json()["errorCode"]),
    ]


@pytest.mark.parametrize("ttl", SENDABLE_TTLS)
def test_hostile_ttl_is_a_client_error_everywhere(http, ttl):
    _, client = http
    answers = _post_all(client, {"X-Cache-TTL": ttl})
    assert answers == [(400, "invalid_ttl"), (200, 5000), (422, 422)], ttl


@pytest.mark.parametrize("tenant", SENDABLE_TENANTS)
def test_hostile_tenant_is_a_client_error_everywhere(http, tenant):
    _, client = http
    answers = _post_all(client, {"X-Tenant": tenant})
    assert answers == [(400, "invalid_tenant"), (200, 5000), (422, 422)], tenant


@settings(FUZZ, max_examples=150)
@given(ttl=st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=12))
def test_generated_ttl_headers_never_5xx(http, ttl: str) -> None:
    _, client = http
    resp = client.post("/v1/ocr", json={"image": IMAGE}, headers={"X-Cache-TTL": ttl})
    assert resp.status_code in (200, 400), (ttl, resp.status_code)
    if resp.status_code == 200 and ttl:
        assert resp.headers["X-Cache"] == "HIT" and 1 <= int(ttl) <= 2_592_000


def test_grpc_metadata_is_validated_the_same_way(grpc_front):
    _, endpoint = grpc_front(cache_tenant_header="X-Tenant")
    stub = grpc_server.pb2_grpc.PipelineServiceStub(grpc.insecure_channel(endpoint))
    request = grpc_server.pb2.Request(key=["image"], value=[IMAGE])
    for metadata in ([("x-cache-ttl", "1e3")], [("x-cache-ttl", "+5")], [("x-tenant", "a b")]):
        reply = stub.inference(request, metadata=metadata, timeout=60)
        assert reply.err_no == 5000, metadata


def test_admin_names_use_fullmatch(make_app):
    client = make_app(admin_token="t" * 32).test_client()
    auth = {"Authorization": "Bearer " + "t" * 32}
    for body, code in (
        ({"md5": "0" * 32 + "\n"}, "invalid_md5"),
        ({"namespace": "acme\n"}, "invalid_namespace"),
    ):
        resp = client.post("/admin/purge", json=body, headers=auth)
        assert resp.status_code == 400 and resp.get_json()["error"]["code"] == code
    assert client.post("/admin/purge", json={"md5": "0" * 32}, headers=auth).status_code == 200
