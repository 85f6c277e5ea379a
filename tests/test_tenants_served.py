"""Tenants served (issue 26 §1, 2, 4, 5): ``AUTH=keys`` with two tenants in a real tenants
file, the real engine and Redis; every protocol's 401 and 429 in its own form (REST, the
pipeline over HTTP, PaddleX, gRPC), the key deciding the namespace, a key rotated and revoked
without a restart, a tenant's key never reading another tenant's entries, hits never refused
by the miss quotas, and who costs what in ``/metrics`` and ``/v1/stats``."""

from __future__ import annotations

import hashlib
import io
import ipaddress
import json
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from PIL import Image

from app.protocols.pipeline_stubs import pb2, pb2_grpc
from tests.conftest import PHOTOTEST, SHORT, WORD_CH, WORD_EN, run_stock_client
from tests.fleet import wait_for
from tests.helpers import b64, metric_sum

pytestmark = pytest.mark.integration

EXPENSES, HR = "expenses-key-0123456789abcdef", "hr-key-0123456789abcdef"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def write_tenants(path: Path, *entries: dict[str, Any]) -> Path:
    path.write_text(json.dumps({"tenants": list(entries)}))
    return path


@pytest.fixture()
def tenants_path(tmp_path: Path) -> Path:
    return write_tenants(
        tmp_path / "tenants.json",
        {"name": "expenses", "key_sha256": sha(EXPENSES)},
        {"name": "hr", "key_sha256": sha(HR)},
    )


@pytest.fixture()
def keyed(make_app, tenants_path: Path):  # type: ignore[no-untyped-def]
    """An app with AUTH=keys and the two tenants (more settings as keyword arguments)."""

    def start(**overrides: Any):  # type: ignore[no-untyped-def]
        settings = {"auth": "keys", "api_keys_file": str(tenants_path), **overrides}
        return make_app(**settings)

    return start


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def rest(client: Any, image: Path | bytes, headers: dict[str, str] | None = None, **kw: Any) -> Any:
    data = image.read_bytes() if isinstance(image, Path) else image
    return client.post("/v1/ocr", json={"image": b64(data)}, headers=headers or {}, **kw)


def variant(image: Path, n: int) -> bytes:
    """The image with one pixel changed: a new image to the cache (a miss)."""
    picture = Image.open(image).convert("RGB")
    picture.putpixel((0, 0), (n % 256, 7, 7))
    out = io.BytesIO()
    picture.save(out, "PNG")
    return out.getvalue()


class Counted:
    """A metric's growth during a test (the test process's counters outlive each app)."""

    def __init__(self, client: Any, name: str, **labels: str) -> None:
        self._client, self._name, self._labels = client, name, labels
        self._before = self._now()

    def _now(self) -> float:
        return metric_sum(self._client.get("/metrics").text, self._name, **self._labels)

    @property
    def grew(self) -> float:
        return self._now() - self._before


# 401 --------------------------------------------------------------------------------------


def test_every_http_protocol_answers_401_in_its_own_form(keyed) -> None:  # type: ignore[no-untyped-def]
    client = keyed().test_client()
    image = b64(WORD_EN.read_bytes())
    unauthorized = Counted(client, "ocr_tenant_rejections_total", reason="unauthorized")
    for headers in ({}, bearer("not-a-key"), {"X-Api-Key": "not-a-key"}):
        answer = client.post("/v1/ocr", json={"image": image}, headers=headers)
        assert answer.status_code == 401 and answer.json["error"]["code"] == "unauthorized"
        assert answer.headers["WWW-Authenticate"].startswith("Bearer")
        pipeline = client.post(
            "/ocr/prediction", json={"key": ["image"], "value": [image]}, headers=headers
        )
        assert pipeline.status_code == 401 and pipeline.json["err_no"] == 10000
        assert set(pipeline.json) == {"err_no", "err_msg", "key", "value", "tensors"}
        paddlex = client.post("/ocr", json={"file": image, "fileType": 1}, headers=headers)
        assert paddlex.status_code == 401 and paddlex.json["errorCode"] == 401
        assert paddlex.json["logId"] and "API key" in paddlex.json["errorMsg"]
    # Probes, metrics and the web page are not behind keys.
    assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200
    assert unauthorized.grew == 9


