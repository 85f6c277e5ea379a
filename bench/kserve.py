"""``make bench-edge``'s Open Inference Protocol rows (issue 47): L2 hits through ``ModelInfer``
on model ``ocr-image``, 5 KB, against hits through ``POST /v1/ocr`` on the same service, in
one run, rounds alternating, medians.

- HTTP: wrk -t2 -c8 through the service's nginx, the v2 request as ``tritonclient.http``
  sends it (the binary data extension: the JSON header, then the image's 4-byte length and
  bytes; the answer asked as binary), against the REST hit's JSON body.
- gRPC: 8 client processes (Python, grpcio) each with its channel, ``ModelInfer`` (raw
  contents, as ``tritonclient.grpc`` sends them) against ``PipelineService/inference``, the
  other gRPC protocol, on the same port: the same client's cost on both sides.

The service is ``python -m app serve`` as ``bench.edge`` runs it (2 engine processes, 2 front
workers, L1 off: every hit an L2 hit). Results: bench/results/kserve.json.
Environment: BENCH_EDGE_ROUNDS (3), BENCH_EDGE_SECONDS (6).
"""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from app.embedded_redis import EmbeddedRedis
from app.ports import free_port
from app.protocols import kserve
from app.protocols.kserve_http import HEADER_LENGTH
from bench import load, run
from bench.edge import RESULTS, ROUNDS, SECONDS, Server, _git, start_service, stop, wait_ready, wrk
from bench.hitpath import CORPUS, SIZES

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.8  # v2 hits/s over HTTP >= 0.8x /v1/ocr's, 5 KB
CLIENTS = 8


def v2_request(image: bytes) -> load.Request:
    """What ``tritonclient.http`` sends for one image (binary input, binary output)."""
    data = kserve.encode_bytes([image])
    head = json.dumps(
        {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                     "parameters": {"binary_data_size": len(data)}}],
         "parameters": {"binary_data_output": True}},
        separators=(",", ":"),
    ).encode()  # fmt: skip
    headers = {HEADER_LENGTH: str(len(head)), "Content-Type": "application/octet-stream"}
    return load.Request("/v2/models/ocr-image/infer", head + data, headers)


def _model_infer_worker(
    endpoint: str, image: bytes, count: int, deadline: float, out: mp.Queue
) -> None:
    import grpc  # in the child only
    from tritonclient.grpc import service_pb2 as pb2
    from tritonclient.grpc import service_pb2_grpc as pb2_grpc

    stub = pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(endpoint))
    tensor = pb2.ModelInferRequest.InferInputTensor(name="image", datatype="BYTES", shape=[1])
    request = pb2.ModelInferRequest(
        model_name="ocr-image", inputs=[tensor], raw_input_contents=[kserve.encode_bytes([image])]
    )
    latencies, errors = [], 0
    for _ in range(count):
        if time.monotonic() > deadline:
            break
        start = time.perf_counter()
        reply = stub.ModelInfer(request, timeout=120)
        latencies.append(time.perf_counter() - start)
        errors += b'"cache":"HIT"' not in reply.raw_output_contents[0]
    out.put((latencies, errors))


def grpc_model_infer(endpoint: str, image: bytes) -> dict[str, Any]:
    return load._pool(_model_infer_worker, (endpoint, image), CLIENTS, 10**7, SECONDS)


def grpc_pipeline(endpoint: str, image: bytes) -> dict[str, Any]:
    return load.run_grpc(endpoint, base64.b64encode(image).decode(), CLIENTS, 10**7, SECONDS)


def main() -> int:
    if not load.wrk_available():
        print("bench.kserve needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    image = (CORPUS / SIZES["5KB"]).read_bytes()
    tmp = Path(tempfile.mkdtemp(prefix="bench-kserve-"))
    redis_server = EmbeddedRedis()
    grpc_port = free_port()
    service = Server("service", free_port(), "/v1/ocr", tmp / "service.log")
    report: dict[str, Any] = {
        "issue": 47,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": _git("rev-parse", "HEAD"),
        "tree_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "image": SIZES["5KB"],
        "image_bytes": len(image),
        "setup": {
            "rounds": ROUNDS,
            "seconds": SECONDS,
            "http_client": "wrk -t2 -c8",
            "grpc_client": f"{CLIENTS} Python processes, one channel each",
        },  # fmt: skip
    }
    ok = False
    try:
        redis_server.start()
        start_service(service, redis_server.url, ROOT, GRPC_PORT=str(grpc_port))
        ready = f"http://127.0.0.1:{service.port}/readyz"
        wait_ready(service, lambda: requests.get(ready, timeout=5).ok)
        rest, v2 = run.json_request("/v1/ocr", image), v2_request(image)
        base = f"http://127.0.0.1:{service.port}"
        for req in (rest, v2, v2):  # the miss, then hits through both
            answer = requests.post(base + req.path, data=req.body, headers=req.headers, timeout=600)
            answer.raise_for_status()
        if answer.headers.get("X-Cache") != "HIT":
            raise RuntimeError(f"the v2 request was not a hit: {answer.headers}")
        endpoint = f"127.0.0.1:{grpc_port}"
        http_runs: dict[str, list[dict]] = {"rest": [], "v2_http": []}
        grpc_runs: dict[str, list[dict]] = {"pipeline_grpc": [], "v2_grpc": []}
        wrk(service.port, rest, 8, 2)  # warm-up
        for round_ in range(ROUNDS):
            order = [("rest", rest), ("v2_http", v2)]
            for name, req in order if round_ % 2 == 0 else order[::-1]:
                http_runs[name].append(wrk(service.port, req, 8, SECONDS))
            calls = [("pipeline_grpc", grpc_pipeline), ("v2_grpc", grpc_model_infer)]
            for name, call in calls if round_ % 2 == 0 else calls[::-1]:
                grpc_runs[name].append(call(endpoint, image))
            print(f"round {round_ + 1}/{ROUNDS} done", flush=True)
        medians = {
            name: statistics.median(r["per_second"] for r in runs)
            for name, runs in {**http_runs, **grpc_runs}.items()
        }
        errors = {name: sum(r.get("errors", 0) for r in runs)
                  for name, runs in {**http_runs, **grpc_runs}.items()}  # fmt: skip
        report |= {
            "hits_per_s": {k: round(v, 1) for k, v in medians.items()},
            "errors": errors,
            "v2_http_vs_rest": round(medians["v2_http"] / medians["rest"], 3),
            "v2_grpc_vs_pipeline_grpc": round(medians["v2_grpc"] / medians["pipeline_grpc"], 3),
            "http_runs": http_runs,
            "grpc_runs": grpc_runs,
        }
        report["target_met"] = report["v2_http_vs_rest"] >= TARGET and not any(errors.values())
        ok = True
    finally:
        stop(service)
        redis_server.cleanup()
        if not ok and service.log.exists():
            print(*service.log.read_text(errors="replace").splitlines()[-15:], sep="\n",
                  file=sys.stderr)  # fmt: skip
        shutil.rmtree(tmp, ignore_errors=True)
    out = RESULTS / "kserve.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    hits = report["hits_per_s"]
    print(
        f"5 KB L2 hits/s: /v1/ocr {hits['rest']:.0f}, ModelInfer over HTTP {hits['v2_http']:.0f}"
        f" ({report['v2_http_vs_rest']:.2f}x, target >= {TARGET}x); gRPC: PipelineService "
        f"{hits['pipeline_grpc']:.0f}, ModelInfer {hits['v2_grpc']:.0f} "
        f"({report['v2_grpc_vs_pipeline_grpc']:.2f}x); errors {report['errors']}"
    )
    print(f"written to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
