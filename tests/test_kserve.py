"""The Open Inference Protocol (KServe v2) with NVIDIA's stock ``tritonclient`` (gRPC and
HTTP, sync and asyncio, run unchanged in a process of their own: tests/triton_client.py) and
PaddleX's high-stability request as its SDK builds it, against the real app (real engine,
real Redis) on a real HTTP port and its gRPC server: answers identical to ``/ocr`` and
``/v1/ocr``, one cache entry across the protocols, errors in the protocol's form."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
from werkzeug.serving import make_server

from app import grpc_server
from tests.conftest import CORPUS, PHOTOTEST, ROOT, WORD_CH, WORD_EN
from tests.helpers import b64, metric_sum
from tests.test_paddlex import _pdf
from tests.test_tenants import digest, tenants_file

pytestmark = pytest.mark.integration

CLIENTS = ("http", "http-aio", "grpc", "grpc-aio")
REC = CORPUS / "mmocr_rec_1036169.jpg"


class Service:
    """The app on a werkzeug port (HTTP) and its gRPC server (both services)."""

    def __init__(self, app: Any, http: str, grpc_address: str) -> None:
        self.app, self.http, self.grpc = app, http, grpc_address

    @property
    def base(self) -> str:
        return f"http://{self.http}"

    def run(self, *steps: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
        return stock_clients(self.http, self.grpc, list(steps), tmp)


def stock_clients(
    http: str, grpc_address: str, steps: list[dict[str, Any]], tmp: Path
) -> list[dict[str, Any]]:
    """The stock clients' answers to ``steps`` (tests/triton_client.py), one a step."""
    script = tmp / f"script-{threading.get_ident()}-{id(steps)}.json"
    script.write_text(json.dumps({"http": http, "grpc": grpc_address, "steps": steps}))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "triton_client.py"), str(script)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(steps), proc.stdout[-2000:] + proc.stderr[-2000:]
    return lines


@pytest.fixture()
def v2(make_app: Any) -> Iterator[Any]:
    """``start(**setting_overrides)`` -> a ``Service``."""
    stops: list[Any] = []

    def start(**overrides: Any) -> Service:
        app = make_app(**overrides)
        server = make_server("127.0.0.1", 0, app, threaded=True)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        ocr = app.extensions["ocr"]
        settings = ocr["settings"].with_overrides(host="127.0.0.1")
        rpc, port = grpc_server.start(ocr["cache"], settings, port=0, service=ocr)
        stops.extend([lambda: rpc.stop(None), server.shutdown, server.server_close])
        return Service(app, f"127.0.0.1:{server.server_port}", f"127.0.0.1:{port}")

    yield start
    for stop in stops:
        stop()


