"""Heartbeats and the live-engine register.

An engine's feeder reports it live (a sorted set scored by Redis's clock,
``queue_heartbeat.lua``) every ``BLOCK_MS`` while idle and every third of
``DISPATCH_CLAIM_MS`` while computing (``claims.py``). A front submits only while some
engine reported lately (``TicketQueue.live_ms``); interjection needs every live engine busy.
A stopped feeder leaves the register; a dead one ages out of it.

Each report also reads every lane's waiting tickets: the first slot's feeder turns them into
the queue's gauges (its depth, each tenant's waiting tickets, how long one tenant has held
at least half of them while others wait too).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from app import metrics
from app.cache.keys import QueueKeys
from app.cache.scripts import QUEUE_HEARTBEAT
from app.cache.store import REDIS_ERRORS
from app.queue.ticket import DEFAULT_LANE, GROUP, as_text


class Heartbeat:
    """This process's engines' reports. ``label``: a tenant's metrics label (``labels``: all
    of them now); ``hold_seconds``: when one tenant's hold on the queue is alerted on
    (``TENANT_QUEUE_HOLD_SECONDS``)."""

    def __init__(
        self,
        names: QueueKeys,
        *,
        claim_ms: int,
        label: Callable[[str], str] = lambda namespace: namespace or "default",
        labels: Callable[[], list[str]] = lambda: ["default"],
        hold_seconds: float = 300.0,
    ) -> None:
        self._names = names
        self._claim_ms = claim_ms
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
        """A feeder's report: its engine live, and (``report``) the queue's gauges."""
        lanes = self.beat(client, consumer)
        self.reported.set()
        if report:
            self.report(lanes)

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

    def leave(self, client: Any, consumer: str) -> None:
        """``consumer``'s engine stopped: no longer live (an idle one would hold
        interjection back)."""
        try:
            client.zrem(self._names.engines, consumer)
        except REDIS_ERRORS:
            pass  # it ages out of the register
