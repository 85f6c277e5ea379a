"""Small helpers shared by the HTTP tests."""

from __future__ import annotations

import base64
import re
import threading
from typing import Any

import psutil

from app.queue.ticket import ERROR_TTL_S
from app.vocabulary import EngineError


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def app_children(pid: int, role: str | None = None, *, recursive: bool = False) -> list[int]:
    """The processes ``pid`` started (every descendant with ``recursive``), sorted; with
    ``role``, those running ``python -m app ROLE``. One that ended meanwhile, or a zombie not
    yet reaped (a worker just killed), is left out."""
    try:
        found = psutil.Process(pid).children(recursive=recursive)
    except psutil.NoSuchProcess:
        return []
    pids = []
    for child in found:
        try:
            if role is None or child.cmdline()[-3:] == ["-m", "app", role]:
                pids.append(child.pid)
        except psutil.Error:
            continue
    return sorted(pids)


def front_workers_of(serve_pid: int) -> list[int]:
    """The front's granian workers under ``python -m app serve``: the ``app front`` children
    of its ``app front`` child (every such child, should one be restarting)."""
    masters = app_children(serve_pid, "front")
    return sorted(worker for master in masters for worker in app_children(master, "front"))


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum every sample of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if not m:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


class FlakyEngine:
    """The real engine, failing with ``EngineError`` while ``failing`` is set: what a crashing
    runtime looks like to the cache (everything else is the real engine's)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.failing = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def recognize(self, request: Any) -> Any:
        if self.failing.is_set():
            raise EngineError("engine crashed")
        return self._engine.recognize(request)


# Keys beside the entries: the near-duplicate indexes, and a failed ticket's error marker
# (app/engine_side/claims.py: read by that ticket's waiters only, expiring within a minute).
_INDEX_PARTS = (b":px2:", b":simband:", b":simref", b":error:")


def stored_keys(client: Any, pattern: str = "*") -> list[bytes]:
    """Every key matching ``pattern`` but a failed ticket's error markers, which must expire
    within ERROR_TTL_S, and a purge's replication marks (``app/cache/purging.py``, 10 s):
    what "nothing cached" means after a failed or refused request, or a purge."""
    found = client.keys(pattern)
    passing = {b":error:": ERROR_TTL_S, b":purgesync:": 10}
    for part, most in passing.items():
        ttls = {k: client.ttl(k) for k in found if part in k}  # -2: expired meanwhile
        assert all(t == -2 or 0 < t <= most for t in ttls.values()), ttls
    return [k for k in found if not any(part in k for part in passing)]


def entry_keys(client: Any, pattern: str = "ocr:*") -> list[bytes]:
    """The cache entries matching ``pattern``, without the keys written beside them (the
    near-duplicate indexes of app/cache/pixel_index.py and similarity.py, error markers)."""
    return [k for k in client.keys(pattern) if not any(p in k for p in _INDEX_PARTS)]


def stand_in_engine(client: Any, engines_key: str) -> None:
    """Register a live engine that takes nothing (``engines_key``: the queue's register), so
    a front door whose own feeders were stopped (a stopped feeder leaves the register) still
    queues its misses rather than computing them itself."""
    seconds, micros = client.time()
    client.zadd(engines_key, {"stand-in": seconds * 1000 + micros // 1000})