def _enc(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _rest_lines(base: str, path: Path) -> tuple[list[dict[str, Any]], str]:
    answer = requests.post(f"{base}/v1/ocr", json={"image": b64(path.read_bytes())}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["lines"], answer.headers["X-Cache"]


def _without_log_id(envelope: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in envelope.items() if k != "logId"}


def test_stock_clients_health_metadata_and_infer(v2, tmp_path):
    service = v2()
    steps: list[dict[str, Any]] = []
    for kind in CLIENTS:
        steps += [
            {"client": kind, "call": "live"},
            {"client": kind, "call": "ready"},
            {"client": kind, "call": "model_ready", "model": "ocr"},
            {"client": kind, "call": "model_ready", "model": "ocr-image", "version": "1"},
            {"client": kind, "call": "model_ready", "model": "nope"},
            {"client": kind, "call": "server_metadata"},
            {"client": kind, "call": "model_metadata", "model": "ocr"},
            {"client": kind, "call": "model_config", "model": "ocr-image"},
            {"client": kind, "call": "index"},
            {"client": kind, "call": "infer", "elements": [_enc(WORD_EN), _enc(REC)]},
        ]
    answers = service.run(*steps, tmp=tmp_path)
    for kind in CLIENTS:
        got = {
            a["call"] + str(i): a for i, a in enumerate(x for x in answers if x["client"] == kind)
        }
        assert [got[f"{c}{i}"].get("value") for i, c in
                enumerate(("live", "ready", "model_ready", "model_ready", "model_ready"))] == [
            True, True, True, True, False]  # fmt: skip
        meta = got["server_metadata5"]["value"]
        assert meta["name"] == "ocr-cache" and "binary_tensor_data" in meta["extensions"]
        model = got["model_metadata6"]["value"]
        assert model["name"] == "ocr" and model["versions"] == ["1"]
        assert model["inputs"][0]["name"] == "input" and model["inputs"][0]["datatype"] == "BYTES"
        assert [int(d) for d in model["inputs"][0]["shape"]] == [-1, 1]  # gRPC's JSON: strings
        config = got["model_config7"]["value"]
        config = config.get("config", config)  # gRPC wraps it in ModelConfigResponse
        assert config["name"] == "ocr-image" and config["input"][0]["data_type"] == "TYPE_STRING"
        assert {m["name"] for m in _index(got["index8"]["value"])} == {"ocr", "ocr-image"}
        infer = got["infer9"]["value"]
        assert infer["shape"] == [2] and infer["model_name"] == "ocr-image"
        assert infer["model_version"] == "1"
        for path, element in zip((WORD_EN, REC), infer["elements"], strict=True):
            answer = json.loads(element)
            lines, cache = _rest_lines(service.base, path)  # the same entry: a hit now
            assert cache == "HIT" and answer["lines"] == lines and answer["lines"]
            assert answer["cache"] in ("HIT", "MISS")
    # The first client computed both images; every later one was answered from the cache.
    first = [json.loads(e)["cache"] for e in answers[9]["value"]["elements"]]
    later = [json.loads(e)["cache"] for a in answers[10:] if a["call"] == "infer"
             for e in a["value"]["elements"]]  # fmt: skip
    assert first == ["MISS", "MISS"] and set(later) == {"HIT"}
    text = requests.get(f"{service.base}/metrics", timeout=10).text
    for protocol in ("kserve_http", "kserve_grpc"):
        assert metric_sum(text, "ocr_requests_total", protocol=protocol) >= 2


def _index(value: Any) -> list[dict[str, Any]]:
    return value["models"] if isinstance(value, dict) else value


def test_a_rest_entry_is_a_hit_through_model_infer_and_back(v2, tmp_path):
    service = v2()
    lines, cache = _rest_lines(service.base, WORD_EN)
    assert cache == "MISS" and lines
    # JSON tensors where they can be: an image is not UTF-8 (binary in), the answer is.
    paddlex_body = json.dumps({"file": _enc(WORD_EN), "fileType": 1, "visualize": False})
    http, grpc_answer, as_json = service.run(
        {"client": "http", "call": "infer", "elements": [_enc(WORD_EN)], "output": "result",
         "binary_output": False},
        {"client": "grpc", "call": "infer", "elements": [_enc(WORD_CH)], "version": "1"},
        {"client": "http", "call": "infer", "model": "ocr", "input": "input", "shape": [1, 1],
         "elements": [b64(paddlex_body.encode())], "binary": False, "output": "output",
         "binary_output": False},
        tmp=tmp_path,
    )  # fmt: skip
    hit = json.loads(http["value"]["elements"][0])
    assert hit["cache"] == "HIT" and hit["lines"] == lines
    assert json.loads(grpc_answer["value"]["elements"][0])["cache"] == "MISS"
    assert _rest_lines(service.base, WORD_CH)[1] == "HIT"
    envelope = json.loads(as_json["value"]["elements"][0])
    assert as_json["value"]["shape"] == [1, 1] and envelope["errorCode"] == 0
    texts = [line["text"] for line in lines]
    assert envelope["result"]["ocrResults"][0]["prunedResult"]["rec_texts"] == texts


def test_paddlex_hps_request_answers_as_ocr(v2, tmp_path):
    service = v2()
    image = {"file": _enc(PHOTOTEST), "fileType": 1, "visualize": False}
    pdf = {"file": b64(_pdf(WORD_EN, WORD_CH)), "fileType": 0, "visualize": False}
    invalid = {"file": 12, "fileType": 1}
    unreadable = {"file": b64(b"not an image at all"), "fileType": 1}
    steps = [
        {"client": kind, "call": "hps", "payload": payload}
        for payload in (image, pdf, invalid, unreadable)
        for kind in ("grpc", "grpc-aio", "http")
    ]
    answers = service.run(*steps, tmp=tmp_path)
    for index, payload in enumerate((image, pdf, invalid, unreadable)):
        reference = requests.post(f"{service.base}/ocr", json=payload, timeout=120).json()
        for answer in answers[3 * index : 3 * index + 3]:
            assert "error" not in answer, answer
            assert _without_log_id(answer["value"]) == _without_log_id(reference), payload
            assert answer["value"]["logId"] != reference["logId"]
    assert answers[0]["value"]["errorCode"] == 0 and answers[3]["value"]["errorCode"] == 0
    assert answers[6]["value"]["errorCode"] == 422 and answers[9]["value"]["errorCode"] == 422


def test_protocol_errors_in_each_transport(v2, redis_client, tmp_path):
    service = v2()
    garbage = base64.b64encode(b"\x89PNG\r\n\x1a\n not really").decode()
    cases = [
        ({"model": "nope"}, "404", "NOT_FOUND"),
        ({"version": "2"}, "404", "NOT_FOUND"),
        ({"elements": [_enc(WORD_EN), garbage]}, "400", "INVALID_ARGUMENT"),
        ({"elements": [""]}, "400", "INVALID_ARGUMENT"),
        ({"input": "images"}, "400", "INVALID_ARGUMENT"),
        ({"output": "lines"}, "400", "INVALID_ARGUMENT"),
        ({"model": "ocr", "input": "input", "shape": [2, 1],
          "elements": [_enc(WORD_EN), _enc(WORD_EN)]}, "400", "INVALID_ARGUMENT"),
        ({"model": "ocr", "input": "input", "shape": [1, 1],
          "elements": [base64.b64encode(b'{"file": "\xff\xfe"}').decode()]}, "400",
         "INVALID_ARGUMENT"),
    ]  # fmt: skip
    steps = []
    for overrides, _, _ in cases:
        for kind in ("http", "grpc"):
            step = {"client": kind, "call": "infer", "elements": [_enc(WORD_CH)], **overrides}
            steps.append(step)
    answers = service.run(*steps, tmp=tmp_path)
    for number, (overrides, http_status, grpc_code) in enumerate(cases):
        http, rpc = answers[2 * number], answers[2 * number + 1]
        assert http.get("error", {}).get("status") == http_status, (overrides, http)
        assert rpc.get("error", {}).get("status") == f"StatusCode.{grpc_code}", (overrides, rpc)
        assert http["error"]["message"] == rpc["error"]["message"]
    assert "element 1" in answers[4]["error"]["message"]
    # An answer that failed computed nothing for its image: WORD_CH was never read.
    assert _rest_lines(service.base, WORD_CH)[1] == "MISS"


def test_keys_and_deadlines(v2, tmp_path):
    tenants = tenants_file(tmp_path / "keys.json", {"name": "acme", "key_sha256": digest("k1")})
    service = v2(auth="keys", api_keys_file=str(tenants))
    with_key = {"Authorization": "Bearer k1"}
    answers = service.run(
        {"client": "http", "call": "infer", "elements": [_enc(WORD_EN)]},
        {"client": "grpc", "call": "infer", "elements": [_enc(WORD_EN)]},
        {"client": "http", "call": "infer", "elements": [_enc(WORD_EN)], "headers": with_key},
        {"client": "grpc-aio", "call": "infer", "elements": [_enc(WORD_EN)],
         "headers": {"authorization": "Bearer k1"}},
        {"client": "grpc", "call": "infer", "elements": [_enc(PHOTOTEST)], "timeout": 0.01,
         "headers": {"authorization": "Bearer k1"}},
        {"client": "grpc", "call": "live"},
        tmp=tmp_path,
    )  # fmt: skip
    assert answers[0]["error"]["status"] == "401"
    assert answers[1]["error"]["status"] == "StatusCode.UNAUTHENTICATED"
    assert json.loads(answers[2]["value"]["elements"][0])["cache"] == "MISS"
    assert json.loads(answers[3]["value"]["elements"][0])["cache"] == "HIT"
    assert answers[4]["error"]["status"] == "StatusCode.DEADLINE_EXCEEDED"
    assert answers[5]["value"] is True
    # The call the client gave up on may still be computing its image: this request joins
    # it (or finds its entry, or computes it if the call ended before it began), so nothing
    # of this test runs on into the next.
    again = requests.post(
        f"{service.base}/v1/ocr", json={"image": b64(PHOTOTEST.read_bytes())},
        headers=with_key, timeout=120,
    )  # fmt: skip
    assert again.status_code == 200 and again.json()["lines"]


def test_hostile_bodies_get_a_400_in_the_protocols_form(client):
    """Over HTTP, bodies no stock client sends: each a 400 ``{"error": ...}``, nothing 5xx."""
    image = WORD_EN.read_bytes()
    framed = len(image).to_bytes(4, "little") + image
    declared = {"binary_data_size": len(framed)}
    head = json.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                   "parameters": declared}]}).encode()  # fmt: skip
    cases = [
        (head + framed, {"Inference-Header-Content-Length": str(len(head) + len(framed) + 1)}),
        (head + framed, {"Inference-Header-Content-Length": "-3"}),
        (head + framed, {"Inference-Header-Content-Length": "twelve"}),
        (head + framed[:-5], {"Inference-Header-Content-Length": str(len(head))}),
        (head + framed + b"extra", {"Inference-Header-Content-Length": str(len(head))}),
        (head, {}),
        (b"{not json", {}),
        (b"[]", {}),
        (
            json.dumps(
                {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
            ).encode(),
            {},
        ),  # fmt: skip
        (
            json.dumps(
                {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [2], "data": ["a"]}]}
            ).encode(),
            {},
        ),  # fmt: skip
        (
            json.dumps(
                {
                    "inputs": [
                        {"name": "image", "datatype": "BYTES", "shape": [1], "data": [{"b": 1}]}
                    ]
                }
            ).encode(),
            {},
        ),  # fmt: skip
        (
            json.dumps(
                {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [-1], "data": ["a"]}]}
            ).encode(),
            {},
        ),  # fmt: skip
        (
            b'{"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": ["\xff"]}]}',
            {},
        ),  # fmt: skip
        (_gzip(b" " * (50 << 20)), {"Content-Encoding": "gzip"}),
        (b"\x1f\x8b broken", {"Content-Encoding": "gzip"}),
        (head, {"Content-Encoding": "br"}),
    ]
    for body, headers in cases:
        answer = client.post("/v2/models/ocr-image/infer", data=body, headers=headers)
        assert answer.status_code == 400, (headers, body[:80], answer.data[:300])
        assert isinstance(answer.get_json()["error"], str) and answer.get_json()["error"]
    assert client.post("/v2/models/nope/infer", data=head + framed).status_code == 404
    assert client.get("/v2/models/ocr-image/infer").status_code == 405
    assert client.get("/v2/nothing").get_json() == {"error": "Not Found"}
    # The same request well framed is served, compressed too.
    good = {"Inference-Header-Content-Length": str(len(head))}
    assert (
        client.post("/v2/models/ocr-image/infer", data=head + framed, headers=good).status_code
        == 200
    )
    squeezed = client.post(
        "/v2/models/ocr-image/infer",
        data=_gzip(head + framed),
        headers={**good, "Content-Encoding": "gzip"},
    )
    assert squeezed.status_code == 200 and squeezed.headers["X-Cache"] == "HIT"


