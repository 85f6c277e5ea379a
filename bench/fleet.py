"""`python -m bench.fleet` (`make bench-fleet`, issue 38): the fleet's capacity on loopback.

Two fleets of real processes (tests/fleet.py) side by side, each of 2 fronts (nginx + one
gunicorn worker each) and 2 engine processes, L1 off (``CACHE_L1_BYTES=0``: every hit is an
L2 hit): ``cluster`` on a Redis Cluster of 3 masters and 3 replicas (``LoopbackCluster``),
``single`` on one Redis node (``EmbeddedRedis``, the same ``maxmemory`` as a cluster node).
The parts, each measured side by side in this one run, the rounds interleaved:

1. **Hits**: L2 hits/s over 1 front and over 2 fronts, on the cluster and on the single node
   (the four alternating, the order rotating each round); the same client processes.
2. **Misses**: distinct misses/s with 2 engine processes and with 1 (the other one parked:
   stopped gracefully, not restarted), on the cluster; with 2 on the single node.
3. **The queue master**: the cluster's commands per master while idle, under hits and under
   misses; one miss run watched with MONITOR on the master holding the miss queue's hash tag
   (``{<prefix>:dispatch:...}``), its commands split by key (queue or entry); that master's
   CPU and ``INFO commandstats`` per miss; the miss rate at which its one slot would be the
   fleet's limit.
4. **Calibration**: engine-seconds per page by size (megapixels: small / medium / large), on
   corpus images the trace does not use.
5. **Trace replay**: requests whose images repeat by a Zipf distribution over the rest of the
   corpus, 8 clients, over both fronts of the cluster fleet, from a cold cache: hit ratio,
   engine calls, engine-seconds and throughput, against what the capacity model
   (docs/DEPLOYMENT.md#capacity-model) predicted from parts 1, 2 and 4 before the replay.
   Then the keys per master (entries, indexes, queue) and the bytes per entry.

Python client processes (one keep-alive connection each; wrk is used by bench/edge.py where
installed, but here requests rotate over many bodies and two fronts). The machine's load
(``os.getloadavg``) is recorded with every run. Results: bench/results/fleet.json.

``python -m bench.fleet --per-image``: each of those images once as a miss, alone, each
page's engine CPU-seconds (bench/results/fleet_per_image.json).

Environment: BENCH_FLEET_ROUNDS (3), BENCH_FLEET_SECONDS (8 per hit run),
BENCH_FLEET_CLIENTS (6 hit clients), BENCH_FLEET_TRACE (500 requests).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import multiprocessing as mp
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from app.embedded_redis import EmbeddedRedis, server_binary
from tests.fleet import Fleet, LoopbackCluster

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("OCR_SHARED_DIR", ROOT.parent / "shared")) / "corpus"
RESULTS = ROOT / "bench" / "results"
SCRIPTS = ROOT / "app" / "cache" / "scripts"
ROUNDS = int(os.environ.get("BENCH_FLEET_ROUNDS", "3"))
HIT_SECONDS = float(os.environ.get("BENCH_FLEET_SECONDS", "8"))
HIT_CLIENTS = int(os.environ.get("BENCH_FLEET_CLIENTS", "6"))
TRACE_REQUESTS = int(os.environ.get("BENCH_FLEET_TRACE", "500"))
MISS_CLIENTS, TRACE_CLIENTS, CALIBRATION_CLIENTS = 4, 8, 2
HIT_IMAGES, MISS_IMAGES = 12, 10
ZIPF_S = 1.1  # popularity of the k-th most requested image ~ 1 / k^s
SEED = 38
MAX_MEGAPIXELS, MAX_BYTES = 2.5, 800_000  # the corpus's giants (12-35 MP) left out
# Size classes by pixels (the engine's time follows the pixels and the text, not the bytes).
CLASSES = (("small", 0.0, 0.3), ("medium", 0.3, 1.0), ("large", 1.0, MAX_MEGAPIXELS))
ENTRY_PATTERN = "ocr:v[0-9]*"  # every cache key (entries and their indexes), no service state
PATH = "/v1/ocr"
HEADERS = {"Content-Type": "application/json"}
HEADROOM = 0.7  # the capacity model sizes parts to 70 % busy


# ---------------------------------------------------------------- images


@dataclass(frozen=True)
class Image:
    name: str
    data: bytes
    megapixels: float

    @property
    def size_class(self) -> str:
        return size_class(self.megapixels)

    @property
    def body(self) -> bytes:
        return json.dumps({"image": base64.b64encode(self.data).decode()}).encode()


def size_class(megapixels: float) -> str:
    return next(name for name, lo, hi in CLASSES if lo <= megapixels < hi)


def corpus() -> list[Image]:
    """The corpus's images up to MAX_MEGAPIXELS and MAX_BYTES, in name order."""
    out = []
    with (CORPUS / "MANIFEST.tsv").open(encoding="utf-8") as manifest:
        rows = [line.rstrip("\n").split("\t") for line in manifest][1:]
    for row in sorted(rows):
        name, width, height, size = row[0], int(row[4]), int(row[5]), int(row[6])
        megapixels = width * height / 1e6
        if megapixels < MAX_MEGAPIXELS and size <= MAX_BYTES:
            out.append(Image(name, (CORPUS / name).read_bytes(), megapixels))
    return out


