"""Single-flight across workers and instances, end to end: real `python -m app serve`
instances (granian, 2 workers each) sharing one Redis server, as in production."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from app.config import Settings
from app.embedded_redis import EmbeddedRedis
from app.ports import free_port
from tests.conftest import CORPUS, ROOT
from tests.helpers import b64, metric_sum

pytestmark = [pytest.mark.deploy, pytest.mark.slow]

SMALL = [
    "paddleocr_word_en_1.png", "paddleocr_word_ch_4.jpg", "paddleocr_word_ar_1.jpg",
    "paddleocr_word_ko_1.jpg", "paddleocr_word_ja_1.jpg", "paddleocr_word_ru_1.jpg",
    "rapidocr_short.png", "paddleocr_casia_0.jpg",
]  # fmt: skip


class Instance:
    def __init__(self, redis_url: str, tmp, workers: int, **env: str) -> None:  # type: ignore[no-untyped-def]
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        full = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        full.update(
            HOST="127.0.0.1", HTTP_PORT=str(self.port), REDIS_URL=redis_url,
            WEB_CONCURRENCY=str(workers),
            ENGINE_PROCESSES=str(workers), WEB_THREADS="8", GRPC_ENABLED="false",
            OCR_WORK_DIR=str(tmp / "models"),
            PROMETHEUS_MULTIPROC_DIR=str(tmp / f"metrics-{self.port}"),
            LOG_LEVEL="warning", REQUEST_TIMEOUT_SECONDS="60",
            # 2 shared cores run 4-5 workers and 32 client threads here: a Redis answer can
            # take longer than the 50 ms default without Redis being down.
            REDIS_TIMEOUT_MS="250", **env,
        )  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app", "serve"], cwd=ROOT, env=full, start_new_session=True
        )
        self.workers = workers

    def wait_ready(self, timeout: float = 180) -> None:
        deadline, streak = time.monotonic() + timeout, 0
        while streak < 3 * self.workers:
            assert self.proc.poll() is None, "instance died"
            assert time.monotonic() < deadline, "instance never became ready"
            try:
                streak = streak + 1 if requests.get(f"{self.base}/readyz", timeout=2).ok else 0
            except requests.RequestException:
                streak = 0
            time.sleep(0.3)

    def engine_calls(self) -> float:
        return metric_sum(requests.get(f"{self.base}/metrics").text, "ocr_engine_calls_total")

    def ocr(self, data: bytes) -> requests.Response:
        return requests.post(f"{self.base}/v1/ocr", json={"image": b64(data)}, timeout=120)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """``sig`` to the whole group, then the supervisor's own bound on a graceful stop:
        the front's (REQUEST_TIMEOUT_SECONDS + 5), then the engines' (OCR_TIMEOUT_SECONDS +
        10). A stop past it fails, the group killed."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            settings = Settings.from_env({"REQUEST_TIMEOUT_SECONDS": "60"})
            bound = (
                settings.server.request_timeout_seconds + 5 + settings.engine.timeout_seconds + 10
            )
            started = time.monotonic()
            try:
                self.proc.wait(bound)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                raise AssertionError(
                    f"serve did not stop within its own bound, {bound:.0f} s"
                ) from None
            took = time.monotonic() - started
            print(f"instance on {self.port} stopped in {took:.1f} s (bound {bound:.0f} s)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("scale")
    with EmbeddedRedis() as server:
        instances = [Instance(server.url, tmp, workers=2) for _ in range(2)]
        try:
            for instance in instances:
                instance.wait_ready()
            yield server, instances, tmp
        finally:
            for instance in instances:
                instance.stop()


def total_calls(instances) -> float:  # type: ignore[no-untyped-def]
    return sum(i.engine_calls() for i in instances)


def test_32_identical_cold_requests_one_engine_call(cluster):
    _, instances, _ = cluster
    data = (CORPUS / "tesseract_phototest.png").read_bytes()
    before = total_calls(instances)
    barrier = threading.Barrier(32)

    def one(i: int):  # type: ignore[no-untyped-def]
        barrier.wait()
        resp = instances[i % 2].ocr(data)
        return resp.status_code, resp.headers["X-Cache"], resp.json()["lines"]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert total_calls(instances) - before == 1
    assert [r[0] for r in results] == [200] * 32
    assert all(r[2] == results[0][2] for r in results) and results[0][2]
    statuses = [r[1] for r in results]
    assert statuses.count("MISS") == 1 and set(statuses) <= {"MISS", "COALESCED", "HIT"}


def test_trace_with_repeats_computes_each_distinct_image_once(cluster):
    _, instances, _ = cluster
    trace = SMALL + SMALL[:6]  # 14 requests, 8 distinct: 43 % repeats
    random.Random(7).shuffle(trace)
    before = total_calls(instances)

    def one(item):  # type: ignore[no-untyped-def]
        i, name = item
        return instances[i % 2].ocr((CORPUS / name).read_bytes()).status_code

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, enumerate(trace))) == [200] * len(trace)
    assert total_calls(instances) - before == len(set(trace))


