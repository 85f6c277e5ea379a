"""Shared fixtures: a private Redis server per session, one real PaddleOCR engine per
session, and apps built with the factory against them. Nothing here is a fake."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# Paddle must load before grpcio in a process: the other order intermittently aborts inside
# libpaddle's initialisation (seen here ~1 run in 6). The service keeps this order too
# (engine.prepare() runs before the worker starts gRPC).
import paddle  # noqa: F401, I001
import pytest
import redis

from app.config import Settings
from app.embedded_redis import EmbeddedRedis
from app.engines.paddle import PaddleOcrEngine

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("OCR_SHARED_DIR", ROOT.parent / "shared"))
CORPUS = SHARED / "corpus"

# Small real images that keep the suite fast (word crops and one text page).
PHOTOTEST = CORPUS / "tesseract_phototest.png"
WORD_EN = CORPUS / "paddleocr_word_en_1.png"
WORD_CH = CORPUS / "paddleocr_word_ch_4.jpg"
SHORT = CORPUS / "rapidocr_short.png"


# The test layers (`make test-fast` runs only the unmarked ones). A test that uses the real
# OCR engine (the `engine` fixture, directly or through `make_app`/`client`) is `integration`
# by that fact; whole files are marked here by what they start or how long they run.
_FILE_MARKS = {
    "test_alerts.py": ("deploy",),  # promtool over the alert rules
    "test_cli.py": ("integration",),  # the CLI against a live service process
    "test_deploy.py": ("deploy",),  # Dockerfiles, compose, units
    "test_edge.py": ("deploy",),  # nginx -t, and `python -m app serve` behind nginx
    "test_entrypoint.py": ("deploy",),  # the container entry point in subprocesses
    "test_model_permissions.py": ("deploy",),  # model folders as another user
    "test_observability_hardening.py": ("integration",),
    "test_scale_out.py": ("deploy", "slow"),  # gunicorn fleets
    "test_serve.py": ("deploy",),  # gunicorn and `python -m app serve`
    "test_serving_engine.py": ("integration",),  # a backend `python -m app serve` process
    "test_slow_clients.py": ("deploy", "slow"),  # slow clients against nginx, in processes
    "test_webpage.py": ("deploy",),  # Debian's chromium
    "test_fuzz_images.py": ("slow",),
    "test_parity.py": ("slow",),  # PaddleX's own serving app as the oracle
    "test_schemathesis.py": ("slow",),
    "test_topologies.py": ("slow",),  # Sentinel and Cluster fail-over
    "test_url_input.py": ("slow",),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for name in _FILE_MARKS.get(item.path.name, ()):
            item.add_marker(name)
        fixtures = getattr(item, "fixturenames", ())
        # The real engine, upstream's client, or a SeaweedFS server process (the L3 tests).
        if "engine" in fixtures or "stock_client_dir" in fixtures or "s3" in fixtures:
            item.add_marker("integration")


def corpus_bytes(path: Path) -> bytes:
    return path.read_bytes()


@pytest.fixture(autouse=True)
def _stop_dispatch_feeders() -> Iterator[None]:
    """Every front door started during a test stops feeding on its engine after it: a
    feeder left running would take a later test's jobs to an earlier test's engine."""
    from app.cache import dispatch

    before = set(dispatch._live)
    yield
    for dispatcher in dispatch._live - before:
        dispatcher.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


class CacheRedis(redis.Redis):
    """A client whose ``keys``/``dbsize`` see what the cache stored: not the global dispatch
    queue's two keys (``{prefix:dispatch:fingerprint}:...``), which live while engines do."""

    def keys(self, pattern: str = "*", **kwargs: object) -> list[bytes]:  # type: ignore[override]
        found = super().keys(pattern, **kwargs)
        return [k for k in found if b":dispatch:" not in k.split(b"}", 1)[0]]

    def dbsize(self) -> int:  # type: ignore[override]
        return len(self.keys("*"))


@pytest.fixture()
def redis_client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = CacheRedis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def base_settings(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Settings:
    return Settings.from_env({}).with_overrides(
        redis_url=redis_server.url,
        ocr_work_dir=str(tmp_path_factory.mktemp("models")),
        request_timeout_seconds=120,
        # Most tests look at the Redis tier; tests/test_l1.py turns L1 on.
        cache_l1_bytes=0,
    )


@pytest.fixture(scope="session")
def engine(base_settings: Settings) -> PaddleOcrEngine:
    eng = PaddleOcrEngine.from_settings(base_settings)
    eng.load()
    return eng


@pytest.fixture()
def make_app(
    base_settings: Settings, engine: PaddleOcrEngine, redis_client: redis.Redis
) -> Callable[..., object]:
    from app.web import create_app

    def factory(engine_override: object | None = None, **overrides: object):  # type: ignore[no-untyped-def]
        app = create_app(
            base_settings.with_overrides(**overrides), engine=engine_override or engine
        )
        app.testing = True
        if engine_override is None:  # the shared engine is loaded: ready within moments
            state = app.extensions["ocr"]["engine_state"]
            deadline = time.monotonic() + 30
            while not state.ready and time.monotonic() < deadline:
                time.sleep(0.005)
            # Its feeder took its place in the global miss queue (at once when Redis answers).
            app.extensions["ocr"]["cache"].dispatch_ready(5)
        return app

    return factory


@pytest.fixture()
def client(make_app: Callable[..., object]):  # type: ignore[no-untyped-def]
    return make_app().test_client()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def stock_client_dir() -> Path:
    """paddle-serving-server 0.9.0 (pure Python), installed --no-deps once per checkout."""
    import subprocess
    import sys

    target = ROOT / ".venv" / "stock-client" / "paddle-serving-server-0.9.0"
    if not (target / "paddle_serving_server" / "pipeline" / "pipeline_client.py").is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
             "--no-deps", "--target", str(target), "paddle-serving-server==0.9.0"],
            check=True,
        )  # fmt: skip
    return target


def run_stock_client(target: Path, endpoint: str, image: Path, *modes: str) -> list[dict]:
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "stock_client.py"), str(target), endpoint,
         str(image), *modes],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture()
def grpc_front(make_app):  # type: ignore[no-untyped-def]
    """An app plus its gRPC server on a free port: (flask app, "127.0.0.1:port")."""
    from app import grpc_server

    def start(**overrides: object):  # type: ignore[no-untyped-def]
        app = make_app(**overrides)
        ocr = app.extensions["ocr"]
        settings = ocr["settings"].with_overrides(host="127.0.0.1")
        server, port = grpc_server.start(ocr["cache"], settings, port=0)
        started.append(server)
        return app, f"127.0.0.1:{port}"

    started: list = []
    yield start
    for server in started:
        server.stop(grace=None)