def split(images: list[Image]) -> tuple[list[Image], list[Image]]:
    """Every third image of each size class calibrates the model; the trace uses the rest."""
    calibration, trace = [], []
    for name, _, _ in CLASSES:
        members = [im for im in images if im.size_class == name]
        calibration += members[::3]
        trace += [im for i, im in enumerate(members) if i % 3]
    return calibration, trace


def ordinary(images: list[Image], count: int) -> list[Image]:
    """``count`` images of ordinary size (20-150 KB), in name order."""
    return [im for im in images if 20_000 <= len(im.data) <= 150_000][:count]


# ---------------------------------------------------------------- clients


def _hit_client(
    port: int, bodies: list[bytes], offset: int, start_at: float, stop_at: float, out: mp.Queue
) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    latencies: list[float] = []
    errors, i = 0, offset
    time.sleep(max(0.0, start_at - time.monotonic()))
    while time.monotonic() < stop_at:
        start = time.perf_counter()
        try:
            conn.request("POST", PATH, body=bodies[i % len(bodies)], headers=HEADERS)
            resp = conn.getresponse()
            resp.read()
            ok = resp.status == 200 and resp.getheader("X-Cache") == "HIT"
        except OSError:
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            ok = False
        if ok:
            latencies.append(time.perf_counter() - start)
        else:
            errors += 1
        i += 1
    conn.close()
    out.put((latencies, errors))


