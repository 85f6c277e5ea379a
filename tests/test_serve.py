"""The service as `make run` starts it: `python -m app serve` (the front under granian, 2 workers),
the private Redis started because REDIS_URL is unset, metrics summed over workers."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import requests

from app.engines.paddle import PaddleOcrEngine
from app.ports import free_port
from tests.conftest import ROOT, SHORT, WORD_CH, WORD_EN
from tests.helpers import app_children, b64, metric_sum
from tests.test_kserve import stock_clients

pytestmark = pytest.mark.deploy


def _wait_ready(base: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    streak = 0
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            streak = streak + 1 if requests.get(f"{base}/readyz", timeout=2).ok else 0
        except requests.RequestException:
            streak = 0
        if streak >= 6:  # several answers in a row: every worker has its engine loaded
            return
        time.sleep(0.5)
    raise AssertionError("service never became ready")


@contextmanager
def serving(
    overrides: dict[str, str], stop_seconds: float = 60, output: list[str] | None = None
) -> Iterator[tuple[object, str]]:
    """`python -m app serve` (its own process group) with ``overrides`` on the environment
    (``HTTP_PORT`` among them; no inherited metrics folder), once ready: (process, base URL).
    Then SIGTERM, and a clean stop: exit status 0, and no edge (nginx) that died under it;
    ``output`` gets everything it wrote (read at the end: keep it short).

    Redis gets 500 ms a command unless ``overrides`` say otherwise: the suite's other workers
    load this machine's two cores, and past the shipped 50 ms a busy Redis would look down
    (misses sent the direct way, refused past its in-flight bound) to tests of other things."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update({"REDIS_TIMEOUT_MS": "500", **overrides})
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "serve"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{overrides['HTTP_PORT']}"
    try:
        _wait_ready(base, proc)
        yield proc, base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            text, _ = proc.communicate(timeout=stop_seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
        if output is not None:
            output.append(text)
    assert proc.returncode == 0, text[-3000:]
    assert "nginx exited" not in text, text[-3000:]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _nice_of_threads(pid: int) -> set[int]:
    """The ``nice`` of every thread of ``pid`` (Linux keeps one per thread); a thread that
    ended meanwhile (a probe's request thread) is left out."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            found.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
    return found


def test_an_engine_computes_below_the_fronts():
    """ENGINE_NICE: every thread of an engine process (Paddle's, started by a miss, included)
    at that ``nice`` above the service's, the fronts' threads at the service's own."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    with serving({"HTTP_PORT": str(free_port()), "WEB_CONCURRENCY": "1", "ENGINE_PROCESSES": "1",
                  "GRPC_PORT": str(free_port()), "ENGINE_NICE": "7"}) as (proc, base):  # fmt: skip
        word = {"image": b64(WORD_EN.read_bytes())}
        resp = requests.post(f"{base}/v1/ocr", json=word, timeout=60)
        assert resp.status_code == 200  # the engine's inference threads started
        pid = proc.pid  # type: ignore[attr-defined]
        engines, fronts = app_children(pid, "engine"), app_children(pid, "front")
        assert len(engines) == 1 and len(fronts) == 1
        assert _nice_of_threads(engines[0]) == {min(own + 7, 19)}
        assert _nice_of_threads(fronts[0]) == {own}


