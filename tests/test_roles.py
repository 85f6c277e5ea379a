"""The roles apart, served for real: `python -m app serve` runs engine processes and a front
whose workers hold no engine; engines die, stop, retire and come back; Redis goes down and
back; with no engine at all, every protocol answers 503 in its own form."""

from __future__ import annotations

import base64
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import requests
from PIL import Image

from app.embedded_redis import EmbeddedRedis
from app.engine_process import REPLACEMENT_WAIT_SECONDS
from app.ports import free_port, free_ports
from app.protocols.pipeline_stubs import pb2, pb2_grpc
from tests.conftest import CORPUS, PHOTOTEST, ROOT, SHORT, WORD_EN
from tests.fleet import wait_for
from tests.helpers import app_children, b64, front_workers_of, metric_sum

pytestmark = pytest.mark.deploy

TOKEN = "roles-test-token-0123456789"
BIG = CORPUS / "donut_document.png"  # 3024x4032: seconds of engine time on CPU
DISTINCT = [
    "paddleocr_word_ar_1.jpg", "paddleocr_word_ko_1.jpg", "paddleocr_word_ja_1.jpg",
    "paddleocr_word_ru_1.jpg", "paddleocr_casia_0.jpg", "mmocr_rec_1036169.jpg",
]  # fmt: skip