def test_an_idle_engine_of_another_instance_takes_a_miss(cluster):
    """Global miss dispatch (issue 14): three distinct cold pages sent at once to one
    instance (two engines) are computed on three engines: the other instance's idle engine
    takes the one this instance's busy engines would have queued."""
    _, instances, _ = cluster
    names = ("sroie_000.jpg", "paddleocr_doc_00006737.jpg", "paddleocr_doc_00009282.jpg")
    images = [(CORPUS / name).read_bytes() for name in names]
    before = [i.engine_calls() for i in instances]
    barrier = threading.Barrier(len(images))

    def one(data: bytes) -> requests.Response:
        barrier.wait()
        return instances[0].ocr(data)

    with ThreadPoolExecutor(len(images)) as pool:
        responses = list(pool.map(one, images))
    assert [(r.status_code, r.headers["X-Cache"]) for r in responses] == [(200, "MISS")] * 3
    calls = [i.engine_calls() - b for i, b in zip(instances, before, strict=True)]
    assert sum(calls) == 3 and calls[1] >= 1, calls


def test_colliding_pairs_never_cross_between_instances(cluster):
    """Issue 11 §1: two images with one MD5, sent at once to 2 instances x 2 workers, over
    REST and PaddleX, each round a fresh pair: every answer is its own image's."""
    from tests.md5_collisions import at_once, colliding_jpegs

    _, instances, _ = cluster
    first = (CORPUS / "mmocr_rec_1036169.jpg").read_bytes()
    second = (CORPUS / "paddleocr_word_ru_1.jpg").read_bytes()

    def answer(i: int, data: bytes):  # type: ignore[no-untyped-def]
        base = instances[i % 2].base
        if i % 4 < 2:
            resp = requests.post(f"{base}/v1/ocr", json={"image": b64(data)}, timeout=120)
            assert resp.status_code == 200, resp.text
            return resp.json()["width"], resp.json()["lines"]
        resp = requests.post(f"{base}/ocr", json={"file": b64(data), "fileType": 1}, timeout=120)
        assert resp.status_code == 200, resp.text
        pruned = resp.json()["result"]["ocrResults"][0]["prunedResult"]
        return resp.json()["result"]["dataInfo"]["width"], pruned["rec_texts"]

    expected = {src: [answer(i, src) for i in range(4)] for src in (first, second)}
    assert expected[first] != expected[second]

    def right(job: tuple[int, bytes, bytes]) -> bool:
        where, data, source = job  # where: instance (even/odd) and protocol (by pairs)
        return answer(where, data) == expected[source][where % 4]

    wrong = 0
    for r in range(6):
        a, b = colliding_jpegs(first, second, nonce=f"scale{r}".encode())
        pairs = [(a, first), (b, second)] * 8  # each image over both instances and protocols
        wrong += at_once(right, [(i // 2, data, src) for i, (data, src) in enumerate(pairs)])
    assert wrong == 0


def test_a_killed_engines_ticket_is_taken_over(tmp_path):
    """The only engine computing a miss dies (SIGKILL, master and worker, mid-computation):
    an engine of another instance claims its ticket once it has been idle DISPATCH_CLAIM_MS,
    computes it once, and a request there is answered from it. Own Redis: no other engine
    may take the ticket first."""
    import redis

    data = (CORPUS / "sroie_019.jpg").read_bytes()  # a receipt: seconds of engine time
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        # A 3 s claim window here alone: shared, busy instances on a slow host missed it
        # (a heartbeat late, a ticket claimed from a live engine and computed twice).
        claim = {"DISPATCH_CLAIM_MS": "3000"}
        owner = Instance(server.url, tmp_path, workers=1, OCR_TIMEOUT_SECONDS="600", **claim)
        heir = None
        try:
            owner.wait_ready()
            threading.Thread(target=lambda: _quiet(owner.ocr, data), daemon=True).start()
            deadline = time.monotonic() + 60
            while not _pending(client):
                assert time.monotonic() < deadline, "the owner's engine never took the ticket"
                time.sleep(0.01)
            owner.stop(signal.SIGKILL)
            heir = Instance(server.url, tmp_path, workers=1, **claim)
            heir.wait_ready()
            resp = heir.ocr(data)
            assert resp.status_code == 200 and resp.json()["lines"]
            assert resp.headers["X-Cache"] in ("HIT", "COALESCED")  # the ticket, not a new one
            metrics = requests.get(f"{heir.base}/metrics").text
            assert metric_sum(metrics, "ocr_dispatch_tickets_total", outcome="reclaimed") == 1
            assert heir.engine_calls() == 1
        finally:
            owner.stop(signal.SIGKILL)
            if heir is not None:
                heir.stop()


def _pending(client) -> int:  # type: ignore[no-untyped-def]
    """Tickets read by an engine and not finished, over every queue."""
    import redis

    total = 0
    for stream in client.scan_iter(match="*:jobs:*"):
        try:
            total += client.xpending(stream, "engines")["pending"]
        except redis.ResponseError:  # no group yet
            pass
    return total


def _quiet(fn, *args):  # type: ignore[no-untyped-def]
    try:
        fn(*args)
    except requests.RequestException:
        pass  # the owner is killed on purpose
