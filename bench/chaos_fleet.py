"""`make chaos-fleet` (issue 38): the fleet on Redis Cluster while its parts fail, every answer
checked.

The fleet (tests/fleet.py): a Redis Cluster of three masters and three replicas
(``redis-server``, loopback, node timeout 1 s), two fronts (``python -m app front``, two
workers each) and two engine processes (``python -m app engine``), all real processes. The
load is ``bench/chaos.py``'s verifying client: an open-loop rate over corpus images whose true
lines were computed before the run (``no-cache, no-store``), mixed with fresh images (a
numbered band under a corpus image) so misses never stop; every 200 answer is compared with
its image's truth after the run (wrong = the lines differ).

Faults at set times, each the orchestrator's part done as Kubernetes would:
- ``master_kill``: ``kill -9`` of the master that holds the miss queue's hash tag, while
  misses wait and run; its replica takes over, and the dead node is started again 10 s later
  (it rejoins empty, as a replica);
- ``engine_kill``: ``kill -9`` of an engine process mid-load (started again a second later);
- ``worker_kill``: ``kill -9`` of a front's worker (granian replaces it).

Passes when no answer is wrong, non-200s fell only within 20 s after a fault and are under
5 % of all requests, and a fresh miss is answered within 60 s after the run.

    python -m bench.chaos_fleet [--seconds 240] [--rate 3] [--fresh 0.25]
    # -> bench/results/chaos_fleet.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chaos import (
    HOT,
    PADDLE,
    RESULTS,
    Load,
    Record,
    _quantile,
    numbered_variant,
    truths,
    verify,
)
from tests.fleet import Fleet, LoopbackCluster

FAULT_WINDOW_S = 20.0  # non-200s are allowed only this long after a fault
ERROR_SHARE_MAX = 0.05
FRESH_MISS_MAX_S = 60.0
DEADLINE_S = 60  # OCR_TIMEOUT_SECONDS of the fleet


@dataclass
class Fronts:
    """What bench/chaos.py's ``Load`` needs of a stack: front name -> HTTP port (its truths
    come from the front named ``front``)."""

    fronts: dict[str, int] = field(default_factory=dict)


def queue_master(cluster: LoopbackCluster) -> Any:
    """The live master holding the miss queue's keys (``{<prefix>:dispatch:...}``)."""
    for node in cluster.live_masters():
        if any(True for _ in cluster.client(node).scan_iter("{*:dispatch:*", count=1000)):
            return node
    raise LookupError("no master holds the miss queue's keys")


def burst(load: Load, count: int) -> None:
    """``count`` fresh images at once, spread over the fronts: misses queued and running when
    the fault lands (each is checked like every other answer)."""
    fronts = list(load.stack.fronts)
    for i in range(count):
        name, data = load.fresh_image()
        load.send_later(fronts[i % len(fronts)], name, data, fresh=True)


def fault_master_kill(cluster: LoopbackCluster, fleet: Fleet, load: Load) -> str:
    victim = queue_master(cluster)
    replica = cluster.replica_of(victim)
    burst(load, 8)
    time.sleep(0.3)  # the burst's tickets are in the queue, one per engine running
    cluster.kill(victim)
    began = time.monotonic()
    cluster.wait_ok(60)
    promoted = time.monotonic() - began
    time.sleep(10)
    cluster.restart(victim)
    return (f"8 fresh images sent, then kill -9 of the queue's master :{victim.port}; "
            f"replica :{replica.port} promoted after {promoted:.1f} s; the old master "
            f"started again 10 s later, as {cluster.role(victim)}")  # fmt: skip


def fault_engine_kill(cluster: LoopbackCluster, fleet: Fleet, load: Load) -> str:
    burst(load, 4)
    time.sleep(0.3)
    engine = random.choice(fleet.engines)
    engine.kill()
    return (f"4 fresh images sent, then kill -9 of the engine process on :{engine.port} "
            "(started again by the fleet)")  # fmt: skip


def fault_worker_kill(cluster: LoopbackCluster, fleet: Fleet, load: Load) -> str:
    front = random.choice(fleet.fronts)
    pid = random.choice(front.workers())
    os.kill(pid, signal.SIGKILL)
    return f"kill -9 of front worker {pid} (front :{front.port}; granian replaces it)"


FAULTS = {
    "master_kill": fault_master_kill,
    "engine_kill": fault_engine_kill,
    "worker_kill": fault_worker_kill,
}


def fresh_miss_after(load: Load, front: str) -> float | None:
    """Seconds until a never-seen image is answered 200 (MISS) once the run is over."""
    data = numbered_variant("paddleocr_word_en_1.png", 99999)
    began = time.monotonic()
    while time.monotonic() - began < 120:
        status, _body, resp = load.post(front, data, timeout=90)
        if status == "200" and resp is not None and resp.headers.get("X-Cache") == "MISS":
            return round(time.monotonic() - began, 2)
        time.sleep(1)
    return None


