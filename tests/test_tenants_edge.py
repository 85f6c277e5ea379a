"""Tenants through the real stack (issue 26): `python -m app serve` with `AUTH=keys` (nginx
at the edge, two gunicorn workers with the real engine, gRPC in each worker), as deployed.

- nginx passes the service's 401 and 429 through in each protocol's form, with their
  `WWW-Authenticate` and `Retry-After`, and never logs a key;
- a tenant's request rate is one budget for both workers (counted in Redis), whichever
  worker nginx hands each request to;
- gRPC (not through nginx) answers UNAUTHENTICATED without a key in its metadata;
- no key is ever written to the access log or the service's log."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import grpc
import pytest
import requests

from app.edge import find_nginx
from app.embedded_redis import EmbeddedRedis, free_port
from app.protocols.pipeline_stubs import pb2, pb2_grpc
from tests.conftest import WORD_CH, WORD_EN
from tests.helpers import b64
from tests.test_serve import serving

pytestmark = pytest.mark.deploy

KEY, LIMITED = "edge-tenant-key-0123456789abcdef", "edge-limited-key-0123456789abcdef"


@pytest.fixture(scope="module")
def service(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    if find_nginx() is None:
        pytest.skip("no nginx binary (Debian's nginx-light): the edge cannot be checked")
    tmp = tmp_path_factory.mktemp("tenants-edge")
    tenants = tmp / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [
        {"name": "scans", "key_sha256": hashlib.sha256(KEY.encode()).hexdigest()},
        {"name": "limited", "key_sha256": hashlib.sha256(LIMITED.encode()).hexdigest(),
         "rate": "0.05:3"},
    ]}))  # fmt: skip
    grpc_port = free_port()
    overrides = dict(
        HOST="127.0.0.1", HTTP_PORT=str(free_port()), GRPC_PORT=str(grpc_port),
        WEB_CONCURRENCY="2", WEB_THREADS="4", REDIS_URL=redis_server.url,
        CACHE_KEY_PREFIX="tenants-edge", OCR_WORK_DIR=str(tmp / "models"),
        PROMETHEUS_MULTIPROC_DIR=str(tmp / "metrics"), AUTH="keys",
        API_KEYS_FILE=str(tenants),
    )  # fmt: skip
    output: list[str] = []
    with serving(overrides, output=output) as (proc, base):
        yield base, f"127.0.0.1:{grpc_port}", proc
    # Neither nginx's access log nor the service's own lines ever hold a key.
    assert '"path":"/v1/ocr","status":401' in output[0]
    assert KEY not in output[0] and LIMITED not in output[0]


def test_nginx_passes_401_in_each_protocols_form(service) -> None:  # type: ignore[no-untyped-def]
    base, _, _ = service
    image = b64(WORD_EN.read_bytes())
    rest = requests.post(f"{base}/v1/ocr", json={"image": image}, timeout=60)
    assert rest.status_code == 401 and rest.json()["error"]["code"] == "unauthorized"
    assert rest.headers["WWW-Authenticate"].startswith("Bearer") and rest.headers["X-Request-Id"]
    pipeline = requests.post(
        f"{base}/ocr/prediction", json={"key": ["image"], "value": [image]}, timeout=60
    )
    assert pipeline.status_code == 401 and pipeline.json()["err_no"] == 10000
    paddlex = requests.post(f"{base}/ocr", json={"file": image, "fileType": 1}, timeout=60)
    assert paddlex.status_code == 401 and paddlex.json()["errorCode"] == 401
    served = requests.post(
        f"{base}/v1/ocr", json={"image": image}, headers={"X-Api-Key": KEY}, timeout=120
    )
    assert served.status_code == 200 and served.json()["lines"]
    assert requests.get(f"{base}/readyz", timeout=10).status_code == 200  # not behind keys


def test_a_tenants_rate_is_one_budget_for_both_workers(service) -> None:  # type: ignore[no-untyped-def]
    """rate 0.05:3: four requests at once, then one per 20 s, across both workers (nginx
    spreads the keep-alive connections over them)."""
    base, _, _ = service
    image = b64(WORD_CH.read_bytes())
    statuses, retry = [], []
    for _ in range(8):
        with requests.Session() as fresh:  # a new connection each: both workers take some
            answer = fresh.post(
                f"{base}/v1/ocr", json={"image": image},
                headers={"Authorization": f"Bearer {LIMITED}"}, timeout=120,
            )  # fmt: skip
        statuses.append(answer.status_code)
        retry.append(answer.headers.get("Retry-After"))
    assert statuses == [200] * 4 + [429] * 4, statuses
    assert all(1 <= int(r) <= 20 for r in retry[4:]), retry


def test_grpc_without_a_key_is_unauthenticated(service) -> None:  # type: ignore[no-untyped-def]
    _, endpoint, _ = service
    stub = pb2_grpc.PipelineServiceStub(grpc.insecure_channel(endpoint))
    request = pb2.Request(key=["image"], value=[b64(WORD_EN.read_bytes())])
    with pytest.raises(grpc.RpcError) as refused:
        stub.inference(request, timeout=60)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    reply = stub.inference(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=120)
    assert reply.err_no == 0
