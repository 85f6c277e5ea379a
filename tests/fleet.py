"""A whole fleet on this machine's loopback, as Kubernetes runs it: a Redis Cluster of real
``redis-server`` nodes (masters with a replica each), ``python -m app front`` processes and
``python -m app engine`` processes, each a real process with its own port. Used by the
fleet's fault tests (tests/test_fleet_cluster.py), ``make chaos-fleet`` (bench/chaos_fleet.py)
and the fleet benchmark (bench/fleet.py).

The fleet stands in for the orchestrator too: an engine process that dies is started again
(a Deployment's restart), as the kubelet would; a front's dead worker is granian's to
replace. Nothing here is a fake: every part is what production runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
import requests

from app.embedded_redis import EmbeddedRedis
from app.ports import free_port, free_ports
from tests.helpers import app_children

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "fleet-engine-token-0123456789"
SLOTS = 16384
# How long a redis-server of ours may take to answer once started (EmbeddedRedis's own 10 s
# is short on two cores busy with another test's cluster and engines).
NODE_START_S = 60.0


def cluster_port() -> int:
    """A port whose cluster bus port (port + 10000) is reserved too: a node restarted on its
    own port (``LoopbackCluster.restart``) must find both still free (``app.ports``)."""
    return free_ports(1, offset=10000)[0]


def wait_for(
    check: Callable[[], Any],
    timeout: float = 30.0,
    what: str = "condition",
    seen: Callable[[], str] | None = None,
) -> Any:
    """Poll ``check`` until it returns something true, and return that; on the deadline fail
    saying ``what``, the last value polled (or the error that ended the last poll) and, with
    ``seen``, what the process under test wrote meanwhile (its log, the nodes' views).

    Generous deadlines are the rule: the suite shares two cores with other tests and
    benchmarks, so a deadline bounds a hang, never a speed (it costs nothing when met)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
            last = value
        except (redis.RedisError, OSError, requests.RequestException) as exc:
            last = exc
        time.sleep(0.1)
    said = f"{what}: not met within {timeout:.0f} s (last polled: {last!r:.2000})"
    raise AssertionError(said + (f"\n{seen()}" if seen else ""))


class LoopbackCluster:
    """``masters`` masters, each with ``replicas`` replicas, slots split evenly; node timeout
    ``node_timeout_ms`` (how long a silent master has before its replica takes over)."""

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        args = ["--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms),
                "--cluster-config-file", "nodes.conf", "--maxmemory", "256mb"]  # fmt: skip
        count = masters * (1 + replicas)
        self.nodes = [EmbeddedRedis(extra_args=args, port=cluster_port()) for _ in range(count)]
        self.masters, self.replicas = masters, replicas
        self.node_timeout = node_timeout_ms / 1000

    @property
    def url(self) -> str:
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"redis+cluster://{seeds}"

    def client(self, node: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(port=node.port, socket_timeout=2, socket_connect_timeout=1)

    def start(self) -> LoopbackCluster:
        """Start, join and wait; a failure says what each node saw (``describe``)."""
        try:
            return self._start()
        except Exception as exc:
            views = self.describe()
            self.stop()
            raise AssertionError(f"the cluster did not come up: {exc}\n{views}") from exc

    def _start(self) -> LoopbackCluster:
        for node in self.nodes:
            node.start(NODE_START_S)
        clients = [self.client(n) for n in self.nodes]
        first = clients[0]
        step = SLOTS // self.masters
        for i, client in enumerate(clients[: self.masters]):
            hi = SLOTS - 1 if i == self.masters - 1 else (i + 1) * step - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, hi)
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        wait_for(lambda: all(len(c.execute_command("CLUSTER", "NODES").splitlines()) == len(clients)
                             for c in clients), 60, "every node knows every other")  # fmt: skip
        for j, replica in enumerate(clients[self.masters :]):
            master = clients[j % self.masters]
            master_id = master.execute_command("CLUSTER", "MYID")
            replica.execute_command("CLUSTER", "REPLICATE", master_id)
        self.wait_ok()
        wait_for(lambda: all(self.client(n).info("replication").get("master_link_status") == "up"
                             for n in self.nodes if self.role(n) == "slave"),
                 60, "replicas in sync")  # fmt: skip
        return self

    def describe(self) -> str:
        """Each node's own view (``CLUSTER INFO``'s state and ``CLUSTER NODES``), for a report."""
        lines = []
        for node in self.nodes:
            try:
                client = self.client(node)
                state = client.execute_command("CLUSTER", "INFO").split(b"\r\n")[0].decode()
                nodes = client.execute_command("CLUSTER", "NODES").decode().strip()
                lines.append(f":{node.port} pid {client.info('server')['process_id']} {state}")
                lines.extend(f"    {line}" for line in nodes.splitlines())
            except (redis.RedisError, OSError) as exc:
                lines.append(f":{node.port} unreachable: {exc}")
        return "\n".join(lines)

    def alive(self) -> list[EmbeddedRedis]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def role(self, node: EmbeddedRedis) -> str:
        return str(self.client(node).info("replication")["role"])

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Every live node says ``cluster_state:ok`` and every slot has a live master."""

        def ok() -> bool:
            live = self.alive()
            return (
                bool(live)
                and all(
                    b"cluster_state:ok" in self.client(n).execute_command("CLUSTER", "INFO")
                    for n in live
                )
                and len(self.live_masters()) == self.masters
            )

        wait_for(ok, timeout, "cluster_state:ok with a live master for every slot")

    def live_masters(self) -> list[EmbeddedRedis]:
        """Live nodes that are masters and, in their own view, hold slots."""
        out = []
        for node in self.alive():
            try:
                slots = self.client(node).execute_command("CLUSTER", "SLOTS")
                if self.role(node) == "master" and any(
                    int(master[1]) == node.port for _, _, master, *_ in slots
                ):
                    out.append(node)
            except redis.RedisError:
                pass
        return out

    def owner(self, key: str) -> EmbeddedRedis:
        """The live master that holds ``key``'s slot now."""
        slot = self.client(self.alive()[0]).execute_command("CLUSTER", "KEYSLOT", key)
        for node in self.live_masters():
            for lo, hi, master, *_ in self.client(node).execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi and int(master[1]) == node.port:
                    return node
        raise LookupError(f"no live master holds {key!r}")

    def replica_of(self, master: EmbeddedRedis) -> EmbeddedRedis:
        for node in self.alive():
            info = self.client(node).info("replication")
            if info["role"] == "slave" and int(info["master_port"]) == master.port:
                return node
        raise LookupError(f"no live replica of :{master.port}")

    def kill(self, node: EmbeddedRedis) -> None:
        """``kill -9``: unreplicated writes are lost with it."""
        assert node.proc is not None
        node.proc.kill()
        node.proc.wait()

    def pause(self, node: EmbeddedRedis) -> None:
        assert node.proc is not None
        node.proc.send_signal(signal.SIGSTOP)

    def resume(self, node: EmbeddedRedis) -> None:
        assert node.proc is not None
        node.proc.send_signal(signal.SIGCONT)

    def restart(self, node: EmbeddedRedis) -> None:
        """Start a killed node again in its own folder: its nodes.conf makes it rejoin (as a
        replica of whoever took its slots), empty (nothing is persisted: a cache)."""
        node.proc = None
        node.start(NODE_START_S)

    def keys_per_master(self, match: str = "*") -> dict[int, int]:
        return {n.port: sum(1 for _ in self.client(n).scan_iter(match, count=1000))
                for n in self.live_masters()}  # fmt: skip

    def commands_per_master(self) -> dict[int, int]:
        """Commands each master has processed since start (INFO stats)."""
        return {n.port: int(self.client(n).info("stats")["total_commands_processed"])
                for n in self.live_masters()}  # fmt: skip

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGCONT)
            node.cleanup()


