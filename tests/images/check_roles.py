"""`make test-images`, the two roles apart (issue 36): the CPU image as two compose services,
`front` (`python -m app front`: nginx + granian, no engine) and `engine` (`python -m app
engine`: the miss queue's consumer on 18100), with Redis and the one-shot `engine-token`
writer, on docker-compose.yml + compose.local.yml (default profile, its own project). Not
collected by `make test` (file name).

- the token writer exits 0 and leaves a file only uid 10001 reads; both roles mount it;
- the engine's HEALTHCHECK (docker/healthcheck.py with `engine`: its own port) turns healthy;
- once the engine consumes the queue (/readyz 200), a REST request through the front's nginx
  is a MISS, the same one again a HIT, same lines;
- the engine computed the miss through the queue (its own /metrics on 18100: one call), the
  front none (it calls an engine itself only without a queue: the direct endpoint);
- the front's processes map no libpaddle, the engine's do (the method's own control);
- the engine's direct endpoint, reached from the front container over compose's network,
  refuses a call without the token and one with a wrong token.
"""

from __future__ import annotations

import base64
import io
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from PIL import Image

from tests.conftest import PHOTOTEST, WORD_EN
from tests.helpers import metric_sum
from tests.images.check_images import (  # noqa: F401 (cpu_image: a fixture, used by name)
    Compose,
    cpu_image,
    miss_then_hit,
    phototest_like,
)
from tests.images.containers import (
    PYTHON_BASE,
    REDIS_IMAGE,
    children,
    container_state,
    docker,
    front_workers,
    processes,
    wait_for,
)

pytestmark = pytest.mark.deploy

PROJECT = "ocr-test-images-roles"
ENGINE_PORT = 18100
TOKEN_FILE = "/run/ocr-engine-token/engine-token"

# Run in a container with its own Python: which of its processes map the Paddle runtime.
MAPS_LIBPADDLE = """
import os
found = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/maps") as f:
            if "libpaddle" in f.read():
                found.append(int(pid))
    except OSError:
        continue
print(found)
"""

# Run in a container: GET a URL, print the status and the body.
GET = """
import sys, urllib.error, urllib.request
try:
    answer = urllib.request.urlopen(sys.argv[1], timeout=10)
    print(answer.status)
    print(answer.read().decode())
except urllib.error.HTTPError as exc:
    print(exc.code)
"""

# Run in a container: POST an empty recognition to the engine's direct endpoint with the given
# Authorization header ("" for none), print the status.
DIRECT = """
import json, sys, urllib.error, urllib.request
headers = {"Content-Type": "application/json"}
if sys.argv[2]:
    headers["Authorization"] = sys.argv[2]
request = urllib.request.Request(sys.argv[1], data=json.dumps({}).encode(), headers=headers)
try:
    print(urllib.request.urlopen(request, timeout=30).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""


def container(service: str) -> str:
    return f"{PROJECT}-{service}-1"


def python_in(compose: Compose, service: str, script: str, *args: str) -> str:
    return compose("exec", "-T", service, "python", "-c", script, *args).stdout


def engine_metrics(compose: Compose) -> str:
    """The engine's /metrics, read inside its container (its port is not published)."""
    status, _, body = python_in(
        compose, "engine", GET, f"http://127.0.0.1:{ENGINE_PORT}/metrics"
    ).partition("\n")
    assert status.strip() == "200", status
    return body


@pytest.fixture(scope="module")
def roles(cpu_image: str) -> Iterator[dict[str, Any]]:  # noqa: F811 (the imported fixture)
    env = {
        "LOCAL_FRONT_HTTP_PORT": "0",
        "LOCAL_FRONT_GRPC_PORT": "0",
        "REDIS_PASSWORD": base64.b16encode(os.urandom(12)).decode(),
        "WEB_CONCURRENCY": "1",
        "ENGINE_WORKERS": "1",
        "LOCAL_REDIS_IMAGE": REDIS_IMAGE,
        "LOCAL_PYTHON_IMAGE": PYTHON_BASE,
    }
    compose = Compose(PROJECT, [], env)

    def front_ready() -> str:
        url = f"http://{compose.address('front', 9998)}"
        return url if requests.get(f"{url}/readyz", timeout=5).status_code == 200 else ""

    def engine_healthy() -> bool:
        state = container_state(container("engine"))
        restarts = docker("inspect", "--format", "{{.RestartCount}}", container("engine"))
        if not state["Running"] or restarts.stdout.strip() != "0":
            raise AssertionError(f"the engine exited\n{compose.logs()}")
        return state["Health"]["Status"] == "healthy"

    def engine_consuming() -> bool:
        """/readyz 200: its engine loaded and taking work from the queue (reported in)."""
        answer = python_in(compose, "engine", GET, f"http://127.0.0.1:{ENGINE_PORT}/readyz")
        return answer.partition("\n")[0].strip() == "200"

    try:
        compose.up("redis", "engine-token", "engine", "front")
        url = wait_for("front /readyz 200", front_ready, timeout=420, dump=compose.logs)
        wait_for("engine HEALTHCHECK healthy", engine_healthy, timeout=300, dump=compose.logs)
        wait_for("engine /readyz 200", engine_consuming, timeout=120, dump=compose.logs)
        yield {"compose": compose, "front": url}
    finally:
        compose.down()


