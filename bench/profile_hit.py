"""Profile an L2 hit in-process (L1 off): the WSGI app called the way gunicorn calls it.

    python -m bench.profile_hit [image] [requests]

Builds the app on a private Redis with the real engine, stores the image's entry with one
miss, then runs ``requests`` JSON hits through ``app.wsgi_app`` under cProfile and prints
the top frames by cumulative and by own time, and the microseconds per hit without the
profiler (best of 5 batches, wall and this thread's CPU time): the in-process figure
docs/PERFORMANCE.md sets the served hit against.
"""

from __future__ import annotations

import base64
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import paddle  # noqa: F401, I001  (before grpcio, as in the service)

from app.config import Settings
from app.embedded_redis import EmbeddedRedis
from app.engines.paddle import PaddleOcrEngine
from app.web import create_app

CORPUS = Path(os.environ.get("OCR_SHARED_DIR") or Path(__file__).resolve().parents[2] / "shared")


def environ(body: bytes) -> dict:
    return {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/v1/ocr",
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "8000",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "127.0.0.1",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
        "wsgi.url_scheme": "http",
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
        "wsgi.version": (1, 0),
    }


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "paddleocr_doc_00006737.jpg"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    data = (CORPUS / "corpus" / name).read_bytes()
    body = json.dumps({"image": base64.b64encode(data).decode()}).encode()
    engine = PaddleOcrEngine.from_settings(Settings.from_env({}))
    engine.load()
    with EmbeddedRedis() as server:
        settings = Settings.from_env({"REDIS_URL": server.url, "CACHE_L1_BYTES": "0"})
        app = create_app(settings, engine).wsgi_app
        statuses: list[str] = []

        def start_response(status: str, headers: list, exc_info: object = None) -> None:
            statuses.append(status)

        def hit() -> None:
            b"".join(app(environ(body), start_response))

        hit()  # the miss that stores the entry
        for _ in range(50):
            hit()
        assert statuses[-1].startswith("200"), statuses[-1]
        # The machine may be shared: the best of 5 batches is the cost, the rest is waiting.
        batches, cpu = [], []
        for _ in range(5):
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(n // 5):
                hit()
            batches.append((time.perf_counter() - start) / (n // 5) * 1e6)
            cpu.append((time.thread_time() - start_cpu) / (n // 5) * 1e6)
        per_hit, cpu_per_hit = min(batches), min(cpu)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(n):
            hit()
        profile.disable()
    print(
        f"{name}: {len(data)} bytes, per L2 hit in-process (no profiler): {per_hit:.0f} us wall, "
        f"{cpu_per_hit:.0f} us CPU of this thread (Redis's own time excluded)"
    )
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(order).print_stats(25)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
