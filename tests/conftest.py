"""Shared fixtures: a private Redis server per session, one real PaddleOCR engine per
session, and apps built with the factory against them. Nothing here is a fake."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from app.config import Settings
from app.embedded_redis import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("OCR_SHARED_DIR", ROOT.parent / "shared"))
CORPUS = SHARED / "corpus"

# Small real images that keep the suite fast (word crops and one text page).
PHOTOTEST = CORPUS / "tesseract_phototest.png"
WORD_EN = CORPUS / "paddleocr_word_en_1.png"
WORD_CH = CORPUS / "paddleocr_word_ch_4.jpg"
SHORT = CORPUS / "rapidocr_short.png"


# The test layers: every test file declares one (``pytestmark``); a test may add a heavier one.
#   unit         in-process, no engine, no processes (``make test-fast``)
#   integration  the real OCR engine, a subprocess or a server
#   deploy       images, served fleets, nginx, alert rules, a browser
#   slow         long property/fuzz runs, fail-over topologies, upstream parity (with another)
LAYERS = ("unit", "integration", "deploy")
# Fixtures that load the real engine: a test that uses one is not a unit test.
ENGINE_FIXTURES = ("engine", "make_app", "client", "grpc_front", "stock_client_dir")


def pytest_configure(config: pytest.Config) -> None:
    """Paddle must load before grpcio in a process: the other order intermittently aborts
    inside libpaddle's initialisation (seen here about one run in six), and collection
    imports grpcio. So paddle is imported first whenever the run may load the engine; the
    unit layer (``-m unit ...``) never imports it. The service keeps this order too
    (``engine.prepare()`` runs before a worker starts gRPC)."""
    if not config.option.markexpr.strip().startswith("unit"):
        import paddle  # noqa: F401


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The unit layer alone (``make test-fast``) does not even import the other layers' files:
    their imports (hypothesis, schemathesis, grpc, the engines) cost seconds."""
    name = collection_path.name
    if not (name.startswith("test_") and name.endswith(".py")):
        return None
    if config.option.markexpr.strip().startswith("unit"):
        return (
            re.search(r"^pytestmark = .*\bpytest\.mark\.unit\b", collection_path.read_text(), re.M)
            is None
        )
    return None


# ``make test`` runs on pytest-xdist workers: a file's tests stay together in one worker, in
# their order (module fixtures, a reference server, a Redis Cluster, an example count are
# set up once), except in these files, whose tests are independent and long (each serves its
# own fleet): they spread over the workers.
SPREAD = {
    "test_jobs.py", "test_lines.py", "test_faults.py", "test_topologies.py",
    "test_engine_queue.py", "test_jobs_served.py", "test_eviction_served.py",
}  # fmt: skip
# The longest files first (``--durations``, 2 cores), so that the workers end together.
LONGEST = (
    "test_parity.py", "test_roles.py", "test_fleet_cluster.py", "test_lines.py",
    "test_eviction_served.py", "test_cluster_structures.py", "test_scale_out.py", "test_jobs.py",
    "test_edge.py", "test_topologies.py", "test_tenants_edge.py", "test_faults.py",
    "test_serve.py", "test_slow_clients.py", "test_front_server.py", "test_tracing_served.py",
    "test_security.py", "test_jobs_served.py", "test_engine_queue.py",
)  # fmt: skip


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling, a scope being a file, or a test of a ``SPREAD`` file (xdist's
    own ``loadgroup`` marks do not reach pytest 9's node ids)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileOrTest(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if Path(path).name in SPREAD else path

    return FileOrTest(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST)))  # stable: in-file order
    for item in items:
        layers = [name for name in LAYERS if item.get_closest_marker(name)]
        if not layers:
            raise pytest.UsageError(
                f"{item.path.name} declares no test layer: add pytestmark = pytest.mark.<layer> "
                f"({', '.join(LAYERS)})"
            )
        heavy = {"integration", "deploy"} & set(layers) or item.get_closest_marker("slow")
        uses_engine = set(ENGINE_FIXTURES) & set(getattr(item, "fixturenames", ()))
        if uses_engine and not heavy:
            raise pytest.UsageError(
                f"{item.nodeid} uses {sorted(uses_engine)} (the real engine) in the unit layer: "
                "mark it integration"
            )


