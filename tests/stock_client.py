"""Runs Paddle Serving's own PipelineClient (paddle-serving-server==0.9.0, unmodified) in a
subprocess: ``python tests/stock_client.py DIR HOST:PORT IMAGE MODE...``; prints one JSON
line per mode with the raw Response fields.

The wheel is installed with ``pip install --no-deps --target DIR``; a package shim makes
``paddle_serving_server`` and ``paddle_serving_server.pipeline`` plain module objects whose
``__path__`` points into DIR, so their heavy ``__init__`` files never run. Its generated
protobuf code predates protobuf 4, hence the pure-Python protobuf implementation.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import types

os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"


def load_client(target: str):  # type: ignore[no-untyped-def]
    for name, sub in (
        ("paddle_serving_server", "paddle_serving_server"),
        ("paddle_serving_server.pipeline", os.path.join("paddle_serving_server", "pipeline")),
    ):
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(target, sub)]
        sys.modules[name] = module
    from paddle_serving_server.pipeline.pipeline_client import PipelineClient

    return PipelineClient


def main() -> None:
    target, endpoint, image_path, *modes = sys.argv[1:]
    client = load_client(target)()
    client.connect([endpoint])
    with open(image_path, "rb") as fh:
        image = base64.b64encode(fh.read()).decode()
    for mode in modes:
        if mode == "sync":
            resp = client.predict(feed_dict={"image": image}, fetch=["res"])
        elif mode == "asyn":
            resp = client.predict(feed_dict={"image": image}, fetch=["res"], asyn=True).result()
        elif mode == "tensor":
            resp = client.predict(feed_dict={"image": image}, pack_tensor_format=True)
        elif mode == "profile":
            resp = client.predict(feed_dict={"image": image}, profile=True)
        elif mode == "pickle":
            import numpy as np

            resp = client.predict(
                feed_dict={"image": np.frombuffer(image.encode(), dtype=np.uint8)},
                pack_tensor_format=True,
                use_tensor_bytes=True,
            )
        else:
            raise SystemExit(f"unknown mode {mode}")
        fields = {"mode": mode, "err_no": resp.err_no, "err_msg": resp.err_msg,
                  "key": list(resp.key), "value": list(resp.value)}  # fmt: skip
        print(json.dumps(fields), flush=True)


if __name__ == "__main__":
    main()
