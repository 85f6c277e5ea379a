"""Issue 40's cost in-process: the same L2 hit through the WSGI app called directly
(``bench/profile_hit.py``'s way, L1 off), tracing off and on in turns; microseconds of wall and
of this process's CPU per hit. Its own module: paddle must load before grpcio (which the
served bench's helpers import), or libpaddle's start can abort.

    python -m bench.tracing_inprocess   # -> bench/results/tracing.json, "in_process"
"""

from __future__ import annotations

import base64
import json
import os
import time

import paddle  # noqa: F401, I001  (before grpcio, as in the service)

from app import tracing
from app.config import Settings
from app.embedded_redis import EmbeddedRedis
from app.engines.paddle import PaddleOcrEngine
from app.web import create_app
from bench.profile_hit import environ
from bench.tracing import CORPUS, IMAGE, OUT
from tests.otlp_receiver import Receiver


def in_process(hits: int = 1000, rounds: int = 3) -> dict:
    """The same L2 hit through the WSGI app called directly (``bench/profile_hit.py``'s way,
    L1 off), tracing off and on in turns: microseconds of wall and of this process's CPU per
    hit (the batch processor's export thread included)."""
    receiver = Receiver(decode=False)
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint  # the SDK reads its own
    body = json.dumps({"image": base64.b64encode((CORPUS / IMAGE).read_bytes()).decode()})
    engine = PaddleOcrEngine.from_settings(Settings.from_env({}))
    engine.load()
    per_hit: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    with EmbeddedRedis() as server:
        settings = Settings.from_env({"REDIS_URL": server.url, "CACHE_L1_BYTES": "0"})
        app = create_app(settings, engine).wsgi_app

        def hit() -> None:
            b"".join(app(environ(body.encode()), lambda status, headers, exc=None: None))

        hit()  # the miss that stores the entry
        tracers = {"off": tracing.TRACER, "on": tracing.setup("front")}
        for _ in range(rounds):
            for name, tracer in tracers.items():
                tracing.TRACER = tracer
                for _ in range(100):
                    hit()
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(hits):
                    hit()
                per_hit[name].append(((time.perf_counter() - wall) / hits * 1e6,
                                      (time.process_time() - cpu) / hits * 1e6))  # fmt: skip
        tracers["on"].shutdown()
    receiver.close()
    result = {
        name: {"wall_us": round(min(w for w, _ in runs)), "cpu_us": round(min(c for _, c in runs))}
        for name, runs in per_hit.items()
    }
    report = json.loads(OUT.read_text()) if OUT.exists() else {}
    report["in_process"] = {"image": IMAGE, "hits_per_round": hits, "rounds": rounds,
                            "best_of_rounds": result}  # fmt: skip
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["in_process"], indent=2))
    return report


if __name__ == "__main__":
    in_process()
