"""Small helpers for `make test-images`: the docker CLI, image builds with their measured
times, readiness waits that dump the container's log when they give up."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parents[2]
RUN_DIR = ROOT / ".run" / "test-images"
# Every container these checks start carries this label (tests/images/run.sh removes them).
LABEL = "ocr-test-images=1"
# Local base images made by ../shared/tools/container-engine.sh (Docker Hub is unreachable).
PYTHON_BASE = os.environ.get("LOCAL_PYTHON_IMAGE", "local/debian-python:bookworm")
SERVING_BASE = os.environ.get("LOCAL_SERVING_BASE", "local/debian-python:bullseye")
REDIS_IMAGE = os.environ.get("LOCAL_REDIS_IMAGE", "local/redis:bookworm")

measurements: dict[str, Any] = {}


def docker(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"docker {' '.join(args)[:300]} -> {result.returncode}\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def build(tag: str, dockerfile: str, context: str = ".", **build_args: str) -> float:
    """Classic builder on the host network; the full log goes to .run/test-images/."""
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    log = RUN_DIR / f"build-{tag.replace('/', '_').replace(':', '_')}.log"
    cmd = ["docker", "build", "--network", "host", "-f", dockerfile, "-t", tag]
    for key, value in build_args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    start = time.monotonic()
    with open(log, "w") as out:
        result = subprocess.run(cmd + [context], stdout=out, stderr=subprocess.STDOUT,
                                cwd=ROOT, timeout=1500)  # fmt: skip
    seconds = round(time.monotonic() - start, 1)
    if result.returncode != 0:
        raise AssertionError(f"building {tag} failed ({log}):\n{log.read_text()[-4000:]}")
    size = int(docker("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())
    measurements[tag] = {"build_seconds": seconds, "size_mb": round(size / 1e6)}
    return seconds


def logs(container: str, tail: int = 150) -> str:
    result = docker("logs", "--tail", str(tail), container, check=False)
    return f"--- docker logs {container} ---\n{result.stdout}{result.stderr}"


def wait_for(what: str, probe: Callable[[], Any], timeout: float, dump: Callable[[], str]) -> Any:
    """Poll ``probe`` until it returns a truthy value; on timeout fail with ``dump()``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
            last = value
        except (requests.RequestException, OSError, ValueError, KeyError) as exc:
            last = exc
        time.sleep(1)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})\n{dump()}")


def container_state(name: str) -> dict[str, Any]:
    return json.loads(docker("inspect", "--format", "{{json .State}}", name).stdout)


def write_measurements() -> Path:
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    path = RUN_DIR / "measurements.json"
    path.write_text(json.dumps(measurements, indent=2, sort_keys=True) + "\n")
    return path
