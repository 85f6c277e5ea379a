"""The front's server (granian, app/front_server.py) keeps what gunicorn did for the front:
a crashed worker is replaced and its live gauges dropped, a hung worker is killed and
replaced, a worker over its memory bound is replaced, keep-alive outlasts nginx's, no
forwarded header is trusted, its own lines are JSON, nginx starts only once a worker listens,
its allocators set to give back what large bodies freed (measured by bench/front_memory.py),
and each worker's startup heap is frozen out of the garbage collector's full collections."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from app.config import Settings
from app.edge import UPSTREAM_KEEPALIVE_SECONDS, render
from app.front_server import Watchdog, server_options
from app.memory import FRONT_ALLOCATORS
from app.ports import free_port
from tests.conftest import ROOT
from tests.fleet import wait_for
from tests.helpers import alive, app_children

pytestmark = pytest.mark.deploy

TOKEN = "front-server-test-token-0123"


class Front:
    """`python -m app front` (nginx at the edge, 2 workers, no engine), its output in a file."""

    def __init__(self, tmp: Path, redis_url: str, **extra: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.metrics = tmp / "metrics"
        self.log = tmp / "front.log"
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        env.update(
            HOST="127.0.0.1", HTTP_PORT=str(self.port), GRPC_PORT=str(free_port()),
            WEB_CONCURRENCY="2", REDIS_URL=redis_url, ENGINE_TOKEN=TOKEN,
            ENGINE_URLS=f"http://127.0.0.1:{free_port()}", ENGINE_WAIT_SECONDS="1",
            OCR_WORK_DIR=str(tmp / "models"), PROMETHEUS_MULTIPROC_DIR=str(self.metrics),
            CACHE_KEY_PREFIX=f"front{self.port}", LOG_FORMAT="json", **extra,
        )  # fmt: skip
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app", "front"], cwd=ROOT, env=env,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            wait_for(self.answers, 90, "the front answers /healthz", self.tail)
            # Both workers loaded (one still loading when a stop comes is ended, not drained).
            wait_for(lambda: self.output().count("Started worker-") >= 2, 60,
                     "both workers started", self.tail)  # fmt: skip
        except AssertionError:  # never up: ended here (the fixture stops only those that were)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self) -> str:
        """The end of what it wrote, for a failure's message."""
        return self.output()[-3000:]

    def answers(self, timeout: float = 2) -> bool:
        try:
            return requests.get(f"{self.base}/healthz", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def workers(self) -> list[int]:
        """The server's worker processes: its children running the front (not nginx)."""
        return app_children(self.proc.pid, "front")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()


@pytest.fixture()
def front_factory(tmp_path: Path, redis_server: Any) -> Iterator[Callable[..., Front]]:
    started: list[Front] = []

    def start(**extra: str) -> Front:
        front = Front(tmp_path, redis_server.url, **extra)
        started.append(front)
        return front

    yield start
    for front in started:
        front.stop()


def test_a_killed_worker_is_replaced_and_its_live_gauges_dropped(front_factory):
    front = front_factory()
    workers = wait_for(lambda: len(front.workers()) == 2 and front.workers(), 120,
                       "two workers", front.tail)  # fmt: skip
    victim = workers[0]
    assert any(f"_{victim}.db" in p.name for p in front.metrics.iterdir())
    os.kill(victim, signal.SIGKILL)
    replaced = wait_for(
        lambda: len(front.workers()) == 2 and victim not in front.workers() and front.workers(),
        120, "the killed worker replaced", front.tail,
    )  # fmt: skip
    assert workers[1] in replaced  # the other one served on
    # Its live gauges are gone from the folder (mark_process_dead); its counters stay summed.
    wait_for(
        lambda: not any("live" in p.name and f"_{victim}.db" in p.name
                        for p in front.metrics.iterdir()),
        60, "the dead worker's live gauges removed", front.tail,
    )  # fmt: skip
    assert all(front.answers() for _ in range(6))
    assert front.stop() == 0, front.tail()


def test_a_hung_worker_is_killed_and_replaced(front_factory):
    """A worker whose interpreter is stuck (here: stopped) sends no heartbeat: after
    FRONT_HUNG_SECONDS the server kills it and starts another, as gunicorn's timeout did."""
    front = front_factory(FRONT_HUNG_SECONDS="3")
    workers = wait_for(lambda: len(front.workers()) == 2 and front.workers(), 120,
                       "two workers", front.tail)  # fmt: skip
    hung = workers[0]
    os.kill(hung, signal.SIGSTOP)
    wait_for(lambda: not alive(hung), 120, "the stopped worker killed", front.tail)
    wait_for(lambda: len(front.workers()) == 2, 120, "a replacement started", front.tail)
    assert "sent no heartbeat" in front.output()
    assert all(front.answers() for _ in range(6))
    assert front.stop() == 0, front.tail()


def _stop_a_respawn_before_it_loads(front: Front) -> int:
    """A worker killed, and its replacement stopped (``SIGSTOP``) before it wrote its first
    heartbeat, as a fork that waits forever on a lock another thread held would: its pid.
    The replacement loads in a fraction of a second at most; a try that comes too late
    lets it go on and kills another."""
    first = wait_for(lambda: len(front.workers()) == 2 and front.workers(), 120,
                     "two workers", front.tail)[0]  # fmt: skip
    # The server's heartbeat folder (a private one under the temporary folder).
    beat = wait_for(lambda: list(Path(tempfile.gettempdir()).glob(f"ocr-front-beats-*/{first}")),
                    60, "the worker's heartbeat", front.tail)[0]  # fmt: skip
    beats = beat.parent
    for _ in range(5):
        before = set(wait_for(lambda: len(front.workers()) == 2 and front.workers(), 120,
                              "two workers", front.tail))  # fmt: skip
        victim = sorted(before)[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (fresh := set(front.workers()) - before):
            assert time.monotonic() < deadline, front.tail()
            time.sleep(0.002)
        [worker] = fresh
        os.kill(worker, signal.SIGSTOP)
        if not (beats / str(worker)).exists():
            return worker
        os.kill(worker, signal.SIGCONT)  # it had loaded: another try
    raise AssertionError("no replacement caught before it loaded in 5 tries")


def test_a_worker_that_never_loads_is_killed_and_replaced(front_factory):
    """The watchdog's other half: a worker with no heartbeat yet, FRONT_HUNG_SECONDS after
    its start, is killed too (granian starts another)."""
    front = front_factory(FRONT_HUNG_SECONDS="4")
    stuck = _stop_a_respawn_before_it_loads(front)
    wait_for(lambda: not alive(stuck), 60, "the worker that never loaded killed", front.tail)
    assert f"front worker {stuck} did not load" in front.output()
    wait_for(lambda: len(front.workers()) == 2, 120, "a replacement started", front.tail)
    assert all(front.answers() for _ in range(6))
    assert front.stop() == 0, front.tail()


def test_a_worker_loading_slowly_is_left_to_load(tmp_path):
    """The watchdog kills a worker that has not loaded only once it used no CPU for its
    bound (a fork waiting forever on a lock); one that loads slowly on a starved host goes
    on (both first workers killed mid-load left a front with none)."""
    stuck = subprocess.Popen(["sleep", "120"])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    watchdog = Watchdog(tmp_path, hung_after=1.0, load_bound=3.0,
                        workers=lambda: [(stuck.pid, 0.0), (busy.pid, 0.0)])  # fmt: skip
    try:
        ended = time.monotonic() + 5
        while time.monotonic() < ended:
            watchdog.check()
            time.sleep(0.5)
        assert stuck.wait(10) == -signal.SIGKILL
        assert busy.poll() is None  # loading (using CPU), not killed
    finally:
        for proc in (stuck, busy):
            proc.kill()
            proc.wait()


def test_a_stop_does_not_wait_for_a_worker_still_loading(front_factory):
    """A stop that finds a worker still loading kills it (it holds no request) rather than
    give it granian's kill timeout (REQUEST_TIMEOUT_SECONDS, 120 s: past the test's 60)."""
    front = front_factory()
    stuck = _stop_a_respawn_before_it_loads(front)
    began = time.monotonic()
    assert front.stop() == 0, front.tail()
    assert time.monotonic() - began < 60 and not alive(stuck)
    assert f"front worker {stuck} stopped before it had loaded: killed" in front.output()


def test_a_worker_over_its_memory_bound_is_replaced(front_factory):
    """FRONT_MAX_RSS_MB: a worker over it (here every worker: 1 MB) is replaced, its
    successor started first: the front answers throughout."""
    front = front_factory(FRONT_MAX_RSS_MB="1")
    first = set(wait_for(lambda: len(front.workers()) == 2 and front.workers(), 120,
                         "two workers", front.tail))  # fmt: skip
    deadline = time.monotonic() + 120
    while not first.isdisjoint(front.workers()) or len(front.workers()) < 2:
        assert time.monotonic() < deadline, front.tail()
        # Answered throughout; in time for a machine whose cores start a worker meanwhile.
        assert front.answers(timeout=15), front.tail()
        time.sleep(0.5)
    assert front.stop() == 0, front.tail()


def test_the_server_log_lines_are_json_and_nginx_started_after_a_worker_listened(front_factory):
    front = front_factory(MALLOC_ARENA_MAX="4")  # the operator's own allocator setting
    # The workers run with the front's allocator settings, an operator's own value kept
    # (allocators read them once, as the process starts: the front starts itself again).
    for pid in front.workers() + [front.proc.pid]:
        environ = dict(
            entry.split(b"=", 1) for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if b"=" in entry
        )  # fmt: skip
        assert environ[b"MALLOC_ARENA_MAX"] == b"4", pid
        assert environ[b"_RJEM_MALLOC_CONF"] == FRONT_ALLOCATORS["_RJEM_MALLOC_CONF"].encode()
    assert front.stop() == 0
    lines = [json.loads(line) for line in front.output().splitlines() if line.startswith('{"')]
    ours = [line for line in lines if line.get("logger", "").startswith("_granian")]
    assert any("Spawning worker" in line["message"] for line in ours), front.tail()
    assert not any(line.startswith("[INFO]") for line in front.output().splitlines())
    assert "seems quite high" not in front.output()  # the thread-count warning is dropped
    # Each worker ran its exit (gRPC, cache, L3, traces) after its graceful stop.
    stopped = [line for line in lines if "stopped: gRPC, the cache" in line.get("message", "")]
    assert len(stopped) == 2, front.tail()
    # No request reached nginx before a worker listened: none was refused (a 502).
    assert "Connection refused" not in front.output()


def test_keep_alive_outlasts_nginx_upstream_connections():
    """granian closes an idle connection after its header read timeout; nginx must close its
    upstream connections first, or it may send a POST on one being closed."""
    settings = Settings.from_env({})
    http1 = server_options(settings, "/tmp/x.sock")["http1_settings"]
    assert http1.keep_alive and http1.header_read_timeout / 1000 > UPSTREAM_KEEPALIVE_SECONDS
    config = render(settings, "/tmp/x.sock", "/tmp/run", ())
    assert f"keepalive_timeout {UPSTREAM_KEEPALIVE_SECONDS}s;" in config


def report_environ(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    """The WSGI environ's routing and scheme keys, as the front's server builds them."""
    keys = ("wsgi.url_scheme", "SCRIPT_NAME", "PATH_INFO", "REMOTE_ADDR", "HTTP_HOST")
    start_response("200 OK", [("Content-Type", "application/json")])
    return [json.dumps({k: environ.get(k) for k in keys}).encode()]


def test_the_server_trusts_no_forwarded_header(tmp_path):
    """With the front's own server options on its unix socket: a client's forwarding, scheme
    or script-name headers change nothing in the environ (nginx is the only one that sets
    the client's address, in X-Forwarded-For, app/protocols/trust.py)."""
    sock = tmp_path / "front.sock"
    code = (
        "from app.config import Settings; from app.front_server import server_options; "
        "from granian.server.mp import MPServer; "
        f"o = server_options(Settings.from_env({{'WEB_CONCURRENCY': '1'}}), {str(sock)!r}); "
        "o['target'] = 'tests.test_front_server:report_environ'; MPServer(**o).serve()"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        head = (
            b"GET /v1/ocr HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Forwarded-Proto: https\r\n"
            b"X-Forwarded-Host: evil.example\r\nX-Script-Name: /v1\r\nX-Forwarded-Prefix: /v1\r\n"
            b"Forwarded: for=10.0.0.1;proto=https\r\nConnection: close\r\n\r\n"
        )
        answer = b""
        deadline = time.monotonic() + 120
        while not answer:
            assert proc.poll() is None and time.monotonic() < deadline, "the front never answered"
            try:
                with socket.socket(socket.AF_UNIX) as client:
                    client.connect(str(sock))
                    client.sendall(head)
                    while chunk := client.recv(65536):
                        answer += chunk
            except OSError:
                time.sleep(0.2)
        environ = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert environ == {"wsgi.url_scheme": "http", "SCRIPT_NAME": "", "PATH_INFO": "/v1/ocr",
                           "REMOTE_ADDR": "", "HTTP_HOST": "127.0.0.1"}  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_a_worker_takes_its_startup_heap_out_of_the_collectors_reach(redis_server, tmp_path):
    """A worker's loader (granian's target loader, ``load_worker``) freezes what it built:
    a full collection then scans only what came after (scanning the startup heap stalled
    every request of the worker for about 55 ms a collection)."""
    code = (
        "import gc, json, os; from app import front_server; front_server.load_worker(); "
        "print(json.dumps([gc.get_freeze_count(), len(gc.get_objects(2))]), flush=True); "
        "os._exit(0)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(REDIS_URL=redis_server.url, GRPC_ENABLED="false", ENGINE_TOKEN=TOKEN,
               OCR_WORK_DIR=str(tmp_path / "models"), CACHE_KEY_PREFIX="freeze")  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    frozen, in_oldest_generation = json.loads(done.stdout.strip().splitlines()[-1])
    assert frozen > 20_000, frozen  # the modules and the app, at least
    assert in_oldest_generation < frozen / 10, (frozen, in_oldest_generation)
