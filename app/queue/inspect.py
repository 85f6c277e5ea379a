"""The queue, inspectable: one picture of the global miss queue, read in one atomic step
(``queue_view.lua``) that writes nothing. Its lanes (each tenant's tickets waiting and
running, the lane's deficit, share and mean cost, its oldest wait), the engines of the
live-engine register and the tickets each holds. ``GET /admin/queue`` answers it and
``ocr-cache queue`` prints it; the queue's gauges are made of it (``heartbeat.py``).

Times are Redis' clock: a ticket's id is its enqueue time (ms); the register's score is an
engine's last report by its own host's clock (hosts' clocks assumed roughly in sync). A
holder of tickets that is not in the register is an interjector (``{engine}-interject``:
its tickets are listed under its engine, ``interjected``), a consumer that died (its tickets
are reclaimed, ``claims.py``) or one named ``...:handed`` (tickets handed back for another
engine). A held ticket's idle time is how long since it was taken: engines do not touch
tickets while they run them. Lane names are
tenant names: only the admin API shows them; the gauges carry the tenants' metrics labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.cache.keys import QueueKeys
from app.cache.scripts import QUEUE_VIEW
from app.queue.ticket import DEFAULT_LANE, GROUP, INTERJECTOR, as_text

HELD_MAX = 100  # running tickets listed one by one per lane, at most


def tenant_of(lane: str) -> str:
    """The tenant namespace of a lane ("": the default tenant's, ``~``)."""
    return "" if lane == DEFAULT_LANE else lane


def enqueued_ms(ticket_id: str) -> int:
    """When a ticket was queued (ms, Redis' clock): its stream entry id's first part."""
    return int(ticket_id.partition("-")[0])


@dataclass(frozen=True)
class Held:
    """A running ticket: its holder, how long since it was taken (or claimed), and how many
    times it was delivered (more than 1: reclaimed from a holder that died)."""

    id: str
    lane: str
    consumer: str
    idle_ms: int
    deliveries: int

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "lane": self.lane, "tenant": tenant_of(self.lane),
                "idle_ms": self.idle_ms, "deliveries": self.deliveries,
                "interjected": self.consumer.endswith(INTERJECTOR)}  # fmt: skip


@dataclass(frozen=True)
class Lane:
    """One tenant's lane: ``deficit`` (engine seconds of credit; negative: in debt) is None
    while the lane is not in the round robin's turn, ``cost`` (its mean ticket, seconds)
    until one of its tickets finished; ``holders``: consumer -> its running tickets."""

    lane: str
    waiting: int
    running: int
    oldest_wait_ms: int | None
    deficit: float | None
    share: float
    cost: float | None
    in_ring: bool
    holders: dict[str, int]

    @property
    def tenant(self) -> str:
        return tenant_of(self.lane)

    def as_json(self) -> dict[str, Any]:
        return {"lane": self.lane, "tenant": self.tenant, "waiting": self.waiting,
                "running": self.running, "oldest_wait_ms": self.oldest_wait_ms,
                "deficit_seconds": self.deficit, "share": self.share,
                "cost_seconds": self.cost, "in_ring": self.in_ring}  # fmt: skip


@dataclass(frozen=True)
class Engine:
    """A consumer of the queue: ``last_report_ms`` ago it reported in (None: not in the
    register), ``live`` within the live window; ``running``: the tickets it holds (its
    interjector's too), ``holds`` those listed."""

    consumer: str
    last_report_ms: int | None
    live: bool
    running: int
    holds: tuple[Held, ...]

    def as_json(self) -> dict[str, Any]:
        return {"consumer": self.consumer, "last_report_ms": self.last_report_ms,
                "live": self.live, "running": self.running,
                "holds": [held.as_json() for held in self.holds]}  # fmt: skip


@dataclass(frozen=True)
class Snapshot:
    """The queue at ``at_ms`` (Redis' clock); ``truncated``: some lane had more running
    tickets than were listed one by one."""

    queue: str
    at_ms: int
    live_ms: int
    lanes: tuple[Lane, ...]
    engines: tuple[Engine, ...]
    ring: tuple[str, ...]
    truncated: bool

    @property
    def waiting(self) -> int:
        return sum(lane.waiting for lane in self.lanes)

    @property
    def running(self) -> int:
        return sum(lane.running for lane in self.lanes)

    @property
    def oldest_wait_ms(self) -> int | None:
        ages = [lane.oldest_wait_ms for lane in self.lanes if lane.oldest_wait_ms is not None]
        return max(ages) if ages else None

    @property
    def live(self) -> int:
        return sum(1 for engine in self.engines if engine.live)

    @property
    def busy(self) -> int:
        return sum(1 for engine in self.engines if engine.live and engine.running)

    def as_json(self) -> dict[str, Any]:
        """What ``GET /admin/queue`` answers."""
        return {
            "queue": self.queue, "at_ms": self.at_ms, "live_window_ms": self.live_ms,
            "waiting": self.waiting, "running": self.running,
            "oldest_wait_ms": self.oldest_wait_ms,
            "engines_live": self.live, "engines_busy": self.busy, "ring": list(self.ring),
            "lanes": [lane.as_json() for lane in self.lanes],
            "engines": [engine.as_json() for engine in self.engines],
            "truncated": self.truncated,
        }  # fmt: skip


