"""Small helpers for `make test-images`: the docker CLI, image builds with their measured
times, readiness waits that dump the container's log when they give up, and host ports held
for containers on the host network (never picked by binding and releasing)."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

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


def docker(
    *args: str, timeout: float = 600, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``env``: added to this process's environment for that command only (compose's
    variables)."""
    result = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, **env} if env else None,
    )  # fmt: skip
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


# ---------------------------------------------------------------------------- host ports
# A port found free by binding and releasing it can be taken by anyone before the container
# binds it (the kernel hands it out as an ephemeral port, Docker publishes a container on it,
# another port-picker finds it free too). Compose services publish on a port Docker picks
# (host port 0, read back with `docker compose port`). Containers on the host network bind
# their ports themselves: those ports are held (``Reserved``) from before `docker run` until
# the container is removed.

T = TypeVar("T")
# How a server says that its port was taken: nginx, redis-server, gRPC, granian, dockerd.
PORT_TAKEN = re.compile(
    r"address already in use|port is already allocated|could not bind|connection in use", re.I
)


def _kernel_range() -> tuple[int, int]:
    """The kernel's ephemeral ports, which Docker also picks published host ports from."""
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def _named_ports() -> set[int]:
    """Every port written in the compose files (fixed host ports a stack may publish)."""
    numbers = set()
    for path in (ROOT / "docker").glob("*.y*ml"):
        numbers |= {int(n) for n in re.findall(r"(?<![\w.])\d{4,5}(?![\w.])", path.read_text())}
    return numbers


class Reserved:
    """``count`` loopback ports held by sockets of this process, bound and not listening,
    until ``close()``. They are below the kernel's ephemeral range, so neither the kernel (an
    outgoing connection, a bind to port 0) nor Docker (a published port) ever picks them,
    and not a port named in docker/*.yml; a port is taken only when an exclusive bind
    succeeds on it, so whatever is bound there already, and a second ``Reserved`` (in this
    run or another), are passed over. ``shareable``: SO_REUSEADDR is set once bound, so a
    server given the port binds it beside the holder (nginx, granian, gRPC and redis-server
    all set SO_REUSEADDR); unshareable, no one can bind it: an address that refuses every
    connection for as long as it is held."""

    def __init__(self, count: int, shareable: bool = True) -> None:
        low, _high = _kernel_range()
        candidates = sorted(set(range(max(1024, low - 12000), low)) - _named_ports())
        self._held: list[socket.socket] = []
        for port in random.sample(candidates, len(candidates)):
            if len(self._held) == count:
                break
            holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                holder.bind(("127.0.0.1", port))
            except OSError:
                holder.close()
                continue
            if shareable:
                holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._held.append(holder)
        if len(self._held) < count:
            self.close()
            raise AssertionError(f"no {count} free ports below {low}")
        self.ports: list[int] = [s.getsockname()[1] for s in self._held]

    def close(self) -> None:
        for holder in self._held:
            holder.close()
        self._held = []


def on_reserved_ports(
    count: int, start: Callable[[list[int]], T], attempts: int = 3
) -> tuple[T, Reserved]:
    """``start(ports)`` on ``count`` held ports; again on others when it failed because a
    port was taken all the same (its AssertionError or RuntimeError says so: the container's
    log, redis-server's error). The caller closes the ``Reserved`` once the server is gone."""
    for attempt in range(1, attempts + 1):
        held = Reserved(count)
        try:
            return start(held.ports), held
        except (AssertionError, RuntimeError) as exc:
            held.close()
            if attempt == attempts or not PORT_TAKEN.search(str(exc)):
                raise
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------- processes
# Every process of a container, read from /proc by the image's own Python (no ps in the image),
# but those `docker exec` started (their parent is outside the container: PPid 0), such as this
# script itself and the HEALTHCHECK's runs. With each: resident memory and open files (the soak
# of `make chaos`).
PROCESSES = """
import json, os
found = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\\0") if a]
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        continue
    if argv and (pid == "1" or status["PPid"].strip() != "0"):
        found.append({"pid": int(pid), "ppid": int(status["PPid"]), "argv": argv,
                      "uid": status["Uid"].split(), "gid": status["Gid"].split(),
                      "rss_kb": int(status.get("VmRSS", "0 kB").split()[0]),
                      "fds": fds})
print(json.dumps(found))
"""


def processes(name: str) -> list[dict[str, Any]]:
    return json.loads(docker("exec", name, "python", "-c", PROCESSES).stdout)


def children(procs: list[dict[str, Any]], parent: int) -> list[dict[str, Any]]:
    return [p for p in procs if p["ppid"] == parent]


def front_master(procs: list[dict[str, Any]]) -> dict[str, Any]:
    """granian's main process: `python -m app front`, PID 1's child in a front container, the
    child of `python -m app serve` (the supervisor) otherwise."""
    fronts = [p for p in procs if p["argv"][-3:] == ["-m", "app", "front"]]
    (master,) = [p for p in fronts if p["ppid"] not in {f["pid"] for f in fronts}]
    return master


def front_workers(name: str) -> list[int]:
    """The PIDs (in the container) of granian's workers: the forks of its master."""
    procs = processes(name)
    master = front_master(procs)
    return [p["pid"] for p in children(procs, master["pid"]) if p["argv"] == master["argv"]]


def engine_processes(name: str) -> list[int]:
    """The PIDs (in the container) of `python -m app engine`: where a miss is computed."""
    return [p["pid"] for p in processes(name) if p["argv"][-3:] == ["-m", "app", "engine"]]
