"""Heartbeats and the live-engine register.

An engine's feeder reports it live (a sorted set scored by Redis's clock,
``queue_heartbeat.lua``) every ``BLOCK_MS`` while idle and every third of
``DISPATCH_CLAIM_MS`` while computing (``claims.py``). A front submits only while some
engine reported lately (``TicketQueue.live_ms``); interjection needs every live engine busy.
A stopped feeder leaves the register; a dead one ages out of it.

Each report also reads every lane's waiting tickets: the first slot's feeder turns them into
the queue's gauges (its depth, each tenant's waiting tickets, how long one tenant has held
at least half of them while others wait too); and once per ``VIEW_SECONDS`` at most, any
slot's feeder reads the queue's picture (``inspect.py``) for the rest: tickets running (per
tenant too), each tenant's deficit and oldest wait, the oldest wait overall, live engines
busy and idle.
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
from app.cache.scripts import QUEUE_HEARTBEAT
from app.cache.store import REDIS_ERRORS
from app.queue import inspect
from app.queue.ticket import DEFAULT_LANE, GROUP, as_text

log = logging.getLogger(__name__)

VIEW_SECONDS = 1.0  # the gauges read from the queue's picture are this fresh, at most


class Heartbeat:
    """This process's engines' reports. ``label``: a tenant's metrics label (``labels``: all
    of them now); ``hold_seconds``: when one tenant's hold on the queue is alerted on
    (``TENANT_QUEUE_HOLD_SECONDS``); ``live_ms``: an engine that reported this lately is
    live (``TicketQueue.live_ms``)."""

    def __init__(
        self,
        names: QueueKeys,
        *,
        claim_ms: int,
        label: Callable[[str], str] = lambda namespace: namespace or "default",
        labels: Callable[[], list[str]] = lambda: ["default"],
        hold_seconds: float = 300.0,
        live_ms: int = 3000,
    ) -> None:
        self._names = names
        self._claim_ms = claim_ms
        self._live_ms = live_ms
        self._next_view = 0.0  # when the picture's gauges are read again (monotonic)
        self._view_labels: set[str] = set()
        self._label = label
        self._labels = labels  # every tenant label there is now: each reported, 0 or not
        self.reported = threading.Event()  # a feeder has reported in: tickets can be taken
        self._holds: dict[str, float] = {}  # tenant label -> since when it holds the queue
        self._hold_labels: set[str] = set()
        metrics.TENANT_QUEUE_HOLD_LIMIT.set(hold_seconds)

    def beat(self, client: Any, consumer: str) -> dict[str, int]:
        """Report ``consumer``'s engine live; every lane's waiting tickets."""
        names = self._names
        answer = QUEUE_HEARTBEAT(
            client, [names.engines, names.lanes, names.ring, names.stream_prefix],
            [consumer, self._claim_ms * 4, GROUP],
        )  # fmt: skip
        return {as_text(answer[i]): int(answer[i + 1]) for i in range(0, len(answer), 2)}

    def report_in(self, client: Any, consumer: str, report: bool) -> None:
        """A feeder's report: its engine live, and (``report``) the queue's gauges; those read
        from the queue's picture by whichever slot reports first once they are due (the
        first slot's may be computing a long page)."""
        lanes = self.beat(client, consumer)
        self.reported.set()
        if report:
            self.report(lanes)
        if time.monotonic() >= self._next_view:
            self._next_view = time.monotonic() + VIEW_SECONDS
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

    def leave(self, client: Any, consumer: str) -> None:
        """``consumer``'s engine stopped: no longer live (an idle one would hold
        interjection back)."""
        try:
            client.zrem(self._names.engines, consumer)
        except REDIS_ERRORS:
            pass  # it ages out of the register