def read(client: Any, names: QueueKeys, *, live_ms: int, held: int = HELD_MAX) -> Snapshot:
    """The queue ``names`` now; ``live_ms``: an engine that reported this lately is live;
    ``held``: running tickets listed one by one per lane (0: counts only, the gauges')."""
    keys = [names.engines, names.lanes, names.ring, names.deficits, names.shares, names.costs,
            names.stream_prefix]  # fmt: skip
    now, register, ring_raw, rows = QUEUE_VIEW(client, keys, [GROUP, held])
    now = int(now)
    ring = tuple(as_text(lane) for lane in ring_raw)
    lanes, tickets, truncated = [], [], False
    for row in rows:
        lane, length, running = as_text(row[0]), int(row[1]), int(row[2])
        oldest = as_text(row[3])
        holders = {as_text(consumer): int(count) for consumer, count in _pairs(row[7])}
        flat = row[8]
        tickets += [
            Held(as_text(flat[i]), lane, as_text(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]))
            for i in range(0, len(flat), 4)
        ]
        truncated = truncated or len(flat) // 4 < running and held > 0
        lanes.append(Lane(
            lane, max(0, length - running), running,
            max(0, now - enqueued_ms(oldest)) if oldest else None,
            _number(row[4]), _number(row[5]) or 1.0, _number(row[6]), lane in ring, holders,
        ))  # fmt: skip
    reports = {as_text(who): int(float(at)) for who, at in _pairs(register)}
    engines = _engines(reports, lanes, tickets, now, live_ms)
    return Snapshot(names.tag, now, live_ms, tuple(lanes), engines, ring, truncated)


def _engines(
    reports: dict[str, int], lanes: list[Lane], tickets: list[Held], now: int, live_ms: int
) -> tuple[Engine, ...]:
    """Every engine of the register and every other holder, with what each holds: an
    interjector's tickets under its engine."""

    def engine_of(consumer: str) -> str:
        base = consumer.removesuffix(INTERJECTOR)
        return base if base != consumer and base in reports else consumer

    running: dict[str, int] = dict.fromkeys(reports, 0)
    for lane in lanes:
        for consumer, count in lane.holders.items():
            engine = engine_of(consumer)
            running[engine] = running.get(engine, 0) + count
    engines = []
    for consumer in sorted(running):
        reported = reports.get(consumer)
        age = max(0, now - reported) if reported is not None else None
        holds = tuple(t for t in tickets if engine_of(t.consumer) == consumer)
        live = age is not None and age <= live_ms
        engines.append(Engine(consumer, age, live, running[consumer], holds))
    return tuple(engines)


def _pairs(flat: list[Any]) -> list[tuple[Any, Any]]:
    return list(zip(flat[::2], flat[1::2], strict=True))


def _number(value: Any) -> float | None:
    text = as_text(value)
    return float(text) if text else None


def read_shards(
    client: Any, shards: tuple[QueueKeys, ...], *, live_ms: int, held: int = HELD_MAX
) -> list[Snapshot]:
    """``read`` of each shard of the queue (``DISPATCH_SHARDS``; one without shards)."""
    return [read(client, names, live_ms=live_ms, held=held) for names in shards]


def combined(views: list[dict[str, Any]]) -> dict[str, Any]:
    """``GET /admin/queue``'s answer: one shard's view as it is; with several
    (``DISPATCH_SHARDS``), their totals and each shard's view under ``shards``."""
    if len(views) == 1:
        return views[0]
    ages = [view["oldest_wait_ms"] for view in views if view["oldest_wait_ms"] is not None]
    return {
        "queue": ",".join(view["queue"] for view in views),
        "at_ms": max(view["at_ms"] for view in views),
        "live_window_ms": views[0]["live_window_ms"],
        "waiting": sum(view["waiting"] for view in views),
        "running": sum(view["running"] for view in views),
        "oldest_wait_ms": max(ages) if ages else None,
        "engines_live": sum(view["engines_live"] for view in views),
        "engines_busy": sum(view["engines_busy"] for view in views),
        "truncated": any(view["truncated"] for view in views),
        "shards": views,
    }
