"""Generated stubs of Paddle Serving's ``PipelineService``, shared by our gRPC server
(app/grpc_server.py) and the remote engine's client (app/engines/serving.py).

Compiled from app/protocols/proto/pipeline_service.proto at import (grpcio-tools): one source
of truth, no generated files in the tree. Import lazily where Paddle may load later: grpcio
must load after Paddle in a process (see tests/conftest.py).
"""

from __future__ import annotations

import grpc

PROTO = "app/protocols/proto/pipeline_service.proto"
pb2, pb2_grpc = grpc.protos_and_services(PROTO)
SERVICE = "baidu.paddle_serving.pipeline_serving.PipelineService"
METHOD = f"/{SERVICE}/inference"


def message_size_options(size: int) -> list[tuple[str, int]]:
    """Channel/server options bounding a message both ways (``Settings.grpc_message_limit``)."""
    return [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]
