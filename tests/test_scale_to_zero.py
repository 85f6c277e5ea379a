"""Scale to zero and back (issue 48): `python -m app front` with no engine process anywhere
stays ready, answers hits and queues misses in Redis; an engine process started seconds
later answers every one; with none ever started, each miss gets its protocol's timeout
answer at its deadline, never a hang. The backlog the fronts report (KEDA's figure) counts
every waiting miss, one held by an engine that was killed included, and returns to 0.
Everything is the real thing: the front (nginx, granian), `python -m app engine`, Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests

from app.ports import free_port
from app.protocols.pipeline_stubs import pb2, pb2_grpc
from tests.conftest import CORPUS, PHOTOTEST, ROOT, SHORT, WORD_CH, WORD_EN
from tests.fleet import wait_for
from tests.helpers import b64, metric_sum

pytestmark = pytest.mark.deploy

TOKEN = "scale-to-zero-test-token-0123456789"
BIG = CORPUS / "donut_document.png"  # 3024x4032: seconds of engine time on CPU


class Fleet:
    """A front alone on a private key prefix of the test's Redis, and the engine processes
    started for it."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.env = tmp, env
        self.base = f"http://127.0.0.1:{env['HTTP_PORT']}"
        self.grpc = f"127.0.0.1:{env['GRPC_PORT']}"
        self.engines: list[tuple[subprocess.Popen[str], Path]] = []

    def log(self) -> str:
        logs = [self.tmp / "front.log", *(path for _, path in self.engines)]
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())

    def start_engine(self) -> subprocess.Popen[str]:
        log = self.tmp / f"engine-{len(self.engines)}.log"
        env = {**self.env, "ENGINE_PORT": str(free_port())}
        with log.open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "app", "engine"], cwd=ROOT, env=env, text=True,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.engines.append((proc, log))
        return proc

    def readyz(self) -> requests.Response:
        return requests.get(f"{self.base}/readyz", timeout=10)

    def backlog(self) -> float | None:
        """The fronts' backlog of misses; None: not in the scrape (the read of Redis failed)."""
        text = requests.get(f"{self.base}/metrics", timeout=10).text
        if 'ocr_queue_backlog{kind="misses"}' not in text:
            return None
        return metric_sum(text, "ocr_queue_backlog", kind="misses")

    def queue(self) -> dict[str, Any]:
        """``/readyz``'s picture of the queue ({}: the read of Redis failed this time)."""
        return dict(self.readyz().json().get("queue") or {})

    def engines_live(self) -> int | None:
        return self.queue().get("engines_live")


