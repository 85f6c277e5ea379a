"""The last-resort mapping: an unexpected error (a bug) is answered in each protocol's own
form, logged with a request id and counted in /metrics, and nothing is cached.

The error is provoked for real: an engine whose ``recognize`` raises an exception type no
layer expects (KeyError). That engine double stands for "a bug anywhere below the handlers";
everything else (cache, Redis, protocols, gRPC server) is the real thing."""

from __future__ import annotations

import base64
import logging
from typing import Any

import grpc
import pytest

from app import grpc_server
from app.engines.base import OcrRequest
from app.vocabulary import OcrResult
from tests.conftest import WORD_EN
from tests.fleet import wait_for
from tests.helpers import metric_sum

pytestmark = pytest.mark.integration

IMAGE = base64.b64encode(WORD_EN.read_bytes()).decode()


class BuggyEngine:
    """The real engine's identity, a ``recognize`` that fails with an unexpected type."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.kind = engine.kind

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def recognize(self, request: OcrRequest) -> OcrResult:
        raise KeyError("a bug, not an engine failure")


@pytest.fixture()
def buggy_app(make_app, engine):
    app = make_app(engine_override=BuggyEngine(engine))
    state = app.extensions["ocr"]["engine_state"]
    wait_for(lambda: state.ready, 60, f"the engine ready (status {state.status})")
    return app


def _unexpected(client, protocol: str) -> float:
    return metric_sum(
        client.get("/metrics").get_data(as_text=True), "ocr_unexpected_errors_total",
        protocol=protocol,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "protocol"),
    [
        ("/v1/ocr", {"image": IMAGE}, "rest"),
        ("/ocr/prediction", {"key": ["image"], "value": [IMAGE]}, "pipeline_http"),
        ("/ocr", {"file": IMAGE, "fileType": 1}, "paddlex"),
    ],
)
def test_http_answers_in_its_own_form(buggy_app, caplog, path, body, protocol):
    client = buggy_app.test_client()
    before = _unexpected(client, protocol)
    with caplog.at_level(logging.ERROR, logger="app"):
        resp = client.post(path, json=body)
    assert resp.status_code == 500
    request_id = resp.headers["X-Request-Id"]
    assert len(request_id) == 16
    answer = resp.get_json()
    if protocol == "rest":
        assert answer["error"]["code"] == "internal_error"
        assert request_id in answer["error"]["message"]
    elif protocol == "pipeline_http":
        assert answer["err_no"] == 10000 and request_id in answer["err_msg"]
        assert set(answer) == {"err_no", "err_msg", "key", "value", "tensors"}
    else:
        assert answer["errorCode"] == 500 and answer["logId"] == request_id
    assert "KeyError" not in resp.get_data(as_text=True)  # no internals to the client
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and "Traceback" in logging.Formatter().format(logged[0])  # in the log
    assert _unexpected(client, protocol) == before + 1
    assert "X-Cache" not in resp.headers


def test_grpc_answers_internal(buggy_app, caplog):
    ocr = buggy_app.extensions["ocr"]
    settings = ocr["settings"].with_overrides(host="127.0.0.1")
    server, port = grpc_server.start(ocr["cache"], settings, port=0)
    client = buggy_app.test_client()
    before = _unexpected(client, "grpc")
    try:
        stub = grpc_server.pb2_grpc.PipelineServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        with caplog.at_level(logging.ERROR, logger="app"):
            with pytest.raises(grpc.RpcError) as info:
                stub.inference(grpc_server.pb2.Request(key=["image"], value=[IMAGE]), timeout=30)
    finally:
        server.stop(0)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    request_id = info.value.details().rsplit(" ", 1)[-1].rstrip(")")
    assert any(request_id in r.getMessage() for r in caplog.records)
    assert _unexpected(client, "grpc") == before + 1


def test_nothing_is_cached_after_a_bug(buggy_app, make_app):
    assert buggy_app.test_client().post("/v1/ocr", json={"image": IMAGE}).status_code == 500
    # The buggy engine still feeds on the shared queue: a ticket of the healthy app's it takes
    # is handed back to the healthy engine, never answered EngineCrashed (a clean-clone run
    # saw that before tests/test_broken_engine.py's retry).
    healthy = make_app().test_client()
    statuses = [healthy.post("/v1/ocr", json={"image": IMAGE}).headers["X-Cache"] for _ in "ab"]
    assert statuses == ["MISS", "HIT"]
