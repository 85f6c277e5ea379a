"""`python -m bench.cold_start` (in `make bench`, issue 48): what a miss costs when the engines
have scaled to zero, on loopback with the real processes (tests/fleet.py).

A front runs alone on a private Redis. Each round, with no engine process anywhere: a miss is
sent, and once the front has queued it an engine process is started on it, as KEDA would
(without Prometheus' scrape and KEDA's poll, which DEPLOYMENT.md#scale-to-zero adds). It
measures the engine process's cold start (from its start to `/readyz` 200: the model
loaded, its feeders on the queue), the waiting miss's latency (from its request, and from the
engine's start, to its answer), and then a miss of the same image's kind on the engine now
warm. Images: variants of one page (one pixel changed: a key of its own, the same work).
Rounds are medians; the machine's load is recorded. Results: bench/results/cold_start.json.
"""

from __future__ import annotations

import base64
import io
import json
import os
import platform
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import requests
from PIL import Image

from app.embedded_redis import EmbeddedRedis
from tests.fleet import Fleet, wait_for

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("OCR_SHARED_DIR", ROOT.parent / "shared")) / "corpus"
RESULTS = ROOT / "bench" / "results"
PAGE = CORPUS / "tesseract_phototest.png"
ROUNDS = int(os.environ.get("BENCH_COLD_ROUNDS", "3"))


def variant(i: int) -> bytes:
    image = Image.open(PAGE).convert("RGB")
    image.putpixel((i, image.height - 1), (255, 255 - i, 255))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def ask(base: str, data: bytes) -> tuple[float, str]:
    """(the miss's latency, its X-Cache)."""
    began = time.monotonic()
    answer = requests.post(
        f"{base}/v1/ocr", json={"image": base64.b64encode(data).decode()}, timeout=300
    )
    assert answer.status_code == 200, answer.text
    return time.monotonic() - began, answer.headers.get("X-Cache", "")


def backlog(base: str) -> float:
    return float(requests.get(f"{base}/readyz", timeout=10).json()["queue"]["misses_waiting"])


def one_round(fleet: Fleet, i: int) -> dict[str, float]:
    front, engine = fleet.fronts[0], fleet.engines[0]
    answer: dict[str, object] = {}

    def waiting_miss() -> None:
        answer["latency"], answer["cache"] = ask(front.base, variant(2 * i))
        answer["at"] = time.monotonic()

    asked = threading.Thread(target=waiting_miss)
    sent = time.monotonic()
    asked.start()
    wait_for(lambda: backlog(front.base) >= 1, 60, "the miss queued", front.tail)
    started = time.monotonic()
    engine.start()
    wait_for(engine.ready, 240, "the engine ready", engine.tail)
    ready = time.monotonic()
    asked.join(300)
    assert answer.get("cache") == "MISS", answer
    warm, cache = ask(front.base, variant(2 * i + 1))
    assert cache == "MISS"
    engine.stop()
    wait_for(lambda: not engine.running(), 60, "the engine stopped")
    done = float(answer["at"])  # type: ignore[arg-type]
    return {
        "queued_before_start_s": round(started - sent, 3),
        "engine_cold_start_s": round(ready - started, 3),
        "miss_from_zero_s": round(float(answer["latency"]), 3),  # type: ignore[arg-type]
        "engine_start_to_answer_s": round(done - started, 3),
        "warm_miss_s": round(warm, 3),
    }


def main() -> None:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis() as redis_server:
        fleet = Fleet(Path(tmp), redis_server.url, fronts=1, engines=1, front_workers=1)
        front = fleet.fronts[0]
        front.start()
        try:
            front.wait_ready()
            queue = requests.get(f"{front.base}/readyz", timeout=10).json()["queue"]
            assert queue["engines_live"] == 0, queue  # no engine anywhere: scaled to zero
            rounds = [one_round(fleet, i) for i in range(ROUNDS)]
        finally:
            fleet.stop()
    medians = {key: round(statistics.median(r[key] for r in rounds), 3) for key in rounds[0]}
    result = {
        "what": "a miss with zero engines, an engine process started on it (KEDA's scrape and "
        "poll not included); an engine process's cold start; a miss on the warm engine",
        "image": PAGE.name,
        "rounds": rounds,
        "median": medians,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}",
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cold_start.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(medians, indent=2))


if __name__ == "__main__":
    main()
