"""OCR_ENGINE=serving: our front as a cache sidecar in front of a remote Paddle Serving
pipeline. The remote here is a second instance of our own service (real engine, gRPC and
HTTP pipeline protocols, cache off), started as `python -m app serve` in a subprocess."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from app.engines.serving import ServingEngine
from app.ports import free_port
from app.web import create_app
from tests.conftest import PHOTOTEST, ROOT, WORD_EN, run_stock_client
from tests.fleet import wait_for
from tests.helpers import b64, metric_sum, stored_keys

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def backend(tmp_path_factory):  # type: ignore[no-untyped-def]
    http_port, grpc_port = free_port(), free_port()
    tmp = tmp_path_factory.mktemp("backend")
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL",)}
    env.update(
        HOST="127.0.0.1", HTTP_PORT=str(http_port), GRPC_PORT=str(grpc_port),
        WEB_CONCURRENCY="1", ENGINE_PROCESSES="1", WEB_THREADS="4", CACHE_ENABLED="false",
        OCR_WORK_DIR=str(tmp / "models"), PROMETHEUS_MULTIPROC_DIR=str(tmp / "metrics"),
    )  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve"], cwd=ROOT, env=env)
    base = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if requests.get(f"{base}/readyz", timeout=2).ok:
                break
        except requests.RequestException:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "backend did not start"
        time.sleep(0.3)
    yield {"http": base, "grpc": f"127.0.0.1:{grpc_port}"}
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def backend_calls(backend) -> float:  # type: ignore[no-untyped-def]
    return metric_sum(requests.get(f"{backend['http']}/metrics").text, "ocr_engine_calls_total")


def front(base_settings, url: str, **overrides):  # type: ignore[no-untyped-def]
    settings = base_settings.with_overrides(ocr_engine="serving", serving_url=url, **overrides)
    app = create_app(settings, engine=ServingEngine.from_settings(settings))
    app.testing = True
    client = app.test_client()
    wait_for(lambda: client.get("/readyz").status_code == 200, 60, "ready",
             lambda: str(client.get("/readyz").get_json()))  # fmt: skip
    return app, client


@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_front_caches_the_remote_pipeline(backend, base_settings, redis_client, scheme):
    url = f"grpc://{backend['grpc']}" if scheme == "grpc" else backend["http"]
    _, client = front(base_settings, url)
    data = PHOTOTEST.read_bytes()
    direct = requests.post(f"{backend['http']}/v1/ocr", json={"image": b64(data)}).json()
    before = backend_calls(backend)
    first = client.post("/v1/ocr", json={"image": b64(data)})
    assert first.status_code == 200 and first.headers["X-Cache"] == "MISS"
    assert backend_calls(backend) == before + 1
    for _ in range(3):
        again = client.post("/v1/ocr", json={"image": b64(data)})
        assert again.headers["X-Cache"] == "HIT"
        pipe = client.post("/ocr/prediction", data=f'{{"key":["image"],"value":["{b64(data)}"]}}')
        assert pipe.headers["X-Cache"] == "HIT"
    assert backend_calls(backend) == before + 1
    # Same texts, scores and boxes as the backend's own answer.
    got = [(ln["text"], ln["score"], ln["box"]) for ln in first.get_json()["lines"]]
    want = [(ln["text"], ln["score"], ln["box"]) for ln in direct["lines"]]
    assert got == want
    engine = first.get_json()["engine"]
    assert engine["kind"] == "serving" and engine["url"] == url


def test_backend_identity_is_the_fingerprint(base_settings, backend):
    a = ServingEngine.from_settings(base_settings.with_overrides(serving_url=backend["http"]))
    b = ServingEngine.from_settings(
        base_settings.with_overrides(serving_url=backend["http"], serving_model_version="v2")
    )
    c = ServingEngine.from_settings(
        base_settings.with_overrides(serving_url=f"grpc://{backend['grpc']}")
    )
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3


def test_stock_client_through_front_to_backend(backend, base_settings, stock_client_dir):
    from app import grpc_server

    app, _ = front(base_settings, f"grpc://{backend['grpc']}")
    ocr = app.extensions["ocr"]
    server, port = grpc_server.start(ocr["cache"], ocr["settings"], port=0)
    try:
        sync, asyn = run_stock_client(
            stock_client_dir, f"127.0.0.1:{port}", PHOTOTEST, "sync", "asyn"
        )
    finally:
        server.stop(grace=None)
    assert sync["err_no"] == 0 and sync["value"] == asyn["value"] and sync["value"] != ["[]"]


@pytest.mark.parametrize("url", ["grpc://127.0.0.1:{port}", "http://127.0.0.1:{port}"])
def test_unreachable_backend_is_an_error_and_nothing_is_cached(base_settings, redis_client, url):
    _, client = front(base_settings, url.format(port=free_port()), serving_retries=2)
    resp = client.post("/v1/ocr", json={"image": b64(WORD_EN.read_bytes())})
    assert resp.status_code == 503 and "unreachable" in resp.get_json()["error"]["message"]
    body = f'{{"key":["image"],"value":["{b64(WORD_EN.read_bytes())}"]}}'
    assert client.post("/ocr/prediction", data=body).get_json()["err_no"] == 10000
    assert stored_keys(redis_client) == []


def test_per_request_options_are_refused_with_422(backend, base_settings):
    _, client = front(base_settings, backend["http"])
    data = base64.b64encode(WORD_EN.read_bytes()).decode()
    resp = client.post("/ocr", json={"file": data, "fileType": 1, "textDetLimitSideLen": 320})
    assert resp.status_code == 422 and "OCR_ENGINE=serving" in resp.get_json()["errorMsg"]
    assert client.post("/ocr", json={"file": data, "fileType": 1}).status_code == 200
