"""Tenants through the real stack (issue 26): `python -m app serve` with `AUTH=keys` (nginx
at the edge, two granian workers with the real engine, gRPC in each worker), as deployed.

- nginx passes the service's 401 and 429 through in each protocol's form, with their
  `WWW-Authenticate` and `Retry-After`, and never logs a key;
- a tenant's request rate is one budget for every worker and replica (counted in Redis):
  two replicas on one Redis, requests sent to both in turn;
- gRPC (not through nginx) answers UNAUTHENTICATED without a key in its metadata;
- no key is ever written to the access log or the service's log."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import requests
from prometheus_client.mmap_dict import MmapedDict

from app.edge import find_nginx
from app.embedded_redis import EmbeddedRedis
from app.ports import free_port
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
        WEB_CONCURRENCY="2", ENGINE_PROCESSES="2", WEB_THREADS="4", REDIS_URL=redis_server.url,
        CACHE_KEY_PREFIX="tenants-edge", OCR_WORK_DIR=str(tmp / "models"),
        PROMETHEUS_MULTIPROC_DIR=str(tmp / "metrics"), AUTH="keys",
        API_KEYS_FILE=str(tenants),
    )  # fmt: skip
    output: list[str] = []
    with serving(overrides, output=output) as (proc, base):
        yield base, f"127.0.0.1:{grpc_port}", proc, tmp / "metrics", overrides
    # Neither nginx's access log nor the service's own lines ever hold a key.
    assert '"path":"/v1/ocr","status":401' in output[0]
    assert KEY not in output[0] and LIMITED not in output[0]


def test_nginx_passes_401_in_each_protocols_form(service) -> None:  # type: ignore[no-untyped-def]
    base = service[0]
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


def test_a_tenants_rate_is_one_budget_for_every_replica(service, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """rate 0.05:3: four requests at once, then one per 20 s, whichever worker or replica
    answers. A second replica (one worker) on the same Redis; 16 requests at once, sent to
    the two in turn: 4 answered in all (and what refilled meanwhile), where counted per
    replica 8 would have been, and each replica refused some (its own metrics files show
    it). Which of the first replica's two workers nginx hands a request to is the kernel's
    choice, so the workers are not told apart: the replicas are, by address."""
    image = b64(WORD_CH.read_bytes())
    replica = {
        **service[4], "HTTP_PORT": str(free_port()), "GRPC_PORT": str(free_port()),
        "WEB_CONCURRENCY": "1",
        "ENGINE_PROCESSES": "1", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics"),
    }  # fmt: skip
    output: list[str] = []
    with serving(replica, output=output) as (_, second):
        bases = [service[0], second]
        for base in bases:  # both warm: a worker's first request loads its engine
            answer = requests.post(
                f"{base}/v1/ocr", json={"image": image}, headers={"X-Api-Key": KEY}, timeout=120
            )
            assert answer.status_code == 200

        def send(n: int) -> requests.Response:
            return requests.post(
                f"{bases[n % 2]}/v1/ocr", json={"image": image},
                headers={"Authorization": f"Bearer {LIMITED}"}, timeout=120,
            )  # fmt: skip

        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(send, range(16)))
        elapsed = time.monotonic() - started
        # 8 requests each, at most `allowed` (< 8) answered in all: both replicas refused
        # some (read while the second runs: its metrics folder is cleared when it stops).
        assert _workers_that_refused(service[3]) and _workers_that_refused(tmp_path / "metrics")
    answered = sum(1 for a in answers if a.status_code == 200)
    allowed = 4 + int(elapsed * 0.05) + 1  # the burst, what refilled
    assert 4 <= answered <= allowed, [a.status_code for a in answers]
    assert {a.status_code for a in answers} == {200, 429}
    assert all(1 <= int(a.headers["Retry-After"]) <= 60 for a in answers if a.status_code == 429)
    assert KEY not in output[0] and LIMITED not in output[0]


def _workers_that_refused(metrics_dir: Path) -> set[str]:
    """The worker processes whose own metrics file counts a refusal of tenant 'limited'
    (prometheus_client's multiprocess files: one per process)."""
    refused = set()
    for path in metrics_dir.glob("counter_*.db"):
        for key, value, *_ in MmapedDict.read_all_values_from_file(str(path)):
            if "ocr_tenant_rejections_total" in key and '"limited"' in key and value > 0:
                refused.add(path.name)
    return refused


def test_grpc_without_a_key_is_unauthenticated(service) -> None:  # type: ignore[no-untyped-def]
    endpoint = service[1]
    stub = pb2_grpc.PipelineServiceStub(grpc.insecure_channel(endpoint))
    request = pb2.Request(key=["image"], value=[b64(WORD_EN.read_bytes())])
    with pytest.raises(grpc.RpcError) as refused:
        stub.inference(request, timeout=60)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    reply = stub.inference(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=120)
    assert reply.err_no == 0