def test_the_token_is_written_once_for_uid_10001(roles: dict[str, Any]) -> None:
    state = container_state(container("engine-token"))
    assert not state["Running"] and state["ExitCode"] == 0, state
    compose = roles["compose"]
    for service in ("front", "engine"):
        mode = python_in(
            compose, service, "import os, sys; s = os.stat(sys.argv[1]); "
            "print(oct(s.st_mode & 0o777), s.st_uid, len(open(sys.argv[1]).read()))", TOKEN_FILE,
        ).split()  # fmt: skip
        assert mode[:2] == ["0o400", "10001"] and int(mode[2]) >= 16, (service, mode)


def test_each_container_runs_its_role(roles: dict[str, Any]) -> None:
    """The front: tini -> `python -m app front` (granian's main process) -> its worker; the engine:
    tini -> `python -m app engine`; no front server in the engine, no engine in the front."""
    assert len(front_workers(container("front"))) == 1
    front = processes(container("front"))
    assert not [p for p in front if p["argv"][-3:] == ["-m", "app", "engine"]], front
    engine = processes(container("engine"))
    (main,) = children(engine, 1)
    assert main["argv"][-3:] == ["-m", "app", "engine"], main
    assert not [p for p in engine if p["argv"][-3:] == ["-m", "app", "front"]], engine
    for proc in front + engine:
        assert proc["uid"][0] == "10001", proc


def test_a_miss_then_a_hit_through_the_front_computed_by_the_engine(
    roles: dict[str, Any],
) -> None:
    compose = roles["compose"]
    before = metric_sum(engine_metrics(compose), "ocr_engine_calls_total", outcome="ok")
    assert phototest_like(miss_then_hit(roles["front"]))

    def computed() -> bool:
        calls = metric_sum(engine_metrics(compose), "ocr_engine_calls_total", outcome="ok")
        return calls == before + 1

    wait_for("the engine's one call", computed, timeout=30, dump=compose.logs)
    front = requests.get(f"{roles['front']}/metrics", timeout=10).text
    assert metric_sum(front, "ocr_engine_calls_total") == 0  # the front computes nothing


def test_the_front_maps_no_paddle_and_the_engine_does(roles: dict[str, Any]) -> None:
    """After the miss and the hit: every process of the front container, granian's workers
    included, maps no libpaddle; the engine process does (the check sees it where it is)."""
    compose = roles["compose"]
    front = json.loads(python_in(compose, "front", MAPS_LIBPADDLE))
    engine = json.loads(python_in(compose, "engine", MAPS_LIBPADDLE))
    assert front == [], front
    assert engine, "no process of the engine container maps libpaddle"


def test_the_direct_endpoint_wants_the_token(roles: dict[str, Any]) -> None:
    """From the front container, as a front calls it while Redis is down: no token and a wrong
    one are refused (401 or 403) before anything is computed."""
    compose = roles["compose"]
    url = f"http://engine:{ENGINE_PORT}/internal/v1/recognize"
    for authorization in ("", "Bearer " + "x" * 43):
        status = python_in(compose, "front", DIRECT, url, authorization).strip()
        assert status in ("401", "403"), (authorization[:10], status)
    ready = python_in(compose, "front", GET, f"http://engine:{ENGINE_PORT}/readyz")
    assert ready.partition("\n")[0].strip() == "200", ready


def test_a_document_job_through_the_front_driven_by_the_engine(roles: dict[str, Any]) -> None:
    """A two-page PDF submitted to the front container's ``/v1/jobs``, driven by the engine
    container (its pages rendered there, through the queue), polled from the front."""
    pictures = [Image.open(path).convert("RGB") for path in (PHOTOTEST, WORD_EN)]
    pdf = io.BytesIO()
    pictures[0].save(pdf, "PDF", resolution=72, save_all=True, append_images=pictures[1:])
    front = roles["front"]
    answer = requests.post(f"{front}/v1/jobs", files={"file": ("doc.pdf", pdf.getvalue())},
                           timeout=60)  # fmt: skip
    assert answer.status_code == 202, answer.text
    url = f"{front}{answer.headers['Location']}"

    def ended() -> dict[str, Any] | None:
        job = requests.get(url, timeout=10).json()
        return job if job["status"] not in ("queued", "running") else None

    job = wait_for("the job's end", ended, timeout=240, dump=roles["compose"].logs)
    assert job["status"] == "succeeded", job
    assert [page["page"] for page in job["pages"]] == [1, 2]
    assert phototest_like([line["text"] for line in job["pages"][0]["lines"]])
