"""The image's entry point, run on this machine as the container runs it: docker/entrypoint.sh
(what the Dockerfile's ENTRYPOINT runs under tini) with its CMD and the ENV lines of
docker/Dockerfile, changing only what must differ here (ports, writable paths, the venv on PATH,
Redis), one worker to stay light. Checked over HTTP (through nginx, the edge, as in the image,
when this machine has one) and gRPC, then stopped with SIGTERM while requests are in flight:
every request gets its 200 and the process exits 0."""

from __future__ import annotations

import ast
import base64
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import requests

from app.edge import find_nginx
from app.embedded_redis import EmbeddedRedis
from app.ports import free_port
from tests import dockerfile
from tests.conftest import PHOTOTEST, ROOT, SHORT, WORD_EN

pytestmark = pytest.mark.deploy

DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
VENV_BIN = Path(sys.executable).parent


@dataclass
class Service:
    proc: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    env: dict[str, str]
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def service(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("entrypoint")
    env = dockerfile.env(DOCKERFILE)
    assert env["OCR_WORK_DIR"] and env["HOME"] and env["PROMETHEUS_MULTIPROC_DIR"]
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",  # `python` is the venv's
        HOME=str(tmp / "home"),
        OCR_WORK_DIR=str(tmp / "models"),
        PROMETHEUS_MULTIPROC_DIR=str(tmp / "metrics"),
        HTTP_PORT=str(free_port()),
        GRPC_PORT=str(free_port()),
        REDIS_URL=redis_server.url,
        WEB_CONCURRENCY="1",
        ENGINE_PROCESSES="1",
    )
    log = tmp / "service.log"
    with open(log, "wb") as out:
        # Started from elsewhere: the script must find the app by itself, as in the image.
        proc = subprocess.Popen(
            [str(ENTRYPOINT), *dockerfile.exec_form(DOCKERFILE, "CMD")],
            cwd=tmp,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, to clean up workers on failure
        )
    svc = Service(proc, int(env["HTTP_PORT"]), int(env["GRPC_PORT"]), env, log)
    try:
        _wait_ready(svc)
        yield svc
    finally:
        # Whatever is left of its process group (the workers too, if the master died first).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait_ready(svc: Service, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert svc.proc.poll() is None, svc.output()
        try:
            if requests.get(f"{svc.base}/readyz", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.25)
    raise AssertionError("the entry point never became ready:\n" + svc.output())


def _post(base: str, data: bytes, **headers: str) -> requests.Response:
    body = {"image": base64.b64encode(data).decode()}
    return requests.post(f"{base}/v1/ocr", json=body, headers=headers, timeout=60)


def test_http_with_the_image_env(service: Service, redis_client: redis.Redis) -> None:
    ready = requests.get(f"{service.base}/readyz", timeout=5).json()
    assert ready["engine"] == "ready" and ready["redis"]["state"] == "up"
    first, second = (
        _post(service.base, WORD_EN.read_bytes()),
        _post(service.base, WORD_EN.read_bytes()),
    )
    assert (first.status_code, second.status_code) == (200, 200)
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("MISS", "HIT")
    if find_nginx():  # as in the image (which installs it: tests/test_deploy.py)
        for answer in (first, second):
            assert answer.headers["Server"] == "nginx" and answer.headers["X-Request-Id"]
    metrics = requests.get(f"{service.base}/metrics", timeout=5)
    assert "ocr_cache_requests_total" in metrics.text
    # The image's HEALTHCHECK command, with the same env.
    check = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "healthcheck.py")],
        env=service.env,
        capture_output=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stderr


def test_grpc_with_the_image_env(service: Service) -> None:
    if importlib.util.find_spec("app.grpc_server") is None:
        pytest.skip("gRPC check added with the gRPC server")
    _check_grpc(service.grpc_port, service.base)


def _check_grpc(port: int, http_base: str) -> None:
    """PipelineService/inference on GRPC_PORT, as PaddleOCR's clients send it; the result is
    cached across protocols (the HTTP call that follows is a HIT)."""
    import grpc

    method = "/baidu.paddle_serving.pipeline_serving.PipelineService/inference"
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        call = channel.unary_unary(method)  # raw bytes: no dependency on generated stubs
        image = base64.b64encode(SHORT.read_bytes())
        request = _pb_field(1, b"image") + _pb_field(2, image)  # key, value
        reply, info = call.with_call(request, timeout=60)
    fields = _pb_parse(reply)
    assert fields.get(1, [0])[0] == 0, fields  # err_no
    assert fields[3] == [b"result"]
    assert isinstance(ast.literal_eval(fields[4][0].decode()), list)
    assert dict(info.trailing_metadata())["x-cache"] in ("MISS", "HIT", "COALESCED")
    assert _post(http_base, SHORT.read_bytes()).headers["X-Cache"] == "HIT"


def _pb_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _pb_field(number: int, data: bytes) -> bytes:
    """A length-delimited protobuf field (strings, bytes)."""
    return _pb_varint(number << 3 | 2) + _pb_varint(len(data)) + data


def _pb_parse(data: bytes) -> dict[int, list]:
    """Field number -> values: ints for varints, bytes for length-delimited fields."""
    fields: dict[int, list] = {}
    pos = 0

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while pos < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            value: object = varint()
        elif wire == 2:
            size = varint()
            value, pos = data[pos : pos + size], pos + size
        else:  # fixed64 / fixed32: not in this message's fields we read
            size = 8 if wire == 1 else 4
            value, pos = data[pos : pos + size], pos + size
        fields.setdefault(number, []).append(value)
    return fields


@dataclass
class _Load:
    """Clients posting uncached OCR requests until told to stop; every outcome recorded."""

    base: str
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: list[float] = field(default_factory=list)
    results: list[tuple[float, float, object]] = field(default_factory=list)  # start, end, status

    def client(self) -> None:
        data = PHOTOTEST.read_bytes()
        while True:
            with self.lock:  # no request starts once stop is set
                if self.stop.is_set():
                    return
                begun = time.monotonic()
                self.started.append(begun)
            status: object
            try:
                # no-cache: recompute every time, so requests are slow enough to be in flight.
                status = _post(self.base, data, **{"Cache-Control": "no-cache"}).status_code
            except requests.RequestException as exc:
                status = repr(exc)
            with self.lock:
                self.results.append((begun, time.monotonic(), status))

    def running(self) -> list[float]:
        """Start times of the requests still waiting for their response."""
        with self.lock:
            done = {start for start, _, _ in self.results}
            return [s for s in self.started if s not in done]


def test_sigterm_finishes_in_flight_requests_and_exits_zero(service: Service) -> None:
    load = _Load(service.base)
    clients = [threading.Thread(target=load.client, daemon=True) for _ in range(3)]
    for thread in clients:
        thread.start()
    deadline = time.monotonic() + 60
    while len(load.results) < 3:  # warmed up: the engine has answered a few
        assert time.monotonic() < deadline, load.results
        time.sleep(0.05)
    with load.lock:
        load.stop.set()
    # Signal once the last requests have surely reached the server, while some still run.
    time.sleep(0.3)
    assert load.running(), "the requests finished too fast to be in flight"
    signalled = time.monotonic()
    service.proc.send_signal(signal.SIGTERM)
    for thread in clients:
        thread.join(timeout=120)
    try:
        code = service.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("no exit after SIGTERM:\n" + service.output()) from None
    statuses = [status for _, _, status in load.results]
    assert statuses and all(s == 200 for s in statuses), statuses
    spanning = [r for r in load.results if r[0] < signalled < r[1]]
    assert spanning, "no request was in flight at SIGTERM"
    assert code == 0, service.output()