def test_a_key_names_the_tenant_and_its_namespace(keyed, redis_client: redis.Redis) -> None:  # type: ignore[no-untyped-def]
    client = keyed(cache_tenant_header="X-Tenant").test_client()
    first = rest(client, WORD_EN, {**bearer(EXPENSES), "X-Tenant": "hr"})  # the key wins
    assert first.status_code == 200 and first.headers["X-Cache"] == "MISS"
    md5 = hashlib.md5(WORD_EN.read_bytes()).hexdigest()
    assert [k.decode() for k in redis_client.keys(f"*{{{md5}}}")] == [
        k.decode() for k in redis_client.keys(f"ocr.expenses:v1:*{{{md5}}}")
    ]
    second = rest(client, WORD_EN, {"X-Api-Key": EXPENSES})
    assert second.headers["X-Cache"] == "HIT"


def test_a_tenants_key_never_reads_another_tenants_entries(
    keyed, redis_client: redis.Redis
) -> None:  # type: ignore[no-untyped-def]
    """The same image for two tenants: two computations, two entries, in L1 and L2 alike;
    neither answer tells one tenant whether the other had sent it."""
    client = keyed(cache_l1_bytes=8 << 20).test_client()
    for key in (EXPENSES, HR):
        answer = rest(client, SHORT, bearer(key))
        assert answer.status_code == 200 and answer.headers["X-Cache"] == "MISS"
        assert rest(client, SHORT, bearer(key)).headers["X-Cache"] == "HIT"
    md5 = hashlib.md5(SHORT.read_bytes()).hexdigest()
    prefixes = sorted(k.split(b":", 1)[0] for k in redis_client.keys(f"*:v1:*{{{md5}}}"))
    assert prefixes == [b"ocr.expenses", b"ocr.hr"]


@pytest.fixture()
def keyed_grpc(grpc_front, tenants_path: Path):  # type: ignore[no-untyped-def]
    def start(**overrides: Any):  # type: ignore[no-untyped-def]
        return grpc_front(auth="keys", api_keys_file=str(tenants_path), **overrides)

    return start


def _stub(endpoint: str) -> Any:
    return pb2_grpc.PipelineServiceStub(grpc.insecure_channel(endpoint))


def test_grpc_refuses_a_call_without_a_key_and_reads_one_from_metadata(keyed_grpc) -> None:  # type: ignore[no-untyped-def]
    _, endpoint = keyed_grpc()
    stub = _stub(endpoint)
    request = pb2.Request(key=["image"], value=[b64(WORD_CH.read_bytes())])
    for metadata in ((), (("authorization", "Bearer not-a-key"),)):
        with pytest.raises(grpc.RpcError) as refused:
            stub.inference(request, metadata=metadata, timeout=60)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    for metadata in ((("authorization", f"Bearer {HR}"),), (("x-api-key", HR),)):
        reply = stub.inference(request, metadata=metadata, timeout=60)
        assert reply.err_no == 0 and "value" not in reply.err_msg


def test_keyless_networks_let_stock_clients_in(keyed_grpc, stock_client_dir) -> None:  # type: ignore[no-untyped-def]
    """Stock Paddle Serving clients send no headers: from KEYLESS_NETWORKS they are served as
    the default tenant; from anywhere else, refused."""
    app, endpoint = keyed_grpc(keyless_networks=(ipaddress.ip_network("127.0.0.0/8"),))
    (answer,) = run_stock_client(stock_client_dir, endpoint, WORD_EN, "sync")
    assert answer["err_no"] == 0 and answer["key"] == ["result"]
    client = app.test_client()
    inside = rest(client, WORD_EN)  # the test client's address is 127.0.0.1
    assert inside.status_code == 200 and inside.headers["X-Cache"] == "HIT"  # the same entry
    outside = rest(client, WORD_EN, environ_overrides={"REMOTE_ADDR": "192.0.2.7"})
    assert outside.status_code == 401


# 429 --------------------------------------------------------------------------------------


