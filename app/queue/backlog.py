"""The work waiting for engines, as the fronts report it: read from Redis when ``/metrics`` or
``/readyz`` asks, so it is right with no engine at all (engines report the queue's other
gauges, ``heartbeat.py``, and at zero there are none to report).

- ``misses``: every ticket in any lane of the miss queue, waiting or running, those held by
  an engine that died included (until another engine reclaims them): one figure for the
  whole fleet, over all tenants' lanes, back to 0 when nothing waits.
- ``jobs``: document jobs waiting for a driver or held by one (their pages become misses
  only once an engine process's driver takes them).
- the live engine slots (the queue's register) and the oldest waiting ticket's wait.

Every front reads the same queue, so a query takes the ``max`` over fronts, never the sum.
KEDA activates the engines on it from zero (``k8s/components/scale-to-zero``). One read of
the queue's picture (``queue_view.lua``, counts only) per scrape or probe, and per shard with
``DISPATCH_SHARDS``: a shard whose master does not answer loses only its own samples (the
totals then sum the shards that answered), not every shard's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from app import metrics
from app.cache.store import RedisStore
from app.jobs.store import JobsUnavailable
from app.queue import inspect

if TYPE_CHECKING:
    from app.service import OcrService


@dataclass(frozen=True)
class Backlog:
    misses: int  # queued or running
    queued: int  # not taken yet (``ocr_dispatch_queue_depth``)
    jobs: int
    engines: int
    oldest_wait_seconds: float
    shards: tuple[int | None, ...] = ()  # with several queue shards: each one's misses
    shard_engines: tuple[int | None, ...] = ()  # and its live engine slots (None: unread)

    def as_json(self) -> dict[str, Any]:
        """``/readyz``'s ``queue``."""
        return {"engines_live": self.engines, "misses_waiting": self.misses,
                "jobs_waiting": self.jobs,
                "oldest_wait_seconds": round(self.oldest_wait_seconds, 3)}  # fmt: skip


def read(service: OcrService) -> Backlog | None:
    """The backlog now; None: no queue (caching off, no Redis) or Redis not answering."""
    cache = service.cache
    queue = cache.misses.queue
    if queue is None or not isinstance(cache.store, RedisStore):
        return None
    shards, live_ms = queue.shards, queue.live_ms
    reads = [
        cache.store.run("dispatch", lambda c, n=names: inspect.read(c, n, live_ms=live_ms, held=0))
        for names in shards
    ]
    by_shard = [snapshot if ok else None for ok, snapshot in reads]
    snapshots = [snapshot for snapshot in by_shard if snapshot is not None]
    if not snapshots:
        return None
    jobs = 0
    if service.jobs is not None:
        try:
            jobs = service.jobs.backlog()
        except JobsUnavailable:
            jobs = 0
    # Over the queue's shards (``DISPATCH_SHARDS``): the sum, the oldest wait the longest.
    oldest = max(snapshot.oldest_wait_ms or 0 for snapshot in snapshots) / 1000
    waiting = sum(snapshot.waiting for snapshot in snapshots)
    misses = waiting + sum(snapshot.running for snapshot in snapshots)
    live = sum(snapshot.live for snapshot in snapshots)
    sharded = len(by_shard) > 1
    shard_misses = tuple(s and s.waiting + s.running for s in by_shard) if sharded else ()
    shard_engines = tuple(s and s.live for s in by_shard) if sharded else ()
    return Backlog(misses, waiting, jobs, live, oldest, shard_misses, shard_engines)


class _Collector:
    def __init__(self, backlog: Backlog) -> None:
        self._backlog = backlog

    def collect(self) -> Iterator[GaugeMetricFamily]:
        backlog = self._backlog
        waiting = GaugeMetricFamily(
            metrics.QUEUE_BACKLOG,
            "Work waiting for an engine, read from Redis by a front (max over fronts): misses "
            "queued or running in any lane, a dead engine's included; document jobs waiting "
            "for or held by a driver",
            labels=["kind"],
        )
        waiting.add_metric(["misses"], backlog.misses)
        waiting.add_metric(["jobs"], backlog.jobs)
        yield waiting
        if backlog.shards:
            yield _per_shard(
                metrics.QUEUE_SHARD_BACKLOG,
                "Misses queued or running in one shard of the miss queue (DISPATCH_SHARDS), "
                "read from Redis by a front (max over fronts): each shard's engines scale on it",
                backlog.shards,
            )
            yield _per_shard(
                metrics.QUEUE_SHARD_ENGINES_LIVE,
                "Engine slots live on one shard of the miss queue (its register), read from "
                "Redis by a front: a shard at 0 with misses waits for its own engines",
                backlog.shard_engines,
            )
        yield GaugeMetricFamily(
            metrics.QUEUE_ENGINES_LIVE,
            "Engine slots live on the miss queue (its register), read from Redis by a front",
            value=backlog.engines,
        )
        yield GaugeMetricFamily(
            metrics.QUEUE_OLDEST_WAIT,
            "How long the oldest miss waiting for an engine has waited, read by a front",
            value=backlog.oldest_wait_seconds,
        )


def _per_shard(name: str, documentation: str, values: tuple[int | None, ...]) -> GaugeMetricFamily:
    """A gauge with one sample per queue shard read (label ``shard``: its index)."""
    family = GaugeMetricFamily(name, documentation, labels=["shard"])
    for shard, value in enumerate(values):
        if value is not None:
            family.add_metric([str(shard)], value)
    return family


def exposition(backlog: Backlog | None) -> bytes:
    """The backlog's gauges in Prometheus' text form (nothing when it could not be read)."""
    if backlog is None:
        return b""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(backlog))
    return generate_latest(registry)