def loopback_sentinel(
    tmp: Path, down_after_ms: int = 1000, failover_timeout_ms: int = 3000
) -> tuple[EmbeddedRedis, EmbeddedRedis, EmbeddedRedis]:
    """(master, replica, sentinel) on loopback, the replica in sync and the sentinel watching
    ``ocrmaster`` (``redis+sentinel://127.0.0.1:<sentinel port>/ocrmaster/0``)."""
    master = EmbeddedRedis().start(NODE_START_S)
    replica = EmbeddedRedis(extra_args=["--replicaof", "127.0.0.1", str(master.port)])
    replica.start(NODE_START_S)
    conf = tmp / "sentinel.conf"
    conf.write_text(
        f"sentinel monitor ocrmaster 127.0.0.1 {master.port} 1\n"
        f"sentinel down-after-milliseconds ocrmaster {down_after_ms}\n"
        f"sentinel failover-timeout ocrmaster {failover_timeout_ms}\n"
    )
    sentinel = EmbeddedRedis(conf=conf, extra_args=["--sentinel"]).start(NODE_START_S)
    probe, watcher = redis.Redis(port=replica.port), redis.Redis(port=sentinel.port)
    wait_for(lambda: probe.info("replication")["master_link_status"] == "up", 60, "replica up")
    wait_for(lambda: watcher.sentinel_master("ocrmaster")["num-slaves"] >= 1, 60, "sentinel")
    return master, replica, sentinel