def test_undecodable_grpc_messages_are_invalid_argument(grpc_front):
    _, address = grpc_front()
    with grpc.insecure_channel(address) as channel:
        for method in ("ModelInfer", "ModelMetadata", "ModelReady"):
            call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
            with pytest.raises(grpc.RpcError) as raised:
                call(b"\xff\xff\xff\xff garbage", timeout=30)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        from tritonclient.grpc import service_pb2 as pb2

        both = pb2.ModelInferRequest(
            model_name="ocr-image",
            inputs=[pb2.ModelInferRequest.InferInputTensor(
                name="image", datatype="BYTES", shape=[1],
                contents=pb2.InferTensorContents(bytes_contents=[b"x"]))],
            raw_input_contents=[b"\x01\x00\x00\x00x"],
        )  # fmt: skip
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as raised:
            call(both.SerializeToString(), timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "raw_input_contents" in (raised.value.details() or "")
        stream = channel.unary_unary("/inference.GRPCInferenceService/ModelStatistics")
        with pytest.raises(grpc.RpcError) as raised:
            stream(b"", timeout=30)
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _gzip(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data)


def test_a_traceparent_is_continued_over_both_transports(grpc_front, traced):
    """The server span of ``ModelInfer`` (gRPC metadata) and of ``POST .../infer`` (a header)
    continues the client's trace, as on the other protocols."""
    from tritonclient.grpc import service_pb2 as pb2
    from tritonclient.grpc import service_pb2_grpc as pb2_grpc

    from app.protocols import kserve

    app, address = grpc_front()
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = f"00-{trace}-00f067aa0ba902b7-01"
    tensor = pb2.ModelInferRequest.InferInputTensor(name="image", datatype="BYTES", shape=[1])
    request = pb2.ModelInferRequest(
        model_name="ocr-image", inputs=[tensor],
        raw_input_contents=[kserve.encode_bytes([WORD_EN.read_bytes()])],
    )  # fmt: skip
    with grpc.insecure_channel(address) as channel:
        stub = pb2_grpc.GRPCInferenceServiceStub(channel)
        reply, call = stub.ModelInfer.with_call(
            request, metadata=(("traceparent", parent),), timeout=120
        )
    assert reply.model_name == "ocr-image" and dict(call.trailing_metadata())["x-cache"] == "MISS"
    body = json.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                   "data": ["not an image"]}]})  # fmt: skip
    answer = app.test_client().post(
        "/v2/models/ocr-image/infer", data=body, headers={"traceparent": parent}
    )
    assert answer.status_code == 400
    spans = {span.name: span for span in traced.get_finished_spans()}
    for name in ("inference.GRPCInferenceService/ModelInfer", "POST /v2/models/{name}/infer"):
        assert format(spans[name].context.trace_id, "032x") == trace, sorted(spans)
    assert spans["inference.GRPCInferenceService/ModelInfer"].attributes["ocr.model"] == "ocr-image"