@contextmanager
def fleet(tmp: Path, redis_url: str, **overrides: str) -> Iterator[Fleet]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(
        HOST="127.0.0.1", HTTP_PORT=str(port), GRPC_PORT=str(free_port()), WEB_CONCURRENCY="1",
        REDIS_URL=redis_url, ENGINE_TOKEN=TOKEN, ENGINE_WORKERS="1", DISPATCH_CLAIM_MS="2000",
        ENGINE_URLS=f"http://127.0.0.1:{free_port()}", OCR_WORK_DIR=str(tmp / "models"),
        CACHE_KEY_PREFIX=f"zero{port}", LOG_LEVEL="info",
        # A loaded machine's Redis can take longer than the 50 ms default without being down
        # (a submit that timed out went the direct way, to no engine: 503): as tests/test_serve.
        REDIS_TIMEOUT_MS="500",
    )  # fmt: skip
    env.update(overrides)
    running = Fleet(tmp, env)
    with (tmp / "front.log").open("w") as out:
        front = subprocess.Popen(
            [sys.executable, "-m", "app", "front"], cwd=ROOT, env=env, text=True,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def ready() -> bool:
        assert front.poll() is None, running.log()
        try:
            return running.readyz().ok
        except requests.RequestException:
            return False

    try:
        wait_for(ready, 90, "the front's /readyz", seen=running.log)
        yield running
    finally:
        for proc in [front, *(proc for proc, _ in running.engines)]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [front, *(proc for proc, _ in running.engines)]:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _ask(running: Fleet, protocol: str, image: Path) -> tuple[int, Any]:
    """One miss in ``protocol``: (HTTP status or 0 for gRPC, the answer's body)."""
    data = b64(image.read_bytes())
    if protocol == "grpc":
        with grpc.insecure_channel(running.grpc) as channel:
            reply = pb2_grpc.PipelineServiceStub(channel).inference(
                pb2.Request(key=["image"], value=[data]), timeout=300
            )
        return 0, reply
    path, body = {
        "rest": ("/v1/ocr", {"image": data}),
        "pipeline": ("/ocr/prediction", {"key": ["image"], "value": [data]}),
        "paddlex": ("/ocr", {"file": data, "fileType": 1}),
    }[protocol]
    answer = requests.post(f"{running.base}{path}", json=body, timeout=300)
    return answer.status_code, answer.json()


ASKED = {"rest": WORD_EN, "pipeline": SHORT, "paddlex": PHOTOTEST, "grpc": WORD_CH}


def test_misses_wait_for_an_engine_started_later(tmp_path, redis_server):
    with fleet(tmp_path, redis_server.url, OCR_TIMEOUT_SECONDS="100") as running:
        empty = {"engines_live": 0, "misses_waiting": 0, "jobs_waiting": 0,
                 "oldest_wait_seconds": 0.0}  # fmt: skip
        wait_for(lambda: running.queue() == empty, 30, "the queue read, empty", seen=running.log)
        with ThreadPoolExecutor(len(ASKED)) as pool:
            asked = {p: pool.submit(_ask, running, p, image) for p, image in ASKED.items()}
            wait_for(lambda: running.backlog() == len(ASKED), 60, "every miss queued",
                     seen=running.log)  # fmt: skip
            queue = wait_for(running.queue, 30, "the queue read")
            assert queue["misses_waiting"] == len(ASKED) and queue["oldest_wait_seconds"] > 0
            assert not any(future.done() for future in asked.values())  # they wait
            running.start_engine()
            answers = {p: future.result(timeout=240) for p, future in asked.items()}
        assert answers["rest"][0] == 200 and answers["rest"][1]["cache"] == "MISS"
        assert answers["pipeline"][0] == 200 and answers["pipeline"][1]["err_no"] == 0
        assert answers["paddlex"][0] == 200 and answers["paddlex"][1]["errorCode"] == 0
        assert answers["grpc"][1].err_no == 0
        wait_for(lambda: running.backlog() == 0, 30, "the backlog back to 0", seen=running.log)

        # The last engine is killed while it holds a ticket: the backlog still counts it, hits
        # go on with no engine, and the next engine to start answers the miss.
        [(engine, _)] = running.engines
        with ThreadPoolExecutor(1) as pool:
            held: Future = pool.submit(_ask, running, "rest", BIG)
            # Taken (seen in Redis, not from the busy engine: a reply from its own /metrics can
            # come late enough for the call to have ended), then frozen: it holds the ticket.
            wait_for(lambda: _taken(running), 120, "the engine took the ticket", seen=running.log)
            os.kill(engine.pid, signal.SIGSTOP)
            wait_for(lambda: _taken(running), 30, "the frozen engine still holds the ticket")
            assert not held.done(), running.log()
            os.kill(engine.pid, signal.SIGKILL)
            engine.wait(30)
            wait_for(lambda: running.engines_live() == 0, 60, "the dead engine out of the register")
            wait_for(lambda: running.backlog() == 1, 30, "the dead engine's ticket in the backlog")
            assert not held.done()
            hit = _ask(running, "rest", WORD_EN)
            assert hit[0] == 200 and hit[1]["cache"] == "HIT"  # hits need no engine
            assert running.readyz().status_code == 200
            running.start_engine()
            status, body = held.result(timeout=240)
        assert status == 200 and body["cache"] == "MISS"
        wait_for(lambda: running.backlog() == 0, 30, "the backlog back to 0", seen=running.log)


def _taken(running: Fleet) -> bool:
    """One miss in the queue, and an engine holds it (none waits to be taken)."""
    queue = running.queue()
    return queue.get("misses_waiting") == 1 and queue.get("oldest_wait_seconds") == 0


def test_with_no_engine_each_miss_times_out_at_its_deadline(tmp_path, redis_server):
    with fleet(tmp_path, redis_server.url, OCR_TIMEOUT_SECONDS="3") as running:
        with ThreadPoolExecutor(len(ASKED)) as pool:
            asked = {p: pool.submit(_ask, running, p, image) for p, image in ASKED.items()}
            answers = {p: future.result(timeout=120) for p, future in asked.items()}
        assert answers["rest"][0] == 504 and answers["rest"][1]["error"]["code"] == "engine_timeout"
        assert answers["pipeline"][1]["err_no"] == 6000
        assert answers["paddlex"][0] == 500 and answers["paddlex"][1]["errorCode"] == 500
        assert answers["grpc"][1].err_no == 6000
        wait_for(lambda: running.backlog() == 0, 30, "the timed-out tickets withdrawn")
        assert running.readyz().status_code == 200
