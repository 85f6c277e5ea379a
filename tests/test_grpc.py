"""gRPC PipelineService: the stock Paddle Serving client, unmodified, against our front."""

from __future__ import annotations

import ast
import base64

import grpc
import pytest

from app.protocols.pipeline_stubs import pb2, pb2_grpc
from tests.conftest import PHOTOTEST, WORD_CH, WORD_EN, run_stock_client
from tests.helpers import metric_sum

pytestmark = pytest.mark.integration


def _stub(endpoint: str, **options: int):  # type: ignore[no-untyped-def]
    channel = grpc.insecure_channel(endpoint, options=list(options.items()))
    return pb2_grpc.PipelineServiceStub(channel)


def test_stock_client_sync_and_async(grpc_front, stock_client_dir):
    app, endpoint = grpc_front()
    first, second, tensor = run_stock_client(
        stock_client_dir, endpoint, PHOTOTEST, "sync", "asyn", "tensor"
    )
    for resp in (first, second, tensor):
        assert resp["err_no"] == 0 and resp["key"] == ["result"], resp
        assert resp["value"] == first["value"]
    lines = ast.literal_eval(first["value"][0])
    assert lines[0][0][0].startswith("This is a lot of 12 point text")
    # The same entry answers HTTP: an image first seen over gRPC is a hit over REST.
    client = app.test_client()
    rest = client.post("/v1/ocr", json={"image": base64.b64encode(PHOTOTEST.read_bytes()).decode()})
    assert rest.headers["X-Cache"] == "HIT"


def test_stock_client_profile_bypasses_and_pickles_are_refused(grpc_front, stock_client_dir):
    app, endpoint = grpc_front()
    profile, pickled = run_stock_client(stock_client_dir, endpoint, WORD_EN, "profile", "pickle")
    assert profile["err_no"] == 0 and profile["key"] == ["result", "pipeline.profile"]
    assert pickled["err_no"] == 7000 and "pickled" in pickled["err_msg"]
    metrics = app.test_client().get("/metrics").text
    assert metric_sum(metrics, "ocr_cache_requests_total", result="bypass") >= 1


def test_trailing_metadata_reports_cache_status(grpc_front):
    _, endpoint = grpc_front()
    stub = _stub(endpoint)
    request = pb2.Request(key=["image"], value=[base64.b64encode(WORD_CH.read_bytes()).decode()])
    statuses, tiers = [], []
    for _ in range(2):
        reply, call = stub.inference.with_call(request, timeout=60)
        assert reply.err_no == 0
        statuses.append(dict(call.trailing_metadata())["x-cache"])
        tiers.append(dict(call.trailing_metadata()).get("x-cache-tier"))
    assert statuses == ["MISS", "HIT"]
    assert tiers[0] is None and tiers[1] in ("l1", "l2")


def test_a_traced_hits_server_span_says_its_outcome(traced, grpc_front):
    """Traced, a gRPC hit's server span says what its trailers say (outcome, tier) and how
    many images; no tenant without a key naming one."""
    _, endpoint = grpc_front()
    stub = _stub(endpoint)
    request = pb2.Request(key=["image"], value=[base64.b64encode(WORD_CH.read_bytes()).decode()])
    for _ in range(2):
        assert stub.inference(request, timeout=60).err_no == 0
    servers = [s for s in traced.get_finished_spans() if s.name == "PipelineService/inference"]
    miss, hit = (dict(span.attributes) for span in servers)
    assert miss["ocr.cache"] == "miss" and "ocr.images" not in miss  # on its lookup's span
    assert hit["ocr.cache"] == "hit" and hit["ocr.cache_tier"] in ("l1", "l2")
    assert hit["ocr.images"] == 1 and hit["ocr.err_no"] == 0 and "ocr.tenant" not in hit


def test_name_is_checked_only_when_set_and_errors_use_err_no(grpc_front):
    _, endpoint = grpc_front()
    stub = _stub(endpoint)
    data = base64.b64encode(WORD_EN.read_bytes()).decode()
    assert stub.inference(pb2.Request(key=["image"], value=[data], name="ocr")).err_no == 0
    wrong = stub.inference(pb2.Request(key=["image"], value=[data], name="det"))
    assert (wrong.err_no, wrong.err_msg) == (3002, "Failed to inference: Service name error.")
    assert stub.inference(pb2.Request(key=["image", "x"], value=[data])).err_no == 8000
    assert stub.inference(pb2.Request(key=["image"], value=["!!!"])).err_no == 10000
    bad = pb2.Request(tensors=[pb2.Tensor(name="image", elem_type=13, byte_data=b"\x80")])
    assert stub.inference(bad).err_no == 7000
    split = pb2.Request(
        tensors=[pb2.Tensor(name="image", elem_type=12, str_data=[data[:100], data[100:]])]
    )
    assert stub.inference(split).err_no == 0  # elem_type 12 pieces are concatenated


def test_deadline_and_message_size(grpc_front):
    _, endpoint = grpc_front(grpc_max_message_bytes=1 << 20)
    stub = _stub(endpoint)
    data = base64.b64encode(PHOTOTEST.read_bytes()).decode()
    with pytest.raises(grpc.RpcError) as info:
        stub.inference(pb2.Request(key=["image"], value=[data], logid=1), timeout=0.001)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(grpc.RpcError) as info:
        stub.inference(pb2.Request(key=["image"], value=["A" * (2 << 20)]), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_default_message_limit_is_max_request_bytes(grpc_front, base_settings):
    """A message over MAX_REQUEST_BYTES is refused by gRPC itself (no +481 MB per call)."""
    assert base_settings.grpc_message_limit() == base_settings.server.max_request_bytes
    _, endpoint = grpc_front(max_request_bytes=1 << 20)
    stub = _stub(endpoint)
    with pytest.raises(grpc.RpcError) as info:
        stub.inference(pb2.Request(key=["image"], value=["A" * (1 << 20)]), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
