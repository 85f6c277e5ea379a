"""Scale-out Redis topologies on loopback, with real failovers: a master is killed by pid
while requests keep coming. Proven: no failed client request (the engine answers during the
failover), nothing served wrong, caching resumes by itself afterwards."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from tests.conftest import CORPUS
from tests.fleet import LoopbackCluster, loopback_sentinel, wait_for
from tests.helpers import b64

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IMAGES = ["paddleocr_word_en_1.png", "rapidocr_short.png", "paddleocr_word_ru_1.jpg"]


def _expected(client) -> dict[str, list]:  # type: ignore[no-untyped-def]
    return {
        name: client.post("/v1/ocr", json={"image": b64((CORPUS / name).read_bytes())}).get_json()[
            "lines"
        ]
        for name in IMAGES
    }


def _drive_through_failover(app, kill, expected, seconds: float = 8.0) -> list[str]:  # type: ignore[no-untyped-def]
    """Requests before, during and after ``kill()``; every answer must be 200 and right."""
    client = app.test_client()
    statuses, killed = [], False
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if not killed and time.monotonic() - started > 1.0:
            kill()
            killed = True
        for name in IMAGES:
            resp = client.post("/v1/ocr", json={"image": b64((CORPUS / name).read_bytes())})
            assert resp.status_code == 200
            assert resp.get_json()["lines"] == expected[name], name
            statuses.append(resp.headers["X-Cache"])
        time.sleep(0.05)
    return statuses


def _caching_resumes(app, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    """A fresh image is stored and then hit, through the new master (a liveness bound,
    generous for a loaded host)."""
    client = app.test_client()
    data = (CORPUS / "paddleocr_word_ko_1.jpg").read_bytes()
    seen: list[str] = []

    def stored_then_hit() -> bool:
        client.post("/v1/ocr", json={"image": b64(data)}, headers={"Cache-Control": "no-cache"})
        seen.append(client.post("/v1/ocr", json={"image": b64(data)}).headers["X-Cache"])
        return seen[-1] == "HIT"

    wait_for(stored_then_hit, timeout, "caching resumed after the failover",
             lambda: f"X-Cache after each store: {seen[-20:]}")  # fmt: skip


@pytest.fixture()
def sentinel_setup(tmp_path: Path):  # type: ignore[no-untyped-def]
    servers = loopback_sentinel(tmp_path)
    yield servers
    for server in reversed(servers):
        server.cleanup()


def test_sentinel_failover(make_app, sentinel_setup):
    master, replica, sentinel = sentinel_setup
    url = f"redis+sentinel://127.0.0.1:{sentinel.port}/ocrmaster/0"
    app = make_app(redis_url=url, redis_breaker_cooldown_seconds=0.5)
    expected = _expected(app.test_client())
    statuses = _drive_through_failover(app, lambda: master.proc.kill(), expected)
    assert "HIT" in statuses
    promoted = redis.Redis(port=replica.port, socket_timeout=5)
    wait_for(lambda: promoted.info("replication")["role"] == "master", 120, "replica promoted",
             lambda: str(redis.Redis(port=sentinel.port).sentinel_master("ocrmaster")))  # fmt: skip
    _caching_resumes(app)


@pytest.fixture()
def cluster_nodes():  # type: ignore[no-untyped-def]
    cluster = LoopbackCluster(masters=3, replicas=1).start()
    yield cluster.nodes
    cluster.stop()


def test_cluster_failover(make_app, cluster_nodes):
    seeds = ",".join(f"127.0.0.1:{n.port}" for n in cluster_nodes[:2])
    app = make_app(redis_url=f"redis+cluster://{seeds}", redis_breaker_cooldown_seconds=0.5)
    client = app.test_client()
    expected = _expected(client)
    # Kill the master that holds the first image's entry.
    probe = redis.Redis(port=cluster_nodes[0].port)
    key = next(k for k in _all_keys(cluster_nodes) if k.startswith(b"ocr:"))
    slot = probe.execute_command("CLUSTER", "KEYSLOT", key)
    master_port = next(
        int(master[1])
        for lo, hi, master, *_ in probe.execute_command("CLUSTER", "SLOTS")
        if lo <= slot <= hi
    )
    victim = next(n for n in cluster_nodes if n.port == master_port)
    statuses = _drive_through_failover(app, lambda: victim.proc.kill(), expected)
    assert "HIT" in statuses
    survivor = redis.Redis(port=next(n for n in cluster_nodes if n is not victim).port)
    wait_for(lambda: b"cluster_state:ok" in survivor.execute_command("CLUSTER", "INFO"), 120,
             "cluster_state:ok after the failover", lambda: _views(cluster_nodes))  # fmt: skip
    _caching_resumes(app)


def _all_keys(nodes) -> list[bytes]:  # type: ignore[no-untyped-def]
    return [k for n in nodes[:3] for k in redis.Redis(port=n.port).keys("*")]


def _views(nodes) -> str:  # type: ignore[no-untyped-def]
    """Each live node's own view of the cluster, for a failure's message."""
    lines = []
    for node in nodes:
        try:
            view = redis.Redis(port=node.port, socket_timeout=2).execute_command("CLUSTER", "NODES")
            lines.append(f":{node.port}\n{view.decode().strip()}")
        except (redis.RedisError, OSError) as exc:
            lines.append(f":{node.port} unreachable: {exc}")
    return "\n".join(lines)
