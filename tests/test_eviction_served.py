"""Issue 25: Redis at `maxmemory` with `allkeys-lru`, evicting while misses are in flight.

Reported against an earlier main: with a writer filling a 4 MB Redis, four clients sending 32
distinct small images had 4-6 of them wait the full 60 s (504 or a client time-out): leases
and the queue's keys are ordinary keys to the LRU. Here the served stack (`python -m app
serve`, two workers, one global miss queue) runs the same load while a writer fills Redis and,
every few writes, the queue's own keys (its stream and group, the engines set, the ticket
markers) are taken the way the LRU may take them. Every request must be answered 200 with
the engine's own lines (no 504: nobody waited to the deadline), and a failed or evicted
coordination key may cost a resubmission, never a wrong answer.
"""

from __future__ import annotations

import io
import os
import threading

import pytest
import redis
import requests
from PIL import Image

from app.embedded_redis import EmbeddedRedis
from app.ports import free_port
from tests.conftest import CORPUS, PHOTOTEST, SHORT, WORD_CH, WORD_EN
from tests.helpers import b64, metric_sum
from tests.test_serve import serving

pytestmark = pytest.mark.deploy

SOURCES = [PHOTOTEST, CORPUS / "paddleocr_casia_0.jpg", WORD_EN, WORD_CH, SHORT]


def _variant(i: int) -> bytes:
    image = Image.open(SOURCES[i % len(SOURCES)]).convert("RGB")
    image.putpixel((i % image.width, 0), (i * 7 % 256, 0, 0))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


@pytest.fixture
def lru_redis():
    args = ["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]
    with EmbeddedRedis(extra_args=args) as server:
        yield server.port, redis.Redis(port=server.port)


def test_misses_complete_while_redis_evicts_the_queue(lru_redis):
    port, filler = lru_redis
    images = [_variant(i) for i in range(32)]
    stop = threading.Event()
    taken = [0]

    def fill() -> None:
        n = 0
        while not stop.is_set():
            filler.set(f"filler:{n}", os.urandom(10_000))
            n += 1
            if n % 20 == 0:  # the queue's keys, taken as the LRU may take them
                keys = list(filler.scan_iter(match="*dispatch*", count=1000))
                if keys:
                    taken[0] += filler.unlink(*keys)

    overrides = {
        "HTTP_PORT": str(free_port()),
        "GRPC_PORT": str(free_port()),
        "REDIS_URL": f"redis://127.0.0.1:{port}/0",
        "WEB_CONCURRENCY": "2",
        "ENGINE_PROCESSES": "2",
        "OCR_TIMEOUT_SECONDS": "60",
        # A waiter checks its ticket at 1, 3, 7, 15 s (the service: every 16 s): this test
        # takes the queue's keys several times a second, far more often than an LRU takes
        # keys that every miss touches.
        "DISPATCH_CHECK_SECONDS": "1",
    }
    answers: dict[int, tuple[int, list[str] | str]] = {}
    with serving(overrides, stop_seconds=120) as (_, base):
        thread = threading.Thread(target=fill, daemon=True)
        thread.start()
        todo = list(range(len(images)))
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop()
                try:
                    resp = requests.post(
                        f"{base}/v1/ocr", json={"image": b64(images[i])}, timeout=90
                    )
                    body = resp.json() if resp.status_code == 200 else resp.text
                    answers[i] = (
                        resp.status_code,
                        body["lines"] if resp.status_code == 200 else body,
                    )
                except requests.RequestException as exc:
                    answers[i] = (0, repr(exc))

        clients = [threading.Thread(target=client) for _ in range(4)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        stop.set()
        thread.join()
        evicted = int(filler.info("stats")["evicted_keys"])
        # The truths: the same engine, recomputed, stored nowhere.
        truths = {}
        for i, data in enumerate(images):
            resp = requests.post(
                f"{base}/v1/ocr",
                json={"image": b64(data)},
                headers={"Cache-Control": "no-cache, no-store"},
                timeout=90,
            )
            truths[i] = resp.json()["lines"]
        metrics = requests.get(f"{base}/metrics", timeout=10).text
    failed = {i: a for i, a in answers.items() if a[0] != 200}
    assert not failed, failed
    assert evicted > 1000 and taken[0] > 0, (evicted, taken)
    texts = {i: [line["text"] for line in answers[i][1]] for i in answers}  # type: ignore[index]
    assert texts == {i: [line["text"] for line in truths[i]] for i in truths}
    calls = metric_sum(metrics, "ocr_engine_calls_total", outcome="ok")
    print(
        f"evicted {evicted}, queue keys taken {taken[0]}, engine calls {calls:.0f} "
        f"for {len(images)} images (+{len(images)} truths)"
    )