def placement(records: list[Record], faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each non-200 and the fault before it: which one, and how many seconds after."""
    out = []
    for r in records:
        if r.status == "200":
            continue
        before = [f for f in faults if f["at"] <= r.sent]
        last = before[-1] if before else None
        out.append({
            "sent": round(r.sent, 1), "status": r.status, "took": r.took, "image": r.image,
            "after_fault": last["fault"] if last else None,
            "seconds_after_fault": round(r.sent - last["at"], 1) if last else None,
        })  # fmt: skip
    return out


def outside_windows(error: dict[str, Any]) -> bool:
    """A non-200 before any fault, or more than ``FAULT_WINDOW_S`` after the last one."""
    after = error["seconds_after_fault"]
    return after is None or after > FAULT_WINDOW_S


def run(
    seconds: float, rate: float, fresh: float, schedule: list[tuple[float, str]]
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="ocr-chaos-fleet-"))
    began = time.time()
    cluster = LoopbackCluster().start()
    fleet = Fleet(
        tmp, cluster.url, fronts=2, engines=2,
        OCR_TIMEOUT_SECONDS=str(DEADLINE_S), LOG_LEVEL="warning",
    )  # fmt: skip
    faults: list[dict[str, Any]] = []
    try:
        fleet.start()
        stack = Fronts({"front": fleet.fronts[0].port, "front-b": fleet.fronts[1].port})
        load = Load(stack, rate, fresh)  # type: ignore[arg-type]  # only .fronts is used
        truth = truths(load, load.hot, [(PADDLE, name) for name in HOT])
        commands_before = cluster.commands_per_master()
        load.began = time.monotonic()
        load.start()
        try:
            for at, name in schedule:
                time.sleep(max(0.0, at - load.now()))
                t0 = load.now()
                try:
                    what = FAULTS[name](cluster, fleet, load)
                except Exception as exc:  # noqa: BLE001 - reported, never hidden
                    what = f"FAULT NOT APPLIED: {exc.__class__.__name__}: {str(exc)[:300]}"
                faults.append({"fault": name, "at": round(t0, 1), "what": what,
                               "applied_after_s": round(load.now() - t0, 1)})  # fmt: skip
                print(f"[chaos-fleet] {t0:6.1f} s  {name}: {what}", flush=True)
            time.sleep(max(0.0, seconds - load.now()))
        finally:
            load.stop()
        fresh_s = fresh_miss_after(load, "front")
        wrong = verify(load, truth)
        commands_after = cluster.commands_per_master()
        keys = cluster.keys_per_master()
        queue_port = queue_master(cluster).port
    finally:
        fleet.stop()
        cluster.stop()
    records = load.records
    errors = placement(records, faults)
    late = [e for e in errors if outside_windows(e)]
    share = len(errors) / max(1, len(records))
    report = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(began)),
        "fleet": "Redis Cluster 3 masters + 3 replicas (redis-server, node timeout 1 s); "
        "2 fronts x 2 workers; 2 engine processes (paddle)",
        "seconds": seconds,
        "rate_per_s": rate,
        "fresh_share": fresh,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "faults": faults,
        "requests": len(records),
        "answers_checked": sum(r.lines is not None for r in records),
        "wrong": len(wrong),
        "wrong_examples": wrong[:10],
        "non_200": len(errors),
        "non_200_share": round(share, 4),
        "non_200_by_status": dict(collections.Counter(e["status"] for e in errors)),
        "non_200_outside_fault_windows": len(late),
        "non_200_list": errors[:200],
        "cache_status": dict(collections.Counter(r.cache for r in records if r.status == "200")),
        "p50_s": _quantile([r.took for r in records if r.status == "200"], 0.5),
        "p99_s": _quantile([r.took for r in records if r.status == "200"], 0.99),
        "max_s": max((r.took for r in records), default=None),
        "fresh_miss_after_run_s": fresh_s,
        "engine_restarts": len(fleet.restarts),
        "keys_per_master_at_end": {str(k): v for k, v in keys.items()},
        "queue_master_at_end": queue_port,
        "commands_per_master_during_run": {
            str(port): count - commands_before.get(port, 0)
            for port, count in commands_after.items()
        },
        "wall_seconds": round(time.time() - began),
    }
    report["passed"] = (
        report["wrong"] == 0
        and not late
        and share < ERROR_SHARE_MAX
        and fresh_s is not None
        and fresh_s <= FRESH_MISS_MAX_S
        and not any(f["what"].startswith("FAULT NOT APPLIED") for f in faults)
    )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=240)
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--fresh", type=float, default=0.25)
    parser.add_argument("--out", default=str(RESULTS / "chaos_fleet.json"))
    args = parser.parse_args(argv)
    # The faults at set times: a third of the run apart, after a warm-up of 30 s.
    step = max(40.0, (args.seconds - 60) / 3)
    schedule = [(30.0, "master_kill"), (30.0 + step, "engine_kill"),
                (30.0 + 2 * step, "worker_kill")]  # fmt: skip
    report = run(args.seconds, args.rate, args.fresh, schedule)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    summary = {k: v for k, v in report.items() if k not in ("non_200_list", "wrong_examples")}
    print(json.dumps(summary, indent=1, default=str))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