def hit_load(ports: list[int], bodies: list[bytes], clients: int, seconds: float) -> dict:
    """``clients`` processes for ``seconds``, process i sending to ``ports[i % len(ports)]``,
    each rotating over ``bodies`` (all cached): hits/s, p50, p99."""
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    start_at = time.monotonic() + 0.5  # the forks are done by then
    stop_at = start_at + seconds
    procs = [
        ctx.Process(
            target=_hit_client, args=(ports[i % len(ports)], bodies, i * 3, start_at, stop_at, out)
        )
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    latencies = sorted(x for lat, _ in results for x in lat)
    return {
        "hits": len(latencies),
        "errors": sum(e for _, e in results),
        "hits_per_s": round(len(latencies) / seconds, 1),
        "p50_ms": round(_pct(latencies, 0.5) * 1000, 2),
        "p99_ms": round(_pct(latencies, 0.99) * 1000, 2),
        "loadavg": _load(),
    }


def _pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _trace_client(
    ports: list[int], bodies: dict[str, bytes], trace: list[str], counter: Any, out: mp.Queue
) -> None:
    conns = {p: http.client.HTTPConnection("127.0.0.1", p, timeout=300) for p in ports}
    rows = []
    while True:
        with counter.get_lock():
            i = counter.value
            counter.value += 1
        if i >= len(trace):
            break
        port = ports[i % len(ports)]
        start = time.perf_counter()
        try:
            conns[port].request("POST", PATH, body=bodies[trace[i]], headers=HEADERS)
            resp = conns[port].getresponse()
            resp.read()
            status, cache = resp.status, resp.getheader("X-Cache") or ""
        except OSError as exc:
            conns[port].close()
            conns[port] = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            status, cache = 0, type(exc).__name__
        rows.append((i, status, cache, time.perf_counter() - start))
    out.put(rows)


def replay(ports: list[int], bodies: dict[str, bytes], trace: list[str], clients: int) -> dict:
    """The trace in its order from ``clients`` processes (each takes the next request),
    request i to ``ports[i % len(ports)]``."""
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    counter = ctx.Value("i", 0)
    procs = [
        ctx.Process(target=_trace_client, args=(ports, bodies, trace, counter, out))
        for _ in range(clients)
    ]
    start = time.perf_counter()
    for p in procs:
        p.start()
    rows = sorted(r for _ in procs for r in out.get())
    wall = time.perf_counter() - start
    for p in procs:
        p.join()
    return {"wall_s": wall, "rows": rows}


def misses(ports: list[int], images: list[Image], clients: int) -> float:
    """Wall seconds for ``clients`` threads to send ``images`` (request i to port i % n)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", ports[i % len(ports)], timeout=300)
        try:
            conn.request("POST", PATH, body=images[i].body, headers=HEADERS)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{images[i].name}: {resp.status} {body[:200]!r}")
        finally:
            conn.close()

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(len(images))))
    return time.perf_counter() - start


# ---------------------------------------------------------------- Redis


class Backend:
    """A fleet's Redis, cluster or single node, with the handful of questions asked of it."""

    def __init__(self, name: str, cluster: LoopbackCluster | None, single: EmbeddedRedis | None):
        self.name, self.cluster, self.single = name, cluster, single

    def masters(self) -> list[redis.Redis]:
        if self.cluster is not None:
            return [self.cluster.client(n) for n in self.cluster.live_masters()]
        assert self.single is not None
        return [redis.Redis(port=self.single.port, socket_timeout=5)]

    def flush(self) -> None:
        """The cache's keys only (entries and indexes); the queue and its engines stay."""
        for client in self.masters():
            keys = list(client.scan_iter(ENTRY_PATTERN, count=1000))
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.unlink(key)
            pipe.execute()

    def stats(self) -> dict[int, dict[str, float]]:
        """Per master: commands processed, CPU seconds, used memory, calls and usec per
        command (INFO stats, cpu, memory, commandstats)."""
        out = {}
        for client in self.masters():
            info = client.info("all")
            port = client.connection_pool.connection_kwargs["port"]
            row = {
                "commands": float(info["total_commands_processed"]),
                "cpu_s": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
                "used_memory": float(info["used_memory"]),
            }
            for key, value in info.items():
                if key.startswith("cmdstat_") and isinstance(value, dict):
                    row[f"calls:{key[8:]}"] = float(value["calls"])
                    row[f"usec:{key[8:]}"] = float(value["usec"])
            out[port] = row
        return out


def delta(after: dict[int, dict[str, float]], before: dict[int, dict[str, float]]) -> dict:
    return {
        port: {k: v - before.get(port, {}).get(k, 0.0) for k, v in row.items()}
        for port, row in after.items()
    }


def queue_master(backend: Backend) -> tuple[int, str]:
    """The port of the master holding the miss queue's hash tag, and the tag (found by its
    keys: the engines' register is there as soon as one engine reported in)."""
    for client in backend.masters():
        for key in client.scan_iter("{*:dispatch:*", count=1000):
            tag = key.decode().split("}", 1)[0] + "}"
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", tag))
            port = client.connection_pool.connection_kwargs["port"]
            for lo, hi, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    assert int(master[1]) == port, (tag, slot, master, port)
            return port, tag
    raise LookupError("no queue key on any master")


KINDS = (
    ("queue", re.compile(r"^\{[^}]*:dispatch:")),
    ("entry", re.compile(r"^ocr:v\d+:[^:]+:[^:]+:\{[0-9a-f]{32}\}$")),
    ("error marker", re.compile(r":error:")),
    ("similarity reference", re.compile(r":simref$")),
    ("pixel index", re.compile(r":px2:")),
    ("similarity index", re.compile(r":simband:")),
    ("document", re.compile(r":doc:")),
)


def key_kind(key: str) -> str:
    return next((name for name, rx in KINDS if rx.search(key)), "other")


def census(backend: Backend) -> dict:
    """Per master: keys by kind, the entries' MEMORY USAGE; bytes per entry overall."""
    per_master: dict[int, dict[str, int]] = {}
    entry_bytes: list[int] = []
    index_bytes: list[int] = []
    for client in backend.masters():
        port = client.connection_pool.connection_kwargs["port"]
        kinds: Counter[str] = Counter()
        for raw in client.scan_iter("*", count=1000):
            key = raw.decode()
            kind = key_kind(key)
            kinds[kind] += 1
            if kind == "entry":
                entry_bytes.append(int(client.memory_usage(raw) or 0))
            elif kind == "pixel index":
                index_bytes.append(int(client.memory_usage(raw) or 0))
        per_master[port] = dict(sorted(kinds.items()))
    return {
        "keys_per_master": per_master,
        "entries": len(entry_bytes),
        "entry_memory_usage_mean_bytes": round(statistics.mean(entry_bytes)) if entry_bytes else 0,
        "pixel_index_keys": len(index_bytes),
        "pixel_index_memory_usage_bytes": sum(index_bytes),
    }


@contextlib.contextmanager
def monitored(port: int, tag: str) -> Iterator[Counter[str]]:
    """MONITOR on one master while the block runs: its commands counted by what they touch
    (``queue:<command>`` for a key under the queue's hash tag, ``other:<command>`` else)."""
    counts: Counter[str] = Counter()
    scripts = {
        Path(f).stem: hashlib.sha1(Path(f).read_bytes(), usedforsecurity=False).hexdigest()
        for f in SCRIPTS.glob("*.lua")
    }
    by_sha = {sha: name for name, sha in scripts.items()}
    stop = threading.Event()
    ready = threading.Event()

    def watch() -> None:
        client = redis.Redis(port=port, socket_timeout=None)
        with client.monitor() as monitor:
            ready.set()
            while not stop.is_set():
                seen = monitor.next_command()
                command = seen["command"]
                words = command.split(" ", 2)
                name = words[0].lower()
                if name == "evalsha" and len(words) > 1:
                    name = f"evalsha {by_sha.get(words[1], words[1][:8])}"
                where = "queue" if tag in command else "other"
                source = "script" if seen.get("client_type") == "lua" else "client"
                counts[f"{source}:{where}:{name}"] += 1

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    ready.wait(5)
    try:
        yield counts
    finally:
        stop.set()
        thread.join(10)  # the engines' polls reach it within a second


# ---------------------------------------------------------------- the parts


def engine_totals(fleet: Fleet) -> tuple[float, float]:
    """Engine calls and engine-seconds so far, summed over the fleet's engines."""
    return (
        fleet.scrape("ocr_engine_calls_total", fleet.engines),
        fleet.scrape("ocr_engine_duration_seconds_sum", fleet.engines),
    )


def engine_cpu(fleet: Fleet) -> float:
    """CPU seconds the fleet's engine processes (and their children) have used: unlike the
    engines' own duration metric (wall time of each call), not stretched by a busy host."""
    return role_cpu(fleet.engines)


def role_cpu(roles: list[Any]) -> float:
    """CPU seconds of these roles' processes and their children (a front's gunicorn
    workers and nginx), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for role in roles:
        if role.proc is None:
            continue
        for pid in [role.proc.pid, *role.children()]:
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
    return total


def warm(fleet: Fleet, images: list[Image]) -> None:
    misses([f.port for f in fleet.fronts], images, CALIBRATION_CLIENTS)


def measure_hits(
    fleets: dict[str, Fleet], backends: dict[str, Backend], hit_set: list[Image]
) -> dict:
    bodies = [im.body for im in hit_set]
    configs = [(name, n) for name in fleets for n in (1, 2)]
    runs: dict[str, list[dict]] = {f"{name}/{n}": [] for name, n in configs}
    for fleet in fleets.values():
        warm(fleet, hit_set)
        hit_load([fleet.fronts[0].port], bodies, 2, 1.0)  # the connections' first requests
    for r in range(ROUNDS):
        shift = r % len(configs)
        for name, n in configs[shift:] + configs[:shift]:
            ports = [f.port for f in fleets[name].fronts[:n]]
            before = backends[name].stats()
            cpu = role_cpu(fleets[name].fronts)
            run = hit_load(ports, bodies, HIT_CLIENTS, HIT_SECONDS)
            run["front_cpu_us_per_hit"] = round(
                (role_cpu(fleets[name].fronts) - cpu) * 1e6 / max(run["hits"], 1)
            )
            d = delta(backends[name].stats(), before)
            run["redis_cpu_us_per_hit"] = round(
                sum(row["cpu_s"] for row in d.values()) * 1e6 / max(run["hits"], 1), 1
            )
            if name == "cluster":
                run["commands_per_master"] = {p: row["commands"] for p, row in d.items()}
            runs[f"{name}/{n}"].append(run)
            print(
                f"hits round {r + 1} {name} {n} front(s): {run['hits_per_s']}/s "
                f"p99 {run['p99_ms']} ms errors {run['errors']} load {run['loadavg']}",
                flush=True,
            )
    med = {k: statistics.median(x["hits_per_s"] for x in v) for k, v in runs.items()}
    return {
        "images": [im.name for im in hit_set],
        "clients": HIT_CLIENTS,
        "seconds_per_run": HIT_SECONDS,
        "median_hits_per_s": med,
        "median_p99_ms": {k: statistics.median(x["p99_ms"] for x in v) for k, v in runs.items()},
        # CPU of the fronts (gunicorn master and workers, nginx) per hit: what sizes them.
        "median_redis_cpu_us_per_hit": {
            k: statistics.median(x["redis_cpu_us_per_hit"] for x in v) for k, v in runs.items()
        },
        "median_front_cpu_us_per_hit": {
            k: statistics.median(x["front_cpu_us_per_hit"] for x in v) for k, v in runs.items()
        },
        "two_fronts_over_one": {n: round(med[f"{n}/2"] / med[f"{n}/1"], 3) for n in fleets},
        "cluster_over_single": {
            f"{n} front(s)": round(med[f"cluster/{n}"] / med[f"single/{n}"], 3) for n in (1, 2)
        },
        "runs": runs,
    }


def measure_misses(
    fleets: dict[str, Fleet],
    backends: dict[str, Backend],
    images: list[Image],
    queue: tuple[int, str],
) -> dict:
    cluster = fleets["cluster"]
    configs = ["cluster/2", "cluster/1", "single/2"]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    queue_port, tag = queue
    for name, fleet in fleets.items():  # every engine's first calls on these images
        backends[name].flush()
        misses([f.port for f in fleet.fronts], images, MISS_CLIENTS)
    for r in range(ROUNDS):
        order = configs if r % 2 == 0 else [configs[1], configs[0], configs[2]]
        for config in order:
            name, engines = config.split("/")
            fleet = fleets[name]
            if name == "cluster":
                if engines == "1" and 1 not in cluster.parked:
                    cluster.park_engine(1)
                elif engines == "2" and 1 in cluster.parked:
                    cluster.unpark_engine(1)
                    time.sleep(2)  # its feeder reported in (it heartbeats every second)
                    backends[name].flush()  # and its first calls are made
                    misses([f.port for f in fleet.fronts], images[:4], MISS_CLIENTS)
            backends[name].flush()
            cpu = engine_cpu(fleet)
            calls, busy = engine_totals(fleet)
            before = backends[name].stats()
            wall = misses([f.port for f in fleet.fronts], images, MISS_CLIENTS)
            after = backends[name].stats()
            calls, busy = (x - y for x, y in zip(engine_totals(fleet), (calls, busy), strict=True))
            cpu = engine_cpu(fleet) - cpu
            run = {
                "wall_s": round(wall, 3),
                "misses_per_s": round(len(images) / wall, 3),
                "engine_calls": calls,
                "engine_seconds": round(busy, 3),
                "engine_busy_parallel": round(busy / wall, 3),  # engines computing at once
                "engine_cpu_seconds": round(cpu, 3),
                "loadavg": _load(),
            }
            if name == "cluster":
                d = delta(after, before)
                run["per_master"] = {
                    p: {
                        k: v
                        for k, v in row.items()
                        if k in ("commands", "cpu_s") or k.startswith("calls:")
                    }
                    for p, row in d.items()
                }
                run["queue_master_usec"] = {
                    k[5:]: v for k, v in d[queue_port].items() if k.startswith("usec:") and v
                }
            runs[config].append(run)
            print(
                f"misses round {r + 1} {config} engine(s): {run['misses_per_s']}/s "
                f"calls {calls} busy x{run['engine_busy_parallel']} load {run['loadavg']}",
                flush=True,
            )
    if 1 in cluster.parked:
        cluster.unpark_engine(1)
        time.sleep(2)
    med = {c: statistics.median(x["misses_per_s"] for x in v) for c, v in runs.items()}
    # The same images one more time, every command on the queue's master watched.
    backends["cluster"].flush()
    before = backends["cluster"].stats()
    with monitored(queue_port, tag) as counts:
        wall = misses([f.port for f in cluster.fronts], images, MISS_CLIENTS)
    watched = delta(backends["cluster"].stats(), before)
    return {
        "images": [im.name for im in images],
        "clients": MISS_CLIENTS,
        "median_misses_per_s": med,
        "median_engine_busy_parallel": {
            c: statistics.median(x["engine_busy_parallel"] for x in v) for c, v in runs.items()
        },
        "median_engine_seconds_per_miss": {
            c: round(statistics.median(x["engine_seconds"] / len(images) for x in v), 3)
            for c, v in runs.items()
        },
        "median_engine_cpu_parallel": {
            c: round(statistics.median(x["engine_cpu_seconds"] / x["wall_s"] for x in v), 3)
            for c, v in runs.items()
        },
        "median_engine_cpu_seconds_per_miss": {
            c: round(statistics.median(x["engine_cpu_seconds"] / len(images) for x in v), 3)
            for c, v in runs.items()
        },
        "two_engines_over_one": round(med["cluster/2"] / med["cluster/1"], 3),
        "cluster_over_single": round(med["cluster/2"] / med["single/2"], 3),
        "runs": runs,
        "monitored": {
            "wall_s": round(wall, 3),
            "misses": len(images),
            "queue_master_commands": dict(sorted(counts.items())),
            "per_master_commands": {p: row["commands"] for p, row in watched.items()},
        },
    }


def measure_idle(backend: Backend, seconds: float = 5.0) -> dict:
    before = backend.stats()
    time.sleep(seconds)
    d = delta(backend.stats(), before)
    return {
        p: {
            "commands_per_s": round(row["commands"] / seconds, 1),
            "cpu_ms_per_s": round(row["cpu_s"] * 1000 / seconds, 2),
        }
        for p, row in d.items()
    }


def queue_limit(mis: dict, idle: dict, hits: dict, queue_port: int, engines: int) -> dict:
    """What one miss costs the queue's master, and the miss rate at which it is saturated."""
    watched = mis["monitored"]
    n = watched["misses"]
    seen = watched["queue_master_commands"]

    def per_miss(prefix: str) -> float:
        return round(sum(v for k, v in seen.items() if k.startswith(prefix)) / n, 1)

    scripts = {k.split(" ", 1)[1]: round(v / n, 2) for k, v in seen.items()
               if k.startswith("client:queue:evalsha ")}  # fmt: skip
    # CPU, commands and execution time per miss, from the 2-engine cluster runs (MONITOR
    # off): the queue's master against the mean of the others (which hold entries only).
    cpu_q, cpu_o, cmd_q, cmd_o, exec_usec = [], [], [], [], []
    count = len(mis["images"])
    for run in mis["runs"]["cluster/2"]:
        rows = run["per_master"]
        others = [row for p, row in rows.items() if p != queue_port]
        cpu_q.append(rows[queue_port]["cpu_s"] / count)
        cpu_o.append(statistics.mean(r["cpu_s"] for r in others) / count)
        cmd_q.append(rows[queue_port]["commands"] / count)
        cmd_o.append(statistics.mean(r["commands"] for r in others) / count)
        usec, calls = run["queue_master_usec"], rows[queue_port]
        # EVALSHA's time holds its scripts' inner commands; the client's own other commands
        # on the queue's keys (MONITOR's count per miss) at their mean cost per call.
        total = usec.get("evalsha", 0.0) / count
        for key, times in seen.items():
            source, where, name = key.split(":", 2)
            if source == "client" and where == "queue" and not name.startswith("evalsha"):
                made = calls.get(f"calls:{name}", 0.0)
                if made:
                    total += times / n * usec.get(name, 0.0) / made
        exec_usec.append(total)
    others_idle = [row for p, row in idle.items() if p != queue_port]
    idle_extra = idle[queue_port]["cpu_ms_per_s"] - statistics.mean(
        r["cpu_ms_per_s"] for r in others_idle
    )
    wall = statistics.median(r["wall_s"] for r in mis["runs"]["cluster/2"]) / count
    cpu_queue = statistics.median(cpu_q) - statistics.median(cpu_o)
    cpu_polls = max(idle_extra, 0.0) / 1000 * wall  # the idle engines' polls meanwhile
    cpu_net = max(cpu_queue - cpu_polls, 1e-9)
    usec_per_miss = statistics.median(exec_usec)
    hit_runs = hits["runs"]["cluster/1"] + hits["runs"]["cluster/2"]
    hit_share = [
        r["commands_per_master"][queue_port] / sum(r["commands_per_master"].values())
        for r in hit_runs
    ]
    q, o = statistics.median(cmd_q), statistics.median(cmd_o)
    return {
        "queue_master": queue_port,
        "waiting_seconds_per_miss": round(MISS_CLIENTS * wall, 2),
        "monitored_client_commands_per_miss_queue_keys": per_miss("client:queue:"),
        "monitored_client_commands_per_miss_other_keys": per_miss("client:other:"),
        "monitored_script_inner_commands_per_miss": per_miss("script:"),
        "monitored_scripts_per_miss": scripts,
        "commands_per_miss_queue_master": round(q, 1),
        "commands_per_miss_other_masters_mean": round(o, 1),
        "share_of_commands_on_queue_master_misses": round(q / (q + 2 * o), 3),
        "share_of_commands_on_queue_master_hits": round(statistics.median(hit_share), 3),
        "idle_commands_per_s_queue_master": idle[queue_port]["commands_per_s"],
        "idle_commands_per_s_per_engine": round(idle[queue_port]["commands_per_s"] / engines, 1),
        "idle_cpu_ms_per_s_queue_master_over_others": round(idle_extra, 2),
        "exec_usec_per_miss_queue": round(usec_per_miss, 1),
        "cpu_ms_per_miss_queue_master_minus_others": round(cpu_queue * 1000, 3),
        "cpu_ms_per_miss_of_idle_polls": round(cpu_polls * 1000, 3),
        "cpu_ms_per_miss_queue": round(cpu_net * 1000, 3),
        # One Redis main thread, fully busy with the queue's work alone.
        "limit_misses_per_s_cpu": round(1 / cpu_net),
        "limit_misses_per_s_exec_time": round(1e6 / usec_per_miss) if usec_per_miss else None,
        "formula": "limit_cpu = 1 s / (queue master CPU per miss - mean other master CPU per "
        "miss - the idle engines' extra poll CPU during a miss); limit_exec_time = 1 s / "
        "(EVALSHA usec per miss + the client's other queue commands per miss x their usec per "
        "call, INFO commandstats); both from the 2-engine cluster miss runs",
    }


def calibrate(fleet: Fleet, backend: Backend, images: list[Image]) -> dict:
    """Engine-seconds per page by size class: each class's images as misses, 2 clients."""
    out = {}
    ports = [f.port for f in fleet.fronts]
    for name, _, _ in CLASSES:
        members = [im for im in images if im.size_class == name]
        backend.flush()
        cpu = engine_cpu(fleet)
        calls, busy = engine_totals(fleet)
        wall = misses(ports, members, CALIBRATION_CLIENTS)
        calls, busy = (x - y for x, y in zip(engine_totals(fleet), (calls, busy), strict=True))
        cpu = engine_cpu(fleet) - cpu
        out[name] = {
            "images": len(members),
            "mean_megapixels": round(statistics.mean(im.megapixels for im in members), 3),
            "mean_kb": round(statistics.mean(len(im.data) for im in members) / 1000, 1),
            "engine_calls": calls,
            "engine_seconds_per_page": round(busy / max(calls, 1), 3),
            "engine_cpu_seconds_per_page": round(cpu / max(calls, 1), 3),
            "wall_s": round(wall, 2),
            "loadavg": _load(),
        }
        print(f"calibration {name}: {out[name]}", flush=True)
    return out


def zipf_trace(images: list[Image], n: int, s: float) -> tuple[list[str], list[float]]:
    """``n`` requests over ``images``, the k-th most popular with probability ~ 1/k^s; the
    popularity order drawn at random (not by size)."""
    rng = random.Random(SEED)
    ranked = images[:]
    rng.shuffle(ranked)
    weights = [1 / k**s for k in range(1, len(ranked) + 1)]
    total = sum(weights)
    probs = [w / total for w in weights]
    trace = [im.name for im in rng.choices(ranked, weights=probs, k=n)]
    return trace, probs


def predict(
    trace: list[str], probs: list[float], images: dict[str, Image], cal: dict, hits: dict, mis: dict
) -> dict:
    """The capacity model of docs/DEPLOYMENT.md#capacity-model, before the replay."""
    n = len(trace)
    distinct = list(dict.fromkeys(trace))
    expected_distinct = sum(1 - (1 - p) ** n for p in probs)
    engine_s = sum(cal[images[name].size_class]["engine_seconds_per_page"] for name in distinct)
    cpu_s = sum(cal[images[name].size_class]["engine_cpu_seconds_per_page"] for name in distinct)
    parallel = mis["median_engine_busy_parallel"]["cluster/2"]
    cores = mis["median_engine_cpu_parallel"]["cluster/2"]
    hit_rate = hits["median_hits_per_s"]["cluster/2"]
    hits_n = n - len(distinct)
    miss_s, hit_s = engine_s / parallel, hits_n / hit_rate
    cpu_wall = cpu_s / cores + hit_s
    return {
        "requests": n,
        "distinct_images_drawn": len(distinct),
        "expected_distinct_images": round(expected_distinct, 1),
        # Requests answered without an engine call of their own (HIT or COALESCED).
        "hit_ratio": round(1 - len(distinct) / n, 3),
        "hit_ratio_expected_from_zipf": round(1 - expected_distinct / n, 3),
        "engine_calls": len(distinct),
        "engine_seconds": round(engine_s, 2),
        "engine_cpu_seconds": round(cpu_s, 2),
        "engines_busy_in_parallel": parallel,
        "engine_cores_in_use": cores,
        "hits_per_s_two_fronts": hit_rate,
        # Shared cores: engine time and front time add up. Own cores: the slower part.
        "wall_s_shared_cores": round(miss_s + hit_s, 2),
        "wall_s_own_cores": round(max(miss_s, hit_s), 2),
        "requests_per_s_shared_cores": round(n / (miss_s + hit_s), 2),
        "requests_per_s_own_cores": round(n / max(miss_s, hit_s), 2),
        # The same from engine CPU-seconds and the cores the engines got in the miss runs.
        "wall_s_from_cpu": round(cpu_wall, 2),
        "requests_per_s_from_cpu": round(n / cpu_wall, 2),
        "mix": dict(Counter(images[name].size_class for name in distinct)),
    }


def measure_trace(
    fleet: Fleet, backend: Backend, pool: list[Image], cal: dict, hits: dict, mis: dict
) -> dict:
    trace, probs = zipf_trace(pool, TRACE_REQUESTS, ZIPF_S)
    by_name = {im.name: im for im in pool}
    predicted = predict(trace, probs, by_name, cal, hits, mis)
    print(f"trace predicted: {predicted}", flush=True)
    backend.flush()
    stats_before = backend.stats()
    calls, busy = engine_totals(fleet)
    bodies = {name: by_name[name].body for name in set(trace)}
    cpu = engine_cpu(fleet)
    result = replay([f.port for f in fleet.fronts], bodies, trace, TRACE_CLIENTS)
    calls, busy = (x - y for x, y in zip(engine_totals(fleet), (calls, busy), strict=True))
    cpu = engine_cpu(fleet) - cpu
    d = delta(backend.stats(), stats_before)
    rows = result["rows"]
    statuses = Counter(r[1] for r in rows)
    caches = Counter(r[2] for r in rows)
    hit_lat = sorted(r[3] for r in rows if r[2] == "HIT")
    wall = result["wall_s"]
    measured = {
        "requests": len(rows),
        "statuses": dict(statuses),
        "x_cache": dict(caches),
        "hit_ratio": round(caches["HIT"] / len(rows), 3),
        "hit_or_coalesced_ratio": round((caches["HIT"] + caches["COALESCED"]) / len(rows), 3),
        "engine_calls": calls,
        "engine_seconds": round(busy, 2),
        "engine_cpu_seconds": round(cpu, 2),
        "engines_busy_in_parallel": round(busy / wall, 3),
        "engine_cores_in_use": round(cpu / wall, 3),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(rows) / wall, 2),
        "hit_p50_ms": round(_pct(hit_lat, 0.5) * 1000, 2),
        "hit_p99_ms": round(_pct(hit_lat, 0.99) * 1000, 2),
        "used_memory_delta_bytes": {p: int(row["used_memory"]) for p, row in d.items()},
        "commands_per_master": {p: row["commands"] for p, row in d.items()},
        "loadavg": _load(),
    }
    print(f"trace measured: {measured}", flush=True)
    popularity = Counter(trace)
    return {
        "requests": TRACE_REQUESTS,
        "zipf_s": ZIPF_S,
        "clients": TRACE_CLIENTS,
        "universe": len(pool),
        "universe_mix": dict(Counter(im.size_class for im in pool)),
        "top5_shares": [round(c / len(trace), 3) for _, c in popularity.most_common(5)],
        "predicted": predicted,
        "measured": measured,
        "measured_over_predicted": {
            "engine_calls": round(calls / predicted["engine_calls"], 3),
            "engine_seconds": round(busy / predicted["engine_seconds"], 3),
            "engine_cpu_seconds": round(cpu / predicted["engine_cpu_seconds"], 3),
            "hit_or_coalesced_ratio": round(
                measured["hit_or_coalesced_ratio"] / predicted["hit_ratio"], 3
            ),
            "requests_per_s_vs_shared_cores": round(
                measured["requests_per_s"] / predicted["requests_per_s_shared_cores"], 3
            ),
            "requests_per_s_vs_from_cpu": round(
                measured["requests_per_s"] / predicted["requests_per_s_from_cpu"], 3
            ),
        },
    }