def test_a_tenants_request_rate_is_429_in_every_protocols_form(keyed_grpc, tenants_path) -> None:  # type: ignore[no-untyped-def]
    """rate 0.1:1 (two at once, then one per 10 s), hits and misses alike; the other tenant
    is not held back."""
    write_tenants(
        tenants_path,
        {"name": "expenses", "key_sha256": sha(EXPENSES), "rate": "0.1:1"},
        {"name": "hr", "key_sha256": sha(HR)},
    )
    app, endpoint = keyed_grpc()
    client = app.test_client()
    image = b64(WORD_EN.read_bytes())
    limited = Counted(client, "ocr_tenant_rejections_total", tenant="expenses", reason="rate")
    for _ in range(2):
        assert rest(client, WORD_EN, bearer(EXPENSES)).status_code == 200
    answers = {
        "rest": rest(client, WORD_EN, bearer(EXPENSES)),
        "pipeline": client.post(
            "/ocr/prediction", json={"key": ["image"], "value": [image]}, headers=bearer(EXPENSES)
        ),
        "paddlex": client.post(
            "/ocr",
            json={"file": image, "fileType": 1, "visualize": False},
            headers=bearer(EXPENSES),
        ),  # fmt: skip
    }
    for answer in answers.values():
        assert answer.status_code == 429 and 1 <= int(answer.headers["Retry-After"]) <= 10
    assert answers["rest"].json["error"]["code"] == "quota_exceeded"
    assert answers["pipeline"].json["err_no"] == 10000
    assert answers["paddlex"].json["errorCode"] == 429
    with pytest.raises(grpc.RpcError) as refused:
        _stub(endpoint).inference(
            pb2.Request(key=["image"], value=[image]), metadata=(("x-api-key", EXPENSES),),
            timeout=60,
        )  # fmt: skip
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert 1 <= int(dict(refused.value.trailing_metadata())["retry-after"]) <= 10
    assert rest(client, WORD_EN, bearer(HR)).status_code == 200
    assert limited.grew == 4


def test_misses_in_flight_refuse_a_new_miss_but_never_a_hit(keyed, tenants_path) -> None:  # type: ignore[no-untyped-def]
    write_tenants(
        tenants_path,
        {"name": "expenses", "key_sha256": sha(EXPENSES), "misses_in_flight": 1},
        {"name": "hr", "key_sha256": sha(HR)},
    )
    app = keyed(web_threads=4)
    client = app.test_client()
    assert rest(client, WORD_CH, bearer(EXPENSES)).status_code == 200  # a hit from now on
    store = app.extensions["ocr"].cache.store
    slots = "ocr:quota:inflight:{expenses}"
    slow: dict[str, Any] = {}
    page = variant(PHOTOTEST, 1)
    worker = threading.Thread(
        target=lambda: slow.update(answer=rest(app.test_client(), page, bearer(EXPENSES)))
    )
    worker.start()
    deadline = time.monotonic() + 60
    while store.run("t", lambda c: c.zcard(slots))[1] != 1:  # the page's miss holds the slot
        assert time.monotonic() < deadline and worker.is_alive(), "the miss never took its slot"
        time.sleep(0.005)
    second = rest(client, variant(WORD_EN, 2), bearer(EXPENSES))
    hit = rest(client, WORD_CH, bearer(EXPENSES))
    other = rest(client, variant(WORD_EN, 3), bearer(HR))
    worker.join(120)
    assert slow["answer"].status_code == 200
    assert second.status_code == 429 and second.json["error"]["code"] == "quota_exceeded"
    assert "misses in flight" in second.json["error"]["message"] and second.headers["Retry-After"]
    assert hit.status_code == 200 and hit.headers["X-Cache"] == "HIT"
    assert other.status_code == 200
    assert rest(client, variant(WORD_EN, 2), bearer(EXPENSES)).status_code == 200  # slot free


def test_engine_seconds_per_minute_stop_misses_and_are_counted(keyed, tenants_path) -> None:  # type: ignore[no-untyped-def]
    write_tenants(
        tenants_path,
        {"name": "expenses", "key_sha256": sha(EXPENSES), "engine_seconds_per_minute": 0.01},
        {"name": "hr", "key_sha256": sha(HR)},
    )
    client = keyed().test_client()
    spent = Counted(client, "ocr_tenant_engine_seconds_total", tenant="expenses")
    not_hr = Counted(client, "ocr_tenant_engine_seconds_total", tenant="hr")
    before = client.get("/v1/stats").json["tenants"]
    assert rest(client, WORD_EN, bearer(EXPENSES)).status_code == 200  # spends its minute
    refused = rest(client, variant(WORD_EN, 4), bearer(EXPENSES))
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 60
    assert rest(client, WORD_EN, bearer(EXPENSES)).headers["X-Cache"] == "HIT"
    assert spent.grew > 0.01 and not_hr.grew == 0
    after = client.get("/v1/stats").json["tenants"]
    assert set(after) >= {"default", "expenses", "hr", "other"}
    grown = {
        k: after["expenses"][k] - before["expenses"][k] for k in ("misses", "hits", "rejected")
    }
    assert grown == {"misses": 1, "hits": 1, "rejected": 1}
    assert after["expenses"]["rejected_by_reason"]["engine_seconds"] >= 1
    assert after["expenses"]["engine_seconds"] - before["expenses"]["engine_seconds"] > 0.01