def corpus_bytes(path: Path) -> bytes:
    return path.read_bytes()


@pytest.fixture(autouse=True)
def _stop_dispatch_feeders() -> Iterator[None]:
    """Every front door started during a test stops feeding on its engine after it: a
    feeder left running would take a later test's tickets to an earlier test's engine."""
    from app.engine_side import feeders

    before = set(feeders._live)
    yield
    for started in feeders._live - before:
        started.stop(30.0)  # waits for a call in progress: none outlives its test


@pytest.fixture(autouse=True)
def _stop_notification_listeners() -> Iterator[None]:
    """Every cache built during a test stops listening after it: its Redis server may stop
    with the test, and a listener left behind retries it as long as the process runs (271
    of them in one pytest-xdist worker, retrying in step, starved the tests that came after)."""
    from app.cache import notify

    before = set(notify._live)
    yield
    for started in notify._live - before:
        started.stop()


@pytest.fixture(autouse=True)
def _restore_log_record_factory() -> Iterator[None]:
    """A test that installs a process-wide record factory (log redaction, an engine built
    with a redaction policy) leaves the next test the logging it found: under pytest-xdist
    the files a process runs after it are not the ones a serial run would."""
    before = logging.getLogRecordFactory()
    yield
    logging.setLogRecordFactory(before)


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
def engine(base_settings: Settings) -> Any:
    from app.engines.paddle import PaddleOcrEngine

    eng = PaddleOcrEngine.from_settings(base_settings)
    eng.load()
    return eng


@pytest.fixture()
def make_app(
    base_settings: Settings, engine: Any, redis_client: redis.Redis
) -> Iterator[Callable[..., object]]:
    """Apps of the test; at its end their feeders stop taking tickets: an app left behind
    would take the next test's tickets from the shared queue with its own settings."""
    from app.web import create_app

    made: list[Any] = []

    def factory(engine_override: object | None = None, **overrides: object):  # type: ignore[no-untyped-def]
        app = create_app(
            base_settings.with_overrides(**overrides), engine=engine_override or engine
        )
        app.testing = True
        if engine_override is None:  # the shared engine is loaded: ready within moments
            state = app.extensions["ocr"]["engine_state"]
            deadline = time.monotonic() + 60
            while not state.ready:
                assert time.monotonic() < deadline, f"engine not ready: {state.status}"
                time.sleep(0.005)
            # Its feeder took its place in the global miss queue (at once when Redis answers;
            # a test whose Redis is down goes on after 5 s: its misses are computed here).
            app.extensions["ocr"]["cache"].dispatch_ready(5)
        made.append(app)
        return app

    yield factory
    for app in made:
        app.extensions["ocr"]["cache"].close(1.0)


@pytest.fixture()
def client(make_app: Callable[..., object]):  # type: ignore[no-untyped-def]
    return make_app().test_client()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def stock_client_dir() -> Path:
    """paddle-serving-server 0.9.0 (pure Python), installed --no-deps once per checkout."""
    import subprocess
    import sys

    target = ROOT / ".venv" / "stock-client" / "paddle-serving-server-0.9.0"
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / ".install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install when xdist workers ask at once
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
    """An app plus its gRPC server on a free port, both services (``PipelineService``,
    ``GRPCInferenceService``) as a front worker runs them: (flask app, "127.0.0.1:port")."""
    from app import grpc_server

    def start(**overrides: object):  # type: ignore[no-untyped-def]
        app = make_app(**overrides)
        ocr = app.extensions["ocr"]
        settings = ocr["settings"].with_overrides(host="127.0.0.1")
        server, port = grpc_server.start(ocr["cache"], settings, port=0, service=ocr)
        started.append(server)
        return app, f"127.0.0.1:{port}"

    started: list = []
    yield start
    for server in started:
        server.stop(grace=None)


@pytest.fixture()
def traced() -> Any:
    """An ``On`` tracer over an in-memory exporter, as ``TRACER`` for the test (the SDK
    imported here: only the tests that trace pay for it)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from app import tracing
    from app.tracing_sdk import On

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    before, tracing.TRACER = tracing.TRACER, On(provider)
    try:
        yield exporter
    finally:
        tracing.TRACER = before
        provider.shutdown()