# ---------------------------------------------------------------- main


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _redis_version() -> str:
    out = subprocess.run([server_binary(), "--version"], capture_output=True, text=True).stdout
    return out.strip()


def main() -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    images = corpus()
    calibration_set, trace_pool = split(images)
    hit_set = ordinary(calibration_set, HIT_IMAGES)
    miss_set = ordinary(calibration_set[::-1], MISS_IMAGES)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "command": "python -m bench.fleet (make bench-fleet)",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "redis": _redis_version(),
            "loadavg_start": _load(),
        },
        "layout": {
            "per_fleet": "2 fronts (nginx + 1 gunicorn worker each, gRPC off) and 2 engine "
            "processes (PaddleOCR, 1 slot each), CACHE_L1_BYTES=0",
            "cluster": "LoopbackCluster: 3 masters + 3 replicas, maxmemory 256mb each",
            "single": "EmbeddedRedis: one node, maxmemory 256mb",
            "clients": "Python processes, one keep-alive connection each, on the same cores",
        },
    }
    stop: list[Callable[[], None]] = []
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        try:
            cluster = LoopbackCluster()
            stop.append(cluster.stop)
            cluster.start()
            single = EmbeddedRedis(extra_args=["--maxmemory", "256mb"])
            stop.append(single.cleanup)
            single.start()
            env = {"CACHE_L1_BYTES": "0"}
            fleets = {
                "cluster": Fleet(
                    Path(tmp) / "cluster", cluster.url, fronts=2, engines=2, front_workers=1, **env
                ),
                "single": Fleet(
                    Path(tmp) / "single", single.url, fronts=2, engines=2, front_workers=1, **env
                ),
            }
            for fleet in fleets.values():
                stop.insert(0, fleet.stop)
                fleet.start()
            backends = {
                "cluster": Backend("cluster", cluster, None),
                "single": Backend("single", None, single),
            }
            queue = queue_master(backends["cluster"])
            report["queue"] = {
                "tag": queue[1],
                "master": queue[0],
                "masters": sorted(cluster.commands_per_master()),
            }
            print(f"fleets up in {time.monotonic() - started:.0f} s; queue {queue}", flush=True)
            idle = measure_idle(backends["cluster"])
            hits = measure_hits(fleets, backends, hit_set)
            report["hits"] = hits
            mis = measure_misses(fleets, backends, miss_set, queue)
            report["misses"] = mis
            report["idle_per_master"] = idle
            report["queue_limit"] = queue_limit(mis, idle, hits, queue[0], engines=2)
            print(f"queue limit: {report['queue_limit']}", flush=True)
            fleets["single"].stop()  # the rest on the cluster fleet alone
            cal = calibrate(fleets["cluster"], backends["cluster"], calibration_set)
            report["calibration"] = cal
            report["trace"] = measure_trace(
                fleets["cluster"], backends["cluster"], trace_pool, cal, hits, mis
            )
            report["census_after_trace"] = census(backends["cluster"])
        finally:
            for fn in stop:
                with contextlib.suppress(Exception):
                    fn()
    report["entry_size_reference"] = _entry_size_reference()
    report["machine"]["loadavg_end"] = _load()
    report["seconds"] = round(time.monotonic() - started)
    out = RESULTS / "fleet.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    summary = {
        "hits two fronts / one": report["hits"]["two_fronts_over_one"],
        "hits cluster / single": report["hits"]["cluster_over_single"],
        "misses two engines / one": report["misses"]["two_engines_over_one"],
        "misses cluster / single": report["misses"]["cluster_over_single"],
        "queue master limit (misses/s)": report["queue_limit"]["limit_misses_per_s_cpu"],
        "trace measured / predicted": report["trace"]["measured_over_predicted"],
    }
    print(json.dumps(summary, indent=2))
    print(f"wrote {out} in {report['seconds']} s")
    return 0


