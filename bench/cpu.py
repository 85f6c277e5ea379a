"""CPU seconds of the processes a benchmark runs, read from /proc around each wrk run: a
server's process tree (nginx apart), Redis, and this process's children (wrk)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")


def stat(pid: int) -> tuple[str, int, float] | None:
    """(comm, parent pid, CPU seconds) of a live process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    return comm, int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds so far of ``root`` and its descendants: nginx's processes apart."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = stat(int(entry))
            if st is not None:
                stats[int(entry)] = st
    family, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (_, ppid, _) in stats.items():
            if ppid == parent and pid not in family:
                family.add(pid)
                frontier.append(pid)
    out = {"nginx": 0.0, "workers": 0.0}
    for pid in family:
        if pid in stats:
            comm, _, cpu = stats[pid]
            out["nginx" if comm.startswith("nginx") else "workers"] += cpu
    return out


def server_cpu(roots: list[int]) -> dict[str, float]:
    """A server's processes: the trees under ``roots`` (its main process, the nginx a
    benchmark started for it apart)."""
    out = {"nginx": 0.0, "workers": 0.0}
    for root in roots:
        for part, cpu in tree_cpu(root).items():
            out[part] += cpu
    return out


def cpu_now(servers: dict[str, list[int]], redis_pid: int) -> dict[str, Any]:
    """``servers``: each one's root processes (``server_cpu``)."""
    children = os.times()
    redis_cpu = stat(redis_pid)
    return {
        "servers": {n: server_cpu(roots) for n, roots in servers.items()},
        "redis": redis_cpu[2] if redis_cpu else 0.0,
        "wrk": children.children_user + children.children_system,
    }


def per_request(
    run: Callable[[], dict[str, Any]], roots: list[int], redis_pid: int
) -> tuple[dict[str, Any], dict[str, float]]:
    """``run()`` (a wrk run; its result counts ``requests``) and the CPU microseconds per
    request that the server (the trees under ``roots``), its nginx, Redis and wrk spent."""
    before = cpu_now({"server": roots}, redis_pid)
    result = run()
    after = cpu_now({"server": roots}, redis_pid)
    n = max(1, result["requests"])
    b, a = before["servers"]["server"], after["servers"]["server"]
    return result, {
        "server": (a["workers"] - b["workers"]) / n * 1e6,
        "nginx": (a["nginx"] - b["nginx"]) / n * 1e6,
        "redis": (after["redis"] - before["redis"]) / n * 1e6,
        "wrk": (after["wrk"] - before["wrk"]) / n * 1e6,
    }
