"""The real app (real engine, real Redis) on a real HTTP port, for clients that run outside
the test process: the CLI in a subprocess, Chromium. werkzeug's threaded server, so
concurrent requests overlap as they do under the front server's threads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from werkzeug.serving import make_server


@pytest.fixture()
def live_service(make_app: Callable[..., Any]) -> Iterator[Callable[..., str]]:
    """``start(**setting_overrides)`` → the base URL of a running service."""
    servers: list[Any] = []

    def start(**overrides: Any) -> str:
        app = make_app(**overrides)
        server = make_server("127.0.0.1", 0, app, threaded=True)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