class Role:
    """One ``python -m app <role>`` process on its own port, its output kept."""

    def __init__(self, role: str, port: int, env: dict[str, str]) -> None:
        self.role, self.port, self.env = role, port, env
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []
        self.starts = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Role:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app", self.role], cwd=ROOT, env=self.env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.starts += 1
        proc = self.proc
        threading.Thread(target=lambda: self.output.extend(proc.stdout or []), daemon=True).start()
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.base}/readyz", timeout=2).ok
        except requests.RequestException:
            return False

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if not self.running() or time.monotonic() > deadline:
                raise AssertionError(f"{self.role} :{self.port} not ready\n" + self.tail())
            time.sleep(0.3)

    def tail(self, chars: int = 4000) -> str:
        return "".join(self.output)[-chars:]

    def children(self) -> list[int]:
        """Its own processes (granian workers of a front; nginx too)."""
        return [] if self.proc is None else app_children(self.proc.pid)

    def workers(self) -> list[int]:
        """A front's granian workers (its master's children running ``app front``)."""
        return [] if self.proc is None else app_children(self.proc.pid, "front")

    def stop(self, timeout: float = 60.0) -> None:
        if not self.running():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def kill(self) -> None:
        """``kill -9`` of the whole process group (a pod killed)."""
        if self.running():
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Fleet:
    """The cluster, ``engines`` engine processes and ``fronts`` fronts, on loopback."""

    def __init__(self, tmp: Path, redis_url: str, fronts: int = 2, engines: int = 2,
                 front_workers: int = 2, **overrides: str) -> None:  # fmt: skip
        self.tmp = tmp
        unset = ("REDIS_URL", "PROMETHEUS_MULTIPROC_DIR", "WEB_CONCURRENCY")
        base = {k: v for k, v in os.environ.items() if k not in unset}
        base.update(
            REDIS_URL=redis_url, ENGINE_TOKEN=TOKEN, OCR_WORK_DIR=str(tmp / "models"),
            LOG_LEVEL="warning", DISPATCH_CLAIM_MS="3000",
            # Shared cores run the whole fleet and its load: a Redis answer can take longer
            # than the 50 ms default without Redis being down.
            REDIS_TIMEOUT_MS="500",
        )  # fmt: skip
        base.update(overrides)
        engine_ports = [free_port() for _ in range(engines)]
        self.engines = [
            Role("engine", port, {**base, "ENGINE_PORT": str(port),
                                  "PROMETHEUS_MULTIPROC_DIR": self._metrics_dir(f"engine{i}")})
            for i, port in enumerate(engine_ports)
        ]  # fmt: skip
        urls = ",".join(f"http://127.0.0.1:{p}" for p in engine_ports)
        self.fronts = []
        for i in range(fronts):
            port = free_port()
            self.fronts.append(Role("front", port, {
                **base, "HOST": "127.0.0.1", "HTTP_PORT": str(port), "GRPC_ENABLED": "false",
                "WEB_CONCURRENCY": str(front_workers), "ENGINE_URLS": urls,
                "PROMETHEUS_MULTIPROC_DIR": self._metrics_dir(f"front{i}"),
            }))  # fmt: skip
        self._watching = False
        self._watcher: threading.Thread | None = None
        self.restarts: list[tuple[float, str]] = []
        self.parked: set[int] = set()  # engines stopped on purpose: not restarted

    def _metrics_dir(self, name: str) -> str:
        path = self.tmp / f"metrics-{name}"
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def start(self) -> Fleet:
        for engine in self.engines:
            engine.start()
        for engine in self.engines:
            engine.wait_ready()
        for front in self.fronts:
            front.start()
        for front in self.fronts:
            front.wait_ready()
        self._watching = True
        self._watcher = threading.Thread(target=self._restart_dead_engines, daemon=True)
        self._watcher.start()
        return self

    def _restart_dead_engines(self) -> None:
        """The orchestrator's part: an engine process that died is started again after a
        second (a Deployment's pod restart)."""
        while self._watching:
            for i, engine in enumerate(self.engines):
                if i not in self.parked and not engine.running():
                    time.sleep(1.0)
                    if self._watching and i not in self.parked:
                        self.restarts.append((time.time(), f"engine{i}"))
                        engine.start()
            time.sleep(0.5)

    def park_engine(self, i: int) -> None:
        """Stop engine ``i`` gracefully and keep it stopped (a Deployment scaled down by
        one) until ``unpark_engine``."""
        self.parked.add(i)
        self.engines[i].stop()

    def unpark_engine(self, i: int) -> None:
        """Start a parked engine again and wait until it is ready (scaled back up)."""
        self.engines[i].start()
        self.engines[i].wait_ready()
        self.parked.discard(i)

    def stop(self) -> None:
        self._watching = False
        if self._watcher is not None:
            self._watcher.join(5)
        for role in self.fronts + self.engines:
            role.stop()

    def scrape(self, name: str, roles: list[Role] | None = None) -> float:
        """A metric summed over ``roles`` (default every front and engine)."""
        from tests.helpers import metric_sum

        total = 0.0
        for role in roles if roles is not None else self.fronts + self.engines:
            try:
                total += metric_sum(requests.get(f"{role.base}/metrics", timeout=5).text, name)
            except requests.RequestException:
                pass
        return total


@contextmanager
def cluster_fleet(
    tmp: Path, fronts: int = 2, engines: int = 2, **overrides: str
) -> Iterator[tuple[LoopbackCluster, Fleet]]:
    cluster = LoopbackCluster().start()
    fleet = Fleet(tmp, cluster.url, fronts=fronts, engines=engines, **overrides)
    try:
        fleet.start()
        yield cluster, fleet
    finally:
        fleet.stop()
        cluster.stop()