def variant(path: Path, n: int, folder: Path) -> Path:
    """``path``'s image with one pixel of its own: a fresh miss that reads the same."""
    image = Image.open(path).convert("RGB")
    image.putpixel((0, 0), (n % 256, n // 256 % 256, 7))
    out = folder / f"{path.stem}-{n}.png"
    image.save(out, "PNG")
    return out


def maps_paddle(pid: int) -> bool:
    return "libpaddle" in (Path("/proc") / str(pid) / "maps").read_text()


class Fleet:
    def __init__(self, proc: subprocess.Popen[str], port: int, engine_port: int) -> None:
        self.proc, self.base, self.engine_port = proc, f"http://127.0.0.1:{port}", engine_port
        self.output: list[str] = []

    def engines(self) -> list[int]:
        return app_children(self.proc.pid, "engine")

    def front_workers(self) -> list[int]:
        """The granian workers: children of the front's master (itself `app front`)."""
        return front_workers_of(self.proc.pid)

    def ocr(self, path: Path, **headers: str) -> requests.Response:
        body = {"image": b64(path.read_bytes())}
        return requests.post(f"{self.base}/v1/ocr", json=body, headers=headers, timeout=120)

    def computing(self) -> float:
        """Engine calls running now, in every process (the front's /metrics is the machine's)."""
        metrics = requests.get(f"{self.base}/metrics", timeout=10).text
        return metric_sum(metrics, "ocr_engine_calls_running")

    def tail(self) -> str:
        return "".join(self.output)[-3000:]


@contextmanager
def serve(tmp: Path, **overrides: str) -> Iterator[Fleet]:
    # The engines' two ports (one engine, its replacement) in a row from ENGINE_PORT.
    port, engine_port = free_port(), free_ports(2, consecutive=True)[0]
    unset = ("REDIS_URL", "PROMETHEUS_MULTIPROC_DIR")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(
        HOST="127.0.0.1", HTTP_PORT=str(port), GRPC_ENABLED="false", WEB_CONCURRENCY="2",
        ENGINE_PROCESSES="1", ENGINE_PORT=str(engine_port), ENGINE_TOKEN=TOKEN,
        OCR_WORK_DIR=str(tmp / "models"), DISPATCH_CLAIM_MS="2000", LOG_LEVEL="info",
    )  # fmt: skip
    env.update(overrides)
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "serve"], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    fleet = Fleet(proc, port, engine_port)
    reader = threading.Thread(target=lambda: fleet.output.extend(proc.stdout or []), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, "".join(fleet.output)[-3000:]
            assert time.monotonic() < deadline, "".join(fleet.output)[-3000:]
            try:
                if requests.get(f"{fleet.base}/readyz", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.3)
        yield fleet
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(5)
    assert proc.returncode == 0, "".join(fleet.output)[-3000:]


def texts(response: requests.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [line["text"] for line in response.json()["lines"]]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    """One `serve` for the tests below that share its settings (a fleet's start is an engine's
    load: seconds of CPU each); they leave it as they found it (an engine killed is replaced,
    stopped ones are continued), and run in this order."""
    with serve(tmp_path_factory.mktemp("roles"), ENGINE_DIRECT_MAX_INFLIGHT="1") as running:
        yield running


def _calls(fleet: Fleet) -> float:
    metrics = requests.get(f"{fleet.base}/metrics", timeout=5).text
    return metric_sum(metrics, "ocr_engine_calls_total", outcome="ok")


def test_fronts_never_load_paddle_and_engines_do(fleet, tmp_path):
    image, before = variant(WORD_EN, 1, tmp_path), _calls(fleet)
    first, again = fleet.ocr(image), fleet.ocr(image)
    assert first.headers["X-Cache"] == "MISS" and again.headers["X-Cache"] == "HIT"
    assert texts(first) == texts(again) and texts(first)
    workers = fleet.front_workers()
    engines = wait_for(lambda: fleet.engines() if len(fleet.engines()) == 1 else None, 60,
                       "one engine process", fleet.tail)  # fmt: skip
    assert len(workers) == 2
    assert not any(maps_paddle(pid) for pid in workers), "a front worker mapped libpaddle"
    assert all(maps_paddle(pid) for pid in engines)
    output = "".join(fleet.output)
    assert "1 front (2 workers" in output and "1 engine process (paddle" in output
    # The front's /metrics is the machine's: the engine's call is counted there.
    assert _calls(fleet) == before + 1


def test_direct_endpoint_is_guarded(fleet):
    url = f"http://127.0.0.1:{fleet.engine_port}/internal/v1/recognize"
    body = {"format": 1, "image": b64(SHORT.read_bytes()), "params": {}, "namespace": ""}
    assert requests.post(url, json=body, timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer not-the-token-at-all"}
    assert requests.post(url, json=body, headers=wrong, timeout=10).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    unknown = requests.post(url, json={**body, "format": 99}, headers=auth, timeout=10)
    assert unknown.status_code == 400 and "format" in unknown.json()["error"]["message"]
    huge = b"x" * (30 * 1024 * 1024)
    assert requests.post(url, data=huge, headers=auth, timeout=30).status_code == 413
    junk = {**body, "image": base64.b64encode(b"not an image").decode()}
    assert requests.post(url, json=junk, headers=auth, timeout=10).status_code == 400
    ok = requests.post(url, json=body, headers=auth, timeout=60)
    assert ok.status_code == 200 and "lines" in ok.json()["result"]
    # One call in flight at most: a second one meanwhile is refused at once.
    big = {**body, "image": b64(BIG.read_bytes())}
    answers = []
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(requests.post, url, json=big, headers=auth, timeout=120)
        while not running.done():
            answers.append(requests.post(url, json=body, headers=auth, timeout=30))
        answers.append(running.result())
    refused = [answer for answer in answers if answer.status_code == 503]
    assert refused and refused[0].headers["Retry-After"] == "1"
    assert {answer.status_code for answer in answers} == {200, 503}


def test_an_engine_killed_mid_computation_loses_no_miss(fleet):
    # The reference: the same image, computed through the direct path (no-store).
    reference = texts(fleet.ocr(BIG, **{"Cache-Control": "no-store"}))
    [engine] = fleet.engines()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(fleet.ocr, BIG)
        # Queued and taken: the engine is computing it (seconds of engine time).
        wait_for(lambda: fleet.computing() or waiting.done(), 120, "the engine computing",
                 fleet.tail)  # fmt: skip
        os.kill(engine, signal.SIGKILL)
        answer = waiting.result()
    assert texts(answer) == reference
    deadline = time.monotonic() + 60
    while not (fleet.engines() and fleet.engines() != [engine]):
        assert time.monotonic() < deadline, "no engine was started in its place"
        time.sleep(0.5)
    assert fleet.ocr(SHORT).status_code == 200 and "exited" in "".join(fleet.output)


def test_hits_go_on_while_every_engine_is_stopped(fleet):
    assert fleet.ocr(WORD_EN).status_code == 200
    engines = fleet.engines()
    for pid in engines:
        os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(len(DISTINCT)) as pool:
            misses = [pool.submit(fleet.ocr, CORPUS / name) for name in DISTINCT]
            time.sleep(1.0)
            hits = [fleet.ocr(WORD_EN) for _ in range(40)]
            assert all(not miss.done() for miss in misses)  # they wait for an engine
            for pid in engines:
                os.kill(pid, signal.SIGCONT)
            answers = [miss.result() for miss in misses]
    finally:
        for pid in engines:
            os.kill(pid, signal.SIGCONT)
    assert {hit.headers["X-Cache"] for hit in hits} == {"HIT"}
    assert all(texts(answer) is not None for answer in answers)


def test_engine_retires_and_is_replaced_without_a_gap(tmp_path):
    with serve(tmp_path, ENGINE_MAX_CALLS="2") as fleet:
        [first] = fleet.engines()
        statuses = [fleet.ocr(CORPUS / name).status_code for name in DISTINCT]
        deadline = time.monotonic() + REPLACEMENT_WAIT_SECONDS + 60  # a slow replacement's load
        while first in fleet.engines():
            assert time.monotonic() < deadline, "the engine never retired"
            statuses.append(fleet.ocr(SHORT, **{"Cache-Control": "no-cache"}).status_code)
        assert set(statuses) == {200}, "".join(fleet.output)[-6000:]  # what the fleet logged
        while len(fleet.engines()) != 1:  # a replacement that retired in turn, leaving
            assert time.monotonic() < deadline, fleet.engines()
            time.sleep(0.5)
        output = "".join(fleet.output)
        assert "(ENGINE_MAX_CALLS=2)" in output and "exited" not in output


def test_redis_down_sends_misses_straight_to_an_engine_then_the_queue_resumes(tmp_path):
    server = EmbeddedRedis().start()
    try:
        with serve(tmp_path, REDIS_URL=server.url, REDIS_BREAKER_COOLDOWN_SECONDS="1") as fleet:
            assert fleet.ocr(WORD_EN).headers["X-Cache"] == "MISS"
            server.stop()
            down = fleet.ocr(PHOTOTEST)
            assert down.status_code == 200 and down.headers["X-Cache"] == "MISS"
            assert texts(down)
            server = EmbeddedRedis(port=server.port).start()
            # The queue resumes once the front's breaker has cooled down and probed Redis
            # again and the engine has reported in to the new server: a fresh miss is then
            # computed through the queue (before that, straight by an engine).
            fresh = itertools.count()
            counter, outcome = "ocr_dispatch_tickets_total", "computed"

            def queued() -> bool:
                before = requests.get(f"{fleet.base}/metrics", timeout=5).text
                assert fleet.ocr(variant(SHORT, next(fresh), tmp_path)).status_code == 200
                after = requests.get(f"{fleet.base}/metrics", timeout=5).text
                return metric_sum(after, counter, outcome=outcome) > metric_sum(
                    before, counter, outcome=outcome
                )

            wait_for(queued, 120, "a miss computed through the queue again", fleet.tail)
    finally:
        server.cleanup()


def test_web_concurrency_alone_stops_serve_with_one_line():
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_PROCESSES"}
    env["WEB_CONCURRENCY"] = "4"
    done = subprocess.run(
        [sys.executable, "-m", "app", "serve"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "WEB_CONCURRENCY: now counts front workers only" in done.stderr
    assert "ENGINE_PROCESSES" in done.stderr


@pytest.fixture()
def front_without_engines(tmp_path) -> Iterator[tuple[str, int]]:
    """`python -m app front` alone, Redis down (nothing listens on its port), no engine
    process anywhere: the direct path, whose engine Service refuses every connection. (With
    Redis up a miss waits for an engine instead: tests/test_scale_to_zero.py.)"""
    port, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(
        HOST="127.0.0.1", HTTP_PORT=str(port), GRPC_PORT=str(grpc_port), WEB_CONCURRENCY="1",
        REDIS_URL=f"redis://127.0.0.1:{free_port()}/0", ENGINE_TOKEN=TOKEN,
        ENGINE_URLS=f"http://127.0.0.1:{free_port()}", OCR_WORK_DIR=str(tmp_path / "models"),
        CACHE_KEY_PREFIX=f"noengine{port}",
    )  # fmt: skip
    log = tmp_path / "front.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", "front"], cwd=ROOT, env=env, text=True,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            return requests.get(f"{base}/healthz", timeout=2).ok
        except requests.RequestException:
            return False

    try:
        wait_for(healthy, 90, "the front's /healthz", seen=lambda: log.read_text()[-4000:])
        yield base, grpc_port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_redis_down_and_no_engine_is_a_503_at_once_in_every_protocol(front_without_engines):
    """ENGINE_WAIT_SECONDS is 0 by default: no retry of engines that refuse the connection,
    a 503 with Retry-After now (the requests' 30 s timeouts bound a wait)."""
    base, grpc_port = front_without_engines
    data = b64(WORD_EN.read_bytes())
    rest = requests.post(f"{base}/v1/ocr", json={"image": data}, timeout=30)
    assert rest.status_code == 503 and rest.headers["Retry-After"]
    assert rest.json()["error"]["code"] == "engine_unavailable"
    pipeline = requests.post(
        f"{base}/ocr/prediction", json={"key": ["image"], "value": [data]}, timeout=30
    )
    assert pipeline.status_code == 503 and pipeline.json()["err_no"] != 0
    paddlex = requests.post(f"{base}/ocr", json={"file": data, "fileType": 1}, timeout=30)
    assert paddlex.status_code == 503 and paddlex.json()["errorCode"] == 503
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb2_grpc.PipelineServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.inference(pb2.Request(key=["image"], value=[data]), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # Nothing was cached, and hits still answer (none here): the front itself is healthy.
    assert requests.get(f"{base}/healthz", timeout=5).ok