def test_repeated_refused_keys_from_one_address_are_slowed_down(keyed) -> None:  # type: ignore[no-untyped-def]
    """AUTH_FAILURE_LIMIT 0.05:2: after three refused keys the address's next bad (or
    missing) keys get 429 + Retry-After; a good key from the same address (another client
    behind one NAT) is still served, and another address's bad key is still a 401."""
    from app.env import RateLimit

    client = keyed(auth_failure_limit=RateLimit(0.05, 2)).test_client()
    for _ in range(3):
        assert rest(client, WORD_EN, bearer("guess")).status_code == 401
    for headers in (bearer("guess"), {}):
        slowed = rest(client, WORD_EN, headers)
        assert slowed.status_code == 429 and 1 <= int(slowed.headers["Retry-After"]) <= 20
        assert slowed.json["error"]["code"] == "quota_exceeded"
    assert rest(client, WORD_EN, bearer(EXPENSES)).status_code == 200
    elsewhere = rest(client, WORD_EN, bearer("guess"), environ_overrides={"REMOTE_ADDR": "::1"})
    assert elsewhere.status_code == 401


def test_a_keyless_request_is_the_default_tenant_whatever_its_header_says(
    keyed, redis_client: redis.Redis
) -> None:  # type: ignore[no-untyped-def]
    """From KEYLESS_NETWORKS without a key, a tenant header names nobody: the request is the
    default tenant's, so it can neither read nor spend another tenant's namespace."""
    client = keyed(
        keyless_networks=(ipaddress.ip_network("10.9.0.0/16"),), cache_tenant_header="X-Tenant"
    ).test_client()
    assert rest(client, SHORT, bearer(EXPENSES)).headers["X-Cache"] == "MISS"
    inside = {"REMOTE_ADDR": "10.9.1.2"}
    keyless = rest(client, SHORT, {"X-Tenant": "expenses"}, environ_overrides=inside)
    assert keyless.status_code == 200 and keyless.headers["X-Cache"] == "MISS"  # not expenses'
    md5 = hashlib.md5(SHORT.read_bytes()).hexdigest()
    prefixes = sorted(k.split(b":", 1)[0] for k in redis_client.keys(f"*:v1:*{{{md5}}}"))
    assert prefixes == [b"ocr", b"ocr.expenses"]


def test_a_key_is_rotated_and_revoked_without_a_restart(keyed, tenants_path) -> None:  # type: ignore[no-untyped-def]
    client = keyed(api_keys_reload_seconds=0.1).test_client()
    new = "expenses-next-0123456789abcdef"
    write_tenants(
        tenants_path, {"name": "expenses", "key_sha256": [sha(EXPENSES), sha(new)]}
    )  # hr revoked, expenses has two keys while its clients move over
    wait_for(lambda: rest(client, WORD_EN, bearer(new)).status_code == 200, 60, "new key taken")
    assert rest(client, WORD_EN, bearer(EXPENSES)).headers["X-Cache"] == "HIT"  # one tenant
    assert rest(client, WORD_EN, bearer(HR)).status_code == 401
    write_tenants(tenants_path, {"name": "expenses", "key_sha256": sha(new)})
    wait_for(lambda: rest(client, WORD_EN, bearer(EXPENSES)).status_code == 401, 60,
             "the old key revoked")  # fmt: skip
    assert rest(client, WORD_EN, bearer(new)).status_code == 200


def test_without_auth_the_tenant_header_still_names_tenants_for_quotas(
    make_app, tenants_path
) -> None:  # type: ignore[no-untyped-def]
    """AUTH unset, a tenants file for the limits: the trusted tenant header names the tenant
    and its rate applies; no key is asked for."""
    write_tenants(tenants_path, {"name": "hr", "rate": "0.1:0"})
    client = make_app(api_keys_file=str(tenants_path), cache_tenant_header="X-Tenant").test_client()
    assert rest(client, WORD_EN).status_code == 200
    assert rest(client, WORD_EN, {"X-Tenant": "hr"}).status_code == 200
    assert rest(client, WORD_EN, {"X-Tenant": "hr"}).status_code == 429
    assert rest(client, WORD_EN).status_code == 200