def test_typed_contents_and_one_rate_budget_across_both_grpc_services(grpc_front):
    """``contents.bytes_contents`` is read as Triton reads it; ``RATE_LIMIT`` is one budget a
    client across ``PipelineService`` and ``GRPCInferenceService`` (the server's ``Gate``)."""
    from tritonclient.grpc import service_pb2 as pb2
    from tritonclient.grpc import service_pb2_grpc as pb2_grpc

    from app.env import RateLimit
    from app.protocols.pipeline_stubs import pb2 as pipeline_pb2
    from app.protocols.pipeline_stubs import pb2_grpc as pipeline_grpc

    _, address = grpc_front(rate_limit=RateLimit(1 / 60, 2))  # 3 calls, no refill in a test
    typed = pb2.ModelInferRequest(
        model_name="ocr-image",
        inputs=[pb2.ModelInferRequest.InferInputTensor(
            name="image", datatype="BYTES", shape=[1],
            contents=pb2.InferTensorContents(bytes_contents=[WORD_EN.read_bytes()]))],
    )  # fmt: skip
    with grpc.insecure_channel(address) as channel:
        v2_stub = pb2_grpc.GRPCInferenceServiceStub(channel)
        reply = v2_stub.ModelInfer(typed, timeout=120)
        assert json.loads(kserve_elements(reply)[0])["lines"]
        pipeline = pipeline_grpc.PipelineServiceStub(channel)
        word = base64.b64encode(WORD_EN.read_bytes()).decode()
        answer = pipeline.inference(pipeline_pb2.Request(key=["image"], value=[word]), timeout=60)
        assert answer.err_no == 0  # a call of the budget on the other service
        v2_stub.ModelInfer(typed, timeout=60)  # the budget's last (1 + a burst of 2)
        with pytest.raises(grpc.RpcError) as refused:
            v2_stub.ModelInfer(typed, timeout=60)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(dict(refused.value.trailing_metadata())["retry-after"]) >= 1


def kserve_elements(reply: Any) -> list[bytes]:
    from app.protocols import kserve

    return kserve.decode_bytes(reply.raw_output_contents[0], 1, "result")
