"""An engine process's help to the other shards of its queue (``DISPATCH_SHARDS``).

A front whose miss waits behind its own shard's busy engines (or none) pushes that shard's
number on another shard's help bell (``app/queue/asks.py``; again at each fallback check
while its tickets wait). The process's doorbell listener hears it with its own bell (one
``BLPOP`` on both, its own first: ``feeders.Doorbell``), and the slot that heard it, its own
queue just found empty, helps: asked by a waiter's fallback check that found a holder
silent, it first reclaims there what that holder left (a helper that died: the shard may
have no engine of its own to do it); then it takes from that shard by the shard's round
robin, one batch at a time while its own queue stays empty and that one has tickets
(``feeders.Feeders._feed``). Each batch is live in that shard's register while it runs
(``Heartbeat.away``), so a helper that dies is reclaimed there as any engine is, and it is
finished there (markers, deficits, done notices; ``Claims``). Meanwhile the slot still
counts as a live, idle engine of its own shard: its gauges, its fronts' lane bound,
interjection's "every engine busy" there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from app import metrics
from app.cache.keys import KeySpace, QueueKeys, shard_of
from app.cache.store import RedisStore
from app.engine_side.claims import Claims, Serve
from app.engine_side.heartbeat import Heartbeat
from app.engine_side.scheduler import Scheduler
from app.queue.ticket import Ticket


class Helping:
    """The shards ``shards`` other than ``home`` as this process helps them: each one's
    scheduler and claims, made the first time it is helped; the rest as ``Claims``."""

    def __init__(
        self,
        store: RedisStore,
        keys: KeySpace,
        shards: tuple[QueueKeys, ...],
        home: int,
        heartbeat: Heartbeat,
        *,
        process: str,
        claim_ms: int,
        max_deliveries: int,
        batch_max: int,
        mean_seconds: Callable[[], float],
        live_ms: int,
    ) -> None:
        self._store, self._keys, self._shards, self._home = store, keys, shards, home
        self._heartbeat = heartbeat
        self._process, self._claim_ms, self._max_deliveries = process, claim_ms, max_deliveries
        self._batch_max, self._mean_seconds, self._live_ms = batch_max, mean_seconds, live_ms
        self._helped: dict[int, tuple[Scheduler, Claims]] = {}
        self._lock = threading.Lock()

    @property
    def bell(self) -> str | None:
        """The home shard's help bell, with several shards."""
        return self._shards[self._home].help_bell if len(self._shards) > 1 else None

    def asked(self, heard: str) -> tuple[int, bool] | None:
        """The shard a ``help:<shard>[r]`` ring names, if it is another of this queue's, and
        whether to reclaim there first (``r``: a waiter's fallback check asked)."""
        shard = heard.removeprefix("help:")
        reclaim = shard.endswith("r")
        shard = shard.removesuffix("r")
        if heard.startswith("help:") and shard.isascii() and shard.isdecimal():
            number = int(shard)
            if number < len(self._shards) and number != self._home:
                return number, reclaim
        return None

    def claims_of(self, ticket: Ticket) -> Claims | None:
        """The claims of the helped shard ``ticket`` came from (its key's, ``shard_of``);
        None: one of the home shard's."""
        if len(self._shards) < 2 or not ticket.key:
            return None
        helped = self._helped.get(shard_of(ticket.key, len(self._shards)))
        return helped[1] if helped is not None else None

    def take(
        self, client: Any, consumer: str, shard: int, reclaim: bool
    ) -> tuple[list[Ticket], float]:
        """The next tickets of ``shard``: with ``reclaim`` (the first look after a waiter's
        check asked), first those whose holder there stopped reporting or handed them back,
        else by its round robin. ``consumer`` is reported live there at once, well within a
        quarter of the live window (the least a ticket must idle before anyone may claim
        it)."""
        scheduler, claims = self._parts(shard)
        tickets, cost = (claims.reclaim(client, consumer), 0.0) if reclaim else ([], 0.0)
        if not tickets:
            tickets, cost = scheduler.take(client, consumer)
        if tickets:
            self._heartbeat.away(consumer, self._shards[shard], client)
            metrics.DISPATCH_TICKETS.labels(outcome="helped").inc(len(tickets))
        return tickets, cost

    def serve(
        self,
        shard: int,
        client: Any,
        consumer: str,
        tickets: list[Ticket],
        cost: float,
        serve: Serve,
    ) -> None:
        """Serve ``shard``'s tickets and finish them there; then out of its register."""
        try:
            self._parts(shard)[1].serve(client, consumer, tickets, cost, serve)
        finally:
            self._heartbeat.back(consumer, client)

    def forget(self, client: Any, consumer: str) -> None:
        """``consumer`` leaves the helped shards' consumer groups (``Claims.forget``)."""
        for _, claims in list(self._helped.values()):
            claims.forget(client, consumer)

    def _parts(self, shard: int) -> tuple[Scheduler, Claims]:
        with self._lock:
            if shard not in self._helped:
                names = self._shards[shard]

                def marker(ticket: Ticket, names: QueueKeys = names) -> str:
                    return names.marker(ticket.key, ticket.sha256)

                claims = Claims(
                    self._store, self._keys, names, marker=marker, claim_ms=self._claim_ms,
                    max_deliveries=self._max_deliveries, batch_max=self._batch_max,
                    process=self._process, live_ms=self._live_ms,
                )  # fmt: skip
                scheduler = Scheduler(
                    names, mean_seconds=self._mean_seconds, batch_max=self._batch_max,
                    live_ms=self._live_ms, rejected=claims.reject,
                )  # fmt: skip
                self._helped[shard] = (scheduler, claims)
            return self._helped[shard]
