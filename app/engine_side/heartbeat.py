"""Heartbeats, the live-engine register, and the queue's gauges: what an engine process
tells the queue while it lives, for about one command a second (all its slots together).

- **Reporting in**: one thread per process (``run``) scores every slot that takes tickets
  in the register (a sorted set; one ``ZADD`` by this host's clock, which fronts and scripts
  compare with Redis's: hosts' clocks are assumed roughly in sync, as tickets' deadlines
  are) every half live window (``live_ms``), busy or idle: a slot computing a long page
  stays live without reporting itself. A front counts the engines that reported within the
  window; interjection needs every live one busy. A stopped or broken slot leaves the
  register (``leave``).
- **An engine that died** stops reporting: every other process's report counts the
  register's members older than the window (one ``ZCOUNT``, every other report) and, seeing
  one, sets ``reap``, wakes an idle slot of its own (``wake``), and that slot reclaims the
  dead engine's tickets (``claims.py``: its silence is what makes them claimable, not their
  idle time); the dead member leaves the register once it holds none (``queue_stale.lua``).
- **Helping another shard** (``DISPATCH_SHARDS``): a slot running another shard's ticket is
  reported in that shard's register too (``away``) until it finishes (``back``).
- **The sweep**: every ``sweep_seconds`` (twice the claim time) ``reap`` is set without a
  death seen: the next free slot reclaims what no ring or report told of (a ticket whose
  finish failed on a Redis error, one a stopping slot still held, a ``retry`` ring dropped
  while every slot was busy). A few commands per process per sweep.
- **The gauges**: every ``GAUGE_SECONDS`` the process reads each lane's waiting tickets
  (``queue_lanes.lua``, which also keeps the ring whole and rings a silent doorbell when
  tickets wait) and the queue's picture (``inspect.py``): the depth, each tenant's waiting
  and running tickets, deficit and oldest wait, the live engines busy and idle, how long one
  tenant has held at least half the queue while others wait. The fronts read the backlog
  KEDA scales on from Redis at each scrape (``app/queue/backlog.py``), so these gauges may
  lag a minute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from app import metrics
from app.cache.keys import QueueKeys
from app.cache.scripts import QUEUE_LANES
from app.cache.store import REDIS_ERRORS, RedisStore
from app.queue import inspect
from app.queue.ticket import DEFAULT_LANE, GROUP, as_text

log = logging.getLogger(__name__)

# One announcement of lost queue keys per this long, whatever the engine processes.
LOST_LATCH_MS = 5000
GAUGE_SECONDS = 60.0  # the queue's gauges an engine process exports are this fresh, at most


class Heartbeat:
    """This process's engines' reports. ``label``: a tenant's metrics label (``labels``: all
    of them now); ``hold_seconds``: when one tenant's hold on the queue is alerted on
    (``TENANT_QUEUE_HOLD_SECONDS``); ``live_ms``: an engine that reported this lately is
    live (``TicketQueue.live_ms``)."""

    def __init__(
        self,
        names: QueueKeys,
        *,
        label: Callable[[str], str] = lambda namespace: namespace or "default",
        labels: Callable[[], list[str]] = lambda: ["default"],
        hold_seconds: float = 300.0,
        live_ms: int = 3000,
        sweep_seconds: float = 20.0,
        lost_channel: str = "",
    ) -> None:
        self._names = names
        self._lost_channel = lost_channel
        self._reported: set[str] = set()  # the members the last report scored
        self._live_ms = live_ms
        self._sweep_seconds = sweep_seconds
        self._label = label
        self._labels = labels  # every tenant label there is now: each reported, 0 or not
        self._view_labels: set[str] = set()
        self.reported = threading.Event()  # a slot has reported in: tickets can be taken
        self.reap = threading.Event()  # an engine died: a free slot reclaims its tickets
        self._holds: dict[str, float] = {}  # tenant label -> since when it holds the queue
        self._hold_labels: set[str] = set()
        self._members: set[str] = set()  # the slots that take tickets (their consumers)
        # Slots running another shard's ticket (``Feeders``' help): live in its register too.
        self._away: dict[str, QueueKeys] = {}
        self._lock = threading.Lock()
        self._kick = threading.Event()  # report now (a slot joined, or stopping)
        metrics.TENANT_QUEUE_HOLD_LIMIT.set(hold_seconds)

    @property
    def every(self) -> float:
        """Seconds between two reports: half the live window."""
        return self._live_ms / 2000

    def join(self, consumer: str) -> None:
        """``consumer``'s slot takes tickets from now on: reported in from the next report."""
        with self._lock:
            self._members.add(consumer)
        self._kick.set()

    def kick(self) -> None:
        """Report now (stopping: ``run`` looks at its event at once)."""
        self._kick.set()

    def leave(self, consumer: str, client: Any, store: RedisStore | None = None) -> None:
        """``consumer``'s slot stopped (or broke): no longer live (an idle one would hold
        interjection back). Under the lock a report holds: a report begun before cannot
        score it live again after. On the slot's own connection; without one (it failed),
        through ``store`` (a broken slot of a running process), else not at all (stopping:
        it ages out of the register, and a stopping process counts no Redis error)."""
        with self._lock:
            self._members.discard(consumer)
            self._kick.set()  # a stopping process's reports end once its last slot left
            if client is None:
                if store is not None:
                    store.run("dispatch", lambda c: c.zrem(self._names.engines, consumer))
                return
            try:
                client.zrem(self._names.engines, consumer)
            except REDIS_ERRORS:
                pass  # it ages out of the register

    def away(self, consumer: str, names: QueueKeys, client: Any) -> None:
        """``consumer`` took tickets of another shard (``names``): live in that shard's
        register now and at every report until ``back``, which is all that keeps them its
        own there (``claims.py``). A Redis error here leaves them unreported: that shard's
        engines reclaim them."""
        client.zadd(names.engines, {consumer: int(time.time() * 1000)})  # now: not after a report
        with self._lock:
            self._away[consumer] = names

    def back(self, consumer: str, client: Any) -> None:
        """``consumer`` finished the other shard's tickets: out of that register (under the
        report's lock: a report begun before cannot score it live there again after)."""
        with self._lock:
            names = self._away.pop(consumer, None)
            if names is None:
                return
            try:
                client.zrem(names.engines, consumer)
            except REDIS_ERRORS:
                pass  # it ages out of that register

    def run(self, store: RedisStore, stopped: threading.Event, wake: Callable[[], None]) -> None:
        """The process's reports until ``stopped`` and every slot has left (a slot still
        computing when its process stops is what keeps its tickets its own: nothing else
        does, ``claims.py``): the register every ``every`` seconds (and a dead engine looked
        for every other time: ``reap`` set and ``wake()`` called), the gauges every
        ``GAUGE_SECONDS``, the sweep every ``sweep_seconds``."""
        beats, next_gauges = 0, 0.0
        next_sweep = time.monotonic() + self._sweep_seconds
        while not stopped.is_set() or self._members:
            self._kick.clear()  # before the members are read: a join after it reports at once
            with self._lock:
                members = sorted(self._members)
                look = beats % 2 == 1  # a dead engine is looked for every other report
                ok, dead = (
                    store.run("dispatch", lambda c, m=members, k=look: self.report_in(c, m, k))
                    if members
                    else (False, 0)
                )
                for consumer, names in self._away.items():  # helping: each on its own master
                    now_ms = int(time.time() * 1000)
                    store.run("dispatch", lambda c, n=names, m=consumer, t=now_ms: c.zadd(
                        n.engines, {m: t}))  # fmt: skip
            if ok:
                beats += 1
                self.reported.set()
                if dead:
                    self.reap.set()
                    wake()
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self._sweep_seconds
                    self.reap.set()  # a free slot looks at its next turn: no ring needed
                if time.monotonic() >= next_gauges:
                    next_gauges = time.monotonic() + GAUGE_SECONDS
                    store.run("dispatch", self.report_gauges)
            self._kick.wait(self.every)

    def report_in(self, client: Any, members: list[str], look: bool) -> int:
        """Score ``members`` live now; with ``look``, how many members stopped reporting (dead,
        or just gone: ``queue_stale.lua`` removes those that hold nothing)."""
        now_ms = int(time.time() * 1000)
        added = client.zadd(self._names.engines, dict.fromkeys(members, now_ms))
        if self._lost_channel and int(added) > len(set(members) - self._reported):
            # Members it had scored were gone: the register, and likely every queue key
            # with it, was lost (taken by the LRU, or unlinked). Waiters whose tickets went
            # with it hear nothing else before their fallback check: they check now.
            log.warning("dispatch: the live-engine register lost this process's report")
            if client.set(self._names.lost_latch, "1", nx=True, px=LOST_LATCH_MS):
                client.publish(self._lost_channel, "1")  # the first engine to find it
        self._reported = set(members)
        if not look:
            return 0
        return int(client.zcount(self._names.engines, "-inf", f"({now_ms - self._live_ms}"))

    def lanes(self, client: Any) -> dict[str, int]:
        """Every lane's waiting tickets (the ring kept whole, a silent doorbell rung)."""
        names = self._names
        answer = QUEUE_LANES(
            client, [names.lanes, names.ring, names.bell, names.stream_prefix, names.deficits],
            [GROUP],
        )  # fmt: skip
        return {as_text(answer[i]): int(answer[i + 1]) for i in range(0, len(answer), 2)}

    def report_gauges(self, client: Any) -> None:
        try:
            self.report(self.lanes(client))
        except redis.ResponseError as exc:  # Redis answered (out of memory): skip this once
            log.debug("dispatch: the lanes' upkeep failed: %s", exc)
        self.report_view(client)

    def report(self, lanes: dict[str, int]) -> None:
        """The queue's depth, per tenant too, and how long one tenant has held at least
        half of it while others wait as well (the ``OcrTenantHoldsQueue`` alert: a tenant
        alone in the queue holds nobody up)."""
        total = sum(max(0, waiting) for waiting in lanes.values())
        metrics.DISPATCH_QUEUE_DEPTH.set(total)
        per_label: dict[str, int] = {}
        for lane, waiting in lanes.items():
            label = self._label("" if lane == DEFAULT_LANE else lane)
            per_label[label] = per_label.get(label, 0) + max(0, waiting)
        now = time.monotonic()
        for label in self._hold_labels | per_label.keys() | set(self._labels()):
            waiting = per_label.get(label, 0)
            metrics.TENANT_QUEUE_WAITING.labels(tenant=label).set(waiting)
            if 0 < waiting < total and 2 * waiting >= total:  # and another tenant waits
                held = now - self._holds.setdefault(label, now)
            else:
                self._holds.pop(label, None)
                held = 0.0
            metrics.TENANT_QUEUE_HOLD.labels(tenant=label).set(held)
        self._hold_labels |= per_label.keys()

    def report_view(self, client: Any) -> None:
        """The gauges read from the queue's picture: tickets running, oldest wait and live
        engines (busy, idle), per tenant label too (running and deficit summed over the
        tenants a label covers, the oldest wait their longest)."""
        try:
            view = inspect.read(client, self._names, live_ms=self._live_ms, held=0)
        except redis.ResponseError as exc:  # answered (out of memory, a script error): skip
            log.debug("dispatch: the queue's picture failed: %s", exc)
            return
        except REDIS_ERRORS:
            raise  # the connection: the feeder opens another
        except Exception:  # a picture it cannot read must not stop the feeder
            log.exception("dispatch: the queue's picture could not be read")
            return
        metrics.DISPATCH_QUEUE_RUNNING.set(view.running)
        metrics.DISPATCH_OLDEST_WAIT.set((view.oldest_wait_ms or 0) / 1000)
        metrics.DISPATCH_ENGINES.labels(state="busy").set(view.busy)
        metrics.DISPATCH_ENGINES.labels(state="idle").set(view.live - view.busy)
        running: dict[str, int] = {}
        deficit: dict[str, float] = {}
        oldest: dict[str, int] = {}
        for lane in view.lanes:
            label = self._label(lane.tenant)
            running[label] = running.get(label, 0) + lane.running
            deficit[label] = deficit.get(label, 0.0) + (lane.deficit or 0.0)
            oldest[label] = max(oldest.get(label, 0), lane.oldest_wait_ms or 0)
        for label in self._view_labels | running.keys() | set(self._labels()):
            metrics.TENANT_QUEUE_RUNNING.labels(tenant=label).set(running.get(label, 0))
            metrics.TENANT_QUEUE_DEFICIT.labels(tenant=label).set(deficit.get(label, 0.0))
            metrics.TENANT_QUEUE_OLDEST_WAIT.labels(tenant=label).set(oldest.get(label, 0) / 1000)
        self._view_labels |= running.keys()