def _entry_size_reference() -> dict:
    """bench/results/entry_size.json's mean MEMORY USAGE per entry, for comparison."""
    path = RESULTS / "entry_size.json"
    if not path.is_file():
        return {}
    rows = json.loads(path.read_text())["lines"]["rows"]
    return {
        "images": len(rows),
        "mean_memory_usage_bytes": round(statistics.mean(r["memory_usage"] for r in rows)),
    }


def per_image() -> int:
    """``--per-image``: every image the bench uses, once each as a miss, one engine process
    and one client on one Redis node: each page's engine CPU-seconds and call seconds (how
    far a size class's mean is from its members). bench/results/fleet_per_image.json."""
    images = corpus()
    calibration_set, _ = split(images)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        with EmbeddedRedis(extra_args=["--maxmemory", "256mb"]) as server:
            fleet = Fleet(Path(tmp), server.url, fronts=1, engines=1, front_workers=1,
                          CACHE_L1_BYTES="0")  # fmt: skip
            try:
                fleet.start()
                port = fleet.fronts[0].port
                misses([port], images[:3], 1)  # the engine's first calls
                for im in images:
                    cpu, busy = engine_cpu(fleet), engine_totals(fleet)[1]
                    misses([port], [im], 1)
                    rows.append({
                        "image": im.name, "class": im.size_class,
                        "megapixels": round(im.megapixels, 3),
                        "set": "calibration" if im in calibration_set else "trace",
                        "engine_cpu_s": round(engine_cpu(fleet) - cpu, 3),
                        "engine_s": round(engine_totals(fleet)[1] - busy, 3),
                    })  # fmt: skip
                    print(rows[-1], flush=True)
            finally:
                fleet.stop()
    summary: dict[str, Any] = {}
    for name, _, _ in CLASSES:
        for part in ("calibration", "trace"):
            cpu = [r["engine_cpu_s"] for r in rows if r["class"] == name and r["set"] == part]
            summary[f"{name}/{part}"] = {
                "images": len(cpu),
                "mean_engine_cpu_s": round(statistics.mean(cpu), 3),
                "min": min(cpu),
                "max": max(cpu),
            }
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "command": "python -m bench.fleet --per-image",
        "loadavg": _load(),
        "by_class": summary,
        "rows": rows,
    }
    out = RESULTS / "fleet_per_image.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(per_image() if "--per-image" in sys.argv[1:] else main())
