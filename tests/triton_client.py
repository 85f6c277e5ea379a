"""Runs NVIDIA's stock ``tritonclient`` (2.73.0, unmodified: gRPC and HTTP, sync and asyncio)
in a process of its own: ``python tests/triton_client.py SCRIPT.json``; prints one JSON line
per step with what the client returned or raised.

A process of its own because a server that compiles its own copy of Triton's protos and
``tritonclient.grpc`` cannot load in one process, and because ``tritonclient.http`` brings
gevent: the test process stays as the service's own is.

SCRIPT: ``{"http": "127.0.0.1:PORT", "grpc": "127.0.0.1:PORT", "steps": [...]}``; a step is
``{"client": "http"|"http-aio"|"grpc"|"grpc-aio", "call": NAME, ...}`` with ``call`` one of
``live``, ``ready``, ``model_ready``, ``server_metadata``, ``model_metadata``,
``model_config``, ``index``, ``infer`` (``model``, ``version``, ``input``, ``datatype``,
``shape``, ``elements``: base64 strings; ``output``; ``binary``: the input as binary data,
HTTP's default; ``binary_output``; ``headers``; ``timeout``: seconds, gRPC's deadline) and
``hps`` (PaddleX's high-stability request as its SDK builds it: ``payload``, a JSON object).
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from typing import Any

import numpy as np


def _clients(script: dict[str, Any]) -> dict[str, Any]:
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as grpcaio
    import tritonclient.http as httpclient
    import tritonclient.http.aio as httpaio

    return {
        "http": (httpclient, lambda: httpclient.InferenceServerClient(script["http"])),
        "http-aio": (httpaio, lambda: httpaio.InferenceServerClient(script["http"])),
        "grpc": (grpcclient, lambda: grpcclient.InferenceServerClient(script["grpc"])),
        "grpc-aio": (grpcaio, lambda: grpcaio.InferenceServerClient(script["grpc"])),
    }


def _elements(step: dict[str, Any]) -> Any:
    data = [base64.b64decode(e) for e in step["elements"]]
    array = np.empty(len(data), dtype=object)
    array[:] = data
    return array.reshape(step.get("shape", [len(data)]))


def _infer_args(module: Any, step: dict[str, Any], grpc: bool) -> dict[str, Any]:
    array = _elements(step)
    given = module.InferInput(
        step.get("input", "image"), list(array.shape), step.get("datatype", "BYTES")
    )
    if grpc:
        given.set_data_from_numpy(array)
    else:
        given.set_data_from_numpy(array, binary_data=step.get("binary", True))
    outputs = None
    if "output" in step:
        if grpc:
            outputs = [module.InferRequestedOutput(step["output"])]
        else:
            outputs = [
                module.InferRequestedOutput(
                    step["output"], binary_data=step.get("binary_output", True)
                )
            ]
    args: dict[str, Any] = {
        "model_name": step.get("model", "ocr-image"),
        "inputs": [given],
        "model_version": step.get("version", ""),
        "outputs": outputs,
        "headers": step.get("headers"),
    }
    if grpc and "timeout" in step:
        args["client_timeout"] = step["timeout"]
    if step.get("request_id"):
        args["request_id"] = step["request_id"]
    return args


def _result(result: Any, name: str) -> dict[str, Any]:
    array = result.as_numpy(name)
    flat = [e.decode() if isinstance(e, bytes) else str(e) for e in array.reshape(-1)]
    response = result.get_response()
    if not isinstance(response, dict):  # gRPC: the message
        response = {"model_name": response.model_name, "model_version": response.model_version,
                    "id": response.id}  # fmt: skip
    named = {key: response.get(key) for key in ("model_name", "model_version", "id")}
    return {"shape": list(array.shape), "elements": flat, **named}


def _hps(module: Any, step: dict[str, Any]) -> dict[str, Any]:
    """What ``paddlex_hps_client.triton_request`` does (PaddleX deploy/hps/sdk): the payload
    as compact JSON in a [1, 1] BYTES input ``input`` of model ``ocr``, no version, no
    requested outputs; the answer read from ``output[0, 0]``."""
    data = json.dumps(step["payload"], separators=(",", ":")).encode("utf-8")
    given = module.InferInput("input", [1, 1], "BYTES")
    array = np.empty((1, 1), dtype=object)
    array[0, 0] = data
    given.set_data_from_numpy(array)
    return {"model_name": step.get("model", "ocr"), "inputs": [given],
            "headers": step.get("headers")}  # fmt: skip


def _plan(module: Any, step: dict[str, Any], grpc: bool) -> tuple[str, tuple, dict, Any]:
    """(the client's method, its arguments, its keyword arguments, how to read what it
    returns) for one step: the same for the sync and the asyncio clients."""
    call = step["call"]
    model, version = step.get("model", "ocr-image"), step.get("version", "")
    as_json = {"as_json": True} if grpc else {}  # gRPC: the message as JSON, not protobuf

    def same(value: Any) -> Any:
        return value

    if call == "infer":
        output = step.get("output", "result")
        return "infer", (), _infer_args(module, step, grpc), lambda r: _result(r, output)
    if call == "hps":
        return (
            "infer",
            (),
            _hps(module, step),
            lambda r: json.loads(r.as_numpy("output")[0, 0].decode("utf-8")),
        )
    plans = {
        "live": ("is_server_live", (), {}),
        "ready": ("is_server_ready", (), {}),
        "model_ready": ("is_model_ready", (model, version), {}),
        "server_metadata": ("get_server_metadata", (), as_json),
        "model_metadata": ("get_model_metadata", (model, version), as_json),
        "model_config": ("get_model_config", (model, version), as_json),
        "index": ("get_model_repository_index", (), as_json),
    }
    if call not in plans:
        raise SystemExit(f"unknown call {call}")
    return (*plans[call], same)


async def main() -> None:
    from tritonclient.utils import InferenceServerException

    with open(sys.argv[1]) as fh:
        script = json.load(fh)
    clients = _clients(script)
    opened: dict[str, Any] = {}
    for step in script["steps"]:
        kind = step["client"]
        module, make = clients[kind]
        if kind not in opened:
            opened[kind] = make()
        client = opened[kind]
        line: dict[str, Any] = {"client": kind, "call": step["call"]}
        method, args, kwargs, read = _plan(module, step, kind.startswith("grpc"))
        try:
            value = getattr(client, method)(*args, **kwargs)
            line["value"] = read(await value if kind.endswith("-aio") else value)
        except InferenceServerException as exc:
            line["error"] = {"status": exc.status(), "message": exc.message()}
        print(json.dumps(line), flush=True)
    for kind, client in opened.items():
        if kind.endswith("-aio"):
            await client.close()
        else:
            client.close()


if __name__ == "__main__":
    asyncio.run(main())
