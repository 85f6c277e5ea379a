"""`python -m bench.queue_shards [--rounds N]` (`make bench-shards`, issue 48 item 3): how the
miss queue's work on the Redis masters splits with one queue shard and with three
(``DISPATCH_SHARDS``), on the loopback cluster of ``bench.queue_cost`` (3 masters without
replicas), the same phase: 16 clients send distinct images, 3 at a time each, 3 engine
processes of 2 slots each against the OpenAI-protocol stand-in answering in 1 s (about 3 s of
waiting per miss). With three shards each engine process serves one (``DISPATCH_SHARD``).

Per master, sorted busiest first: its commands and CPU per miss (``INFO``), less what the
same master did per second while the fleet idled just before (the cluster's timers and
gossip, the engines' idle polls), times the phase's length: each master's own work for the
misses. With three shards every master holds a queue. Both layouts store
the same entries on the same masters (spread by MD5), so what moves between them is the
queue's work. ``rounds`` alternate the two layouts, each round on fresh fleets; the report
gives each round and the means. Also the phase's wall time, and how many tickets an engine
took from another shard that asked for help (``helped``: the split of a burst by key leaves
one shard's engine busy while another's idles).

Results: ``bench/results/queue_cost.json``, under ``shards``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from bench import edge
from bench.queue_cost import (
    CALL_S,
    CLIENTS,
    PER_CLIENT,
    SHARED,
    Masters,
    queue_fleet,
    save,
    send_all,
    variants,
)
from tests.fake_vllm import FakeVllm, Recording, answer
from tests.fleet import Fleet, LoopbackCluster
from tests.helpers import metric_sum

ENGINES = 3  # engine processes, one per shard with three
IDLE_S = 8.0  # each master's idle rates, read before the phase


def shard_fleet(folder: Path, cluster: LoopbackCluster, fake_url: str, shards: int) -> Fleet:
    """``bench.queue_cost``'s fleet with ``ENGINES`` engine processes; with several shards,
    engine i serves shard i mod ``shards``."""
    fleet = queue_fleet(folder, cluster, fake_url, ENGINES, DISPATCH_SHARDS=str(shards))
    if shards > 1:
        for i, engine in enumerate(fleet.engines):
            engine.env["DISPATCH_SHARD"] = str(i % shards)
    return fleet


def one_round(folder: Path, fake_url: str, shards: int, first: int) -> dict[str, Any]:
    cluster = LoopbackCluster(masters=3, replicas=0).start()
    fleet = shard_fleet(folder, cluster, fake_url, shards)
    try:
        fleet.start()
        base = fleet.fronts[0].base
        masters = Masters(cluster)
        send_all(base, [[image] for image in variants(6, first + 900)])  # scripts loaded
        time.sleep(3)
        quiet = masters.counters()
        time.sleep(IDLE_S)
        images = variants(CLIENTS * PER_CLIENT, first)
        before = masters.counters()
        wall = send_all(base, [images[i::CLIENTS] for i in range(CLIENTS)])
        after = masters.counters()
        helped = sum(
            metric_sum(requests.get(f"{e.base}/metrics", timeout=10).text,
                       "ocr_dispatch_tickets_total", outcome="helped")
            for e in fleet.engines
        )  # fmt: skip
    finally:
        fleet.stop()
        cluster.stop()
    misses = len(images)
    # Per master: (commands, CPU ms) per miss, less what it does idle (the cluster's own
    # timers and gossip, the engines' idle polls: per second, so a slower phase would look
    # dearer) and the INFO readings; busiest first.
    rows = []
    for p in after:
        idle = [(before[p][k] - quiet[p][k]) / IDLE_S for k in (0, 1)]
        commands = after[p][0] - before[p][0] - 1 - (idle[0] - 1 / IDLE_S) * wall
        cpu_ms = (after[p][1] - before[p][1] - idle[1] * wall) * 1000
        rows.append((commands / misses, cpu_ms / misses))
    rows.sort(reverse=True)
    commands, cpu = [round(r[0], 1) for r in rows], [round(r[1], 3) for r in rows]
    return {
        "misses": misses, "wall_s": round(wall, 2), "helped": int(helped),
        "commands_per_miss_per_master": commands, "cpu_ms_per_miss_per_master": cpu,
        "commands_per_miss_all": round(sum(commands), 1), "cpu_ms_per_miss_all": round(sum(cpu), 3),
        "busiest_master_share_of_commands": round(commands[0] / sum(commands), 2),
        "idle_s": IDLE_S, "loadavg": os.getloadavg(),
    }  # fmt: skip


def main() -> None:
    args = sys.argv[1:]
    rounds = int(args[1]) if args[:1] == ["--rounds"] else 2
    fake = FakeVllm(SHARED / "corpus").start()

    def respond(image: bytes, prompt: str) -> str:
        time.sleep(CALL_S)
        return answer(Recording(), prompt)

    fake.respond = respond
    runs: dict[str, list[dict[str, Any]]] = {"1": [], "3": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(rounds):
                for shards in (1, 3):
                    folder = Path(tmp) / f"{round_}-{shards}"
                    row = one_round(folder, fake.url, shards, 10_000 * (round_ + 1) + shards)
                    runs[str(shards)].append(row)
                    print(shards, "shard(s):", json.dumps(row), flush=True)
    finally:
        fake.stop()
    means = {
        shards: {
            field: [
                round(statistics.mean(row[field][i] for row in rows), 3)
                for i in range(len(rows[0][field]))
            ]
            for field in ("commands_per_miss_per_master", "cpu_ms_per_miss_per_master")
        }
        for shards, rows in runs.items()
    }
    for shards, rows in runs.items():
        means[shards]["wall_s"] = round(statistics.mean(row["wall_s"] for row in rows), 2)
    report = {
        "rounds": runs,
        "means": means,
        "run": {
            "commit": edge._git("rev-parse", "--short", "HEAD"),
            "engines": ENGINES,
            "slots_per_engine": 2,
            "call_s": CALL_S,
            "cpus": os.cpu_count(),
            "when": time.strftime("%Y-%m-%d %H:%M"),
        },  # fmt: skip
    }
    save("shards", report)
    print(json.dumps(means, indent=1))


if __name__ == "__main__":
    main()