def test_serve_two_workers_embedded_redis_and_graceful_stop(tmp_path):
    port, grpc_port = free_port(), free_port()
    env = {
        k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "PROMETHEUS_MULTIPROC_DIR")
    }
    env.update(
        HTTP_PORT=str(port),
        HOST="127.0.0.1",
        WEB_CONCURRENCY="2",
        ENGINE_PROCESSES="1",
        WEB_THREADS="4",
        OCR_WORK_DIR=str(tmp_path / "models"),
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "metrics"),
        GRPC_PORT=str(grpc_port),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "serve"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc)
        ready = requests.get(f"{base}/readyz", timeout=5).json()
        assert ready["redis"]["state"] == "up"  # the private Redis
        images = [WORD_EN.read_bytes(), WORD_CH.read_bytes(), SHORT.read_bytes()]
        session = requests.Session()
        statuses = []
        for _ in range(4):
            for data in images:
                resp = session.post(f"{base}/v1/ocr", json={"image": b64(data)}, timeout=60)
                assert resp.status_code == 200
                statuses.append(resp.headers["X-Cache"])
        assert statuses[:3] == ["MISS"] * 3 and set(statuses[3:]) == {"HIT"}
        metrics = requests.get(f"{base}/metrics", timeout=5).text
        assert metric_sum(metrics, "ocr_engine_calls_total") == 3
        assert metric_sum(metrics, "ocr_cache_requests_total") == 12
        assert metric_sum(metrics, "ocr_cache_requests_total", result="hit") == 9
        # The Open Inference Protocol as users reach it: HTTP through nginx and granian,
        # gRPC on GRPC_PORT, NVIDIA's stock clients; the entries the REST calls stored.
        word = base64.b64encode(WORD_EN.read_bytes()).decode()
        steps = [
            {"client": "http", "call": "ready"},
            {"client": "http", "call": "infer", "elements": [word]},
            {"client": "grpc-aio", "call": "infer", "elements": [word]},
            {"client": "grpc", "call": "hps", "payload": {"file": word, "fileType": 1}},
        ]
        ready, http_answer, grpc_answer, hps = stock_clients(
            f"127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", steps, tmp_path
        )
        assert ready["value"] is True and hps["value"]["errorCode"] == 0
        for answer in (http_answer, grpc_answer):
            assert json.loads(answer["value"]["elements"][0])["cache"] == "HIT", answer
        reference = session.post(f"{base}/ocr", json={"file": word, "fileType": 1}, timeout=60)
        assert {**hps["value"], "logId": ""} == {**reference.json(), "logId": ""}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    assert proc.returncode == 0, output
    assert "Termination signal" not in output, "paddle's SIGTERM handler must be off"
    assert "started a private Redis" in output
    redis_port = int(output.split("started a private Redis at redis://127.0.0.1:")[1].split("/")[0])
    assert not _port_open(redis_port), "the private Redis is stopped on exit"


def test_readyz_is_503_until_the_engine_is_loaded(make_app, base_settings):
    fresh = PaddleOcrEngine.from_settings(
        base_settings
    )  # not loaded: the app loads it in the background
    client = make_app(engine_override=fresh).test_client()
    first = client.get("/readyz")
    assert first.status_code == 503 and first.get_json()["engine"] == "loading"
    deadline = time.monotonic() + 120
    while client.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert client.get("/readyz").get_json()["engine"] == "ready"


def test_granian_cli_runs_the_front(tmp_path, redis_server):
    """granian's own CLI with the front's factory (docs/DEPLOYMENT.md) runs the same front:
    HTTP, gRPC from the worker, metrics summed through the multiprocess directory; its miss
    is computed by an engine process on the queue, as under `python -m app front`."""
    import grpc

    from app.protocols.pipeline_stubs import pb2, pb2_grpc

    port, grpc_port, engine_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    (tmp_path / "metrics").mkdir()
    env.update(
        HOST="127.0.0.1", HTTP_PORT=str(port), GRPC_PORT=str(grpc_port), WEB_CONCURRENCY="1",
        ENGINE_PROCESSES="1", ENGINE_PORT=str(engine_port),
        REDIS_URL=redis_server.url, OCR_WORK_DIR=str(tmp_path / "models"),
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "metrics"), CACHE_KEY_PREFIX="granian-cli",
    )  # fmt: skip
    engine = subprocess.Popen(
        [sys.executable, "-m", "app", "engine"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "granian", "--interface", "wsgi", "--factory",
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--blocking-threads", "8", "app.front_server:load_worker"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc)
        _wait_ready(f"http://127.0.0.1:{engine_port}", engine)  # its model loaded, in the queue
        data = WORD_EN.read_bytes()
        statuses = [
            requests.post(f"{base}/v1/ocr", json={"image": b64(data)}, timeout=60).headers[
                "X-Cache"
            ]
            for _ in range(2)
        ]
        assert statuses == ["MISS", "HIT"]
        stub = pb2_grpc.PipelineServiceStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        reply, call = stub.inference.with_call(
            pb2.Request(key=["image"], value=[b64(data)]), timeout=30
        )
        assert reply.err_no == 0 and dict(call.trailing_metadata())["x-cache"] == "HIT"
        metrics = requests.get(f"{base}/metrics", timeout=5).text
        assert metric_sum(metrics, "ocr_engine_calls_total") == 1  # the engine's, summed
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        engine.send_signal(signal.SIGTERM)
        engine.communicate(timeout=60)
    assert proc.returncode == 0, output
