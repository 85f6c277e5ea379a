"""Claiming: who holds a ticket, and what happens when the holder dies.

- An engine's consumer holds the tickets it took (the stream's pending list) while its
  engine computes them; its process reports it live meanwhile (``heartbeat.py``), and that
  report is all that keeps them its own: a long call costs the queue nothing while it runs.
- A ticket whose holder stopped reporting for the live window (``DISPATCH_CLAIM_MS``: it
  died) is claimed by another engine (``queue_stale.lua``), at most
  ``DISPATCH_MAX_DELIVERIES`` times: an image that kills engines is then failed, not retried
  forever. So is an orphan: a ticket pending under a consumer of a live process that does
  not run it (a take whose answer a fail-over lost, a finish that failed on a Redis error),
  found by that process's own sweep, which knows what its consumers run. A claim needs the
  ticket idle a quarter of the window (a dead holder's is idle at least half of it: it took
  the ticket after its last report; a ticket just taken is not yet running), so two engines
  never both claim one. Consumer names are unique per process start (``feeders.py``): a
  restarted process never reports for its predecessor's tickets. Reports are scored by each
  engine host's clock and read by another's: a host whose clock runs half a live window
  behind looks dead, and its long calls are computed twice (run NTP). If the LRU took the
  register itself, the running tickets look unheld until the next reports (half a window):
  some may be computed twice, never answered wrong. Engines look for such tickets when one
  of them stopped reporting (``heartbeat.py``), a ticket was handed back or a waiter found
  its ticket's holder silent, and at each sweep (twice the claim time: what nothing told of,
  the orphans).
- A ticket nobody may still wait for is dropped unread: past its deadline, or its key's
  marker names another ticket (its requesters moved on to a newer one).
- When done, a ticket is acknowledged and deleted with its marker and image
  (``queue_finish.lua``): the next miss of that key (its entry evicted) is queued anew; its
  lane's deficit is corrected to the engine time it really took (``scheduler.py``). A
  feeder that takes again at once runs that finish and its next take as one script
  (``QUEUE_FINISH_TAKE``): a round trip and a script call fewer per engine call.
- Its requesters are told: ``succeeded`` (its entry is stored) or ``fail`` (an error marker
  ``{key}:error:{id}``, 60 s, and the done channel; never cached). The marker is written
  before the ticket leaves the queue, so each waiter finds it even when the message has not
  reached it; no later request reads it (it queues a ticket of its own).
- A ticket its engine failed with an unexpected error (a bug, the engine's own failure; not
  the image's fault, not a timeout) on its first delivery is handed back instead, once,
  while another engine process is live (``retry``, ``queue_retry.lua``): it stays pending,
  held by a name no engine reports (a dead holder's, as it were), and another engine
  reclaims it; its requesters go on waiting. One broken engine then fails no request that a
  healthy one can answer. Not taken within a claim time (the other engine died meanwhile),
  the failing process reclaims it itself: a second delivery, failed outright if it fails
  again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import redis

from app import metrics
from app.cache.keys import KeySpace, QueueKeys
from app.cache.scripts import QUEUE_FINISH, QUEUE_RELEASE, QUEUE_RETRY, QUEUE_STALE
from app.cache.store import REDIS_ERRORS, RedisStore
from app.queue.ticket import (
    ERROR_TTL_S,
    GROUP,
    INTERJECTOR,
    Decoded,
    Ticket,
    as_text,
    by_lane,
    decode,
)

log = logging.getLogger(__name__)

Serve = Callable[[Sequence[Ticket]], Mapping[str, float]]
# A consumer's next take, run with one lane's finish (keys, args); None: no take now.
TakeNext = Callable[[Any, tuple[list[str], list[str | int]]], tuple[list[Ticket], float] | None]


def wanted_tickets(
    client: Any,
    tickets: list[Ticket],
    marker: Callable[[Ticket], str],
    image: Callable[[Ticket], str],
) -> list[Ticket]:
    """Tickets someone may still wait for (before their deadline, and their marker, when
    it survives, still naming them), with their images (format 2) read in; the others'
    waiters hear ``gone`` once they are finished (``Claims.serve``)."""
    now = time.time()
    # One MGET on the feeder's own connection (markers and images share the queue's
    # slot): a pipeline would take a second connection from that client's pool and keep it.
    fetch = [ticket for ticket in tickets if ticket.awaits_image]
    replies = client.mget([marker(ticket) for ticket in tickets] + [image(t) for t in fetch])
    markers, images = replies[: len(tickets)], replies[len(tickets) :]
    image_of = dict(zip([t.id for t in fetch], images, strict=True))
    wanted = []
    for ticket, named in zip(tickets, markers, strict=True):
        data = image_of.get(ticket.id) if ticket.awaits_image else ticket.data
        if ticket.deadline > now and (named is None or as_text(named) == ticket.id):
            if data is not None:
                wanted.append(replace(ticket, data=data, awaits_image=False))
                continue
            # Its image was evicted: its waiters, told it left unrun, submit it again.
            outcome = "image_gone"
        else:
            outcome = "caller_gone"
            metrics.ENGINE_QUEUE_DROPPED.labels(reason="caller_gone").inc()
        metrics.DISPATCH_TICKETS.labels(outcome=outcome).inc()
    return wanted


def finish_calls(
    names: QueueKeys,
    marker: Callable[[Ticket], str],
    tickets: list[Ticket],
    seconds: Mapping[str, float],
    charged: float,
) -> list[tuple[list[str], list[str | int]]]:
    """``queue_finish.lua``'s (keys, args) for each lane of ``tickets`` (``Claims.finish``)."""
    calls = []
    for lane, members in by_lane(tickets).items():
        spent = [seconds.get(ticket.id, 0.0) for ticket in members]
        markers = [marker(ticket) for ticket in members]
        images = [names.image(ticket.key, ticket.sha256) for ticket in members]
        keys = [names.stream(lane), names.deficits, names.costs, *markers, *images]
        args: list[str | int] = [
            GROUP, lane, f"{charged * len(members):.6f}", f"{sum(spent):.6f}",
            sum(1 for s in spent if s > 0), *[ticket.id for ticket in members],
        ]  # fmt: skip
        calls.append((keys, args))
    return calls


class Claims:
    """The tickets this process's engines hold. ``marker(ticket)``: its entry key's marker
    (``TicketQueue.marker``); ``process``: the prefix of this process's consumers (``retry``
    hands a ticket to an engine of another process); ``live_ms``: the live window."""

    def __init__(
        self,
        store: RedisStore,
        keys: KeySpace,
        names: QueueKeys,
        *,
        marker: Callable[[Ticket], str],
        claim_ms: int,
        max_deliveries: int,
        batch_max: int,
        process: str = "",
        live_ms: int = 30_000,
    ) -> None:
        self._store = store
        self._keys = keys
        self._names = names
        self._marker = marker
        self._claim_ms = claim_ms
        self._max_deliveries = max_deliveries
        self._batch_max = batch_max
        self._process = process
        self._live_ms = live_ms
        self._retries_lock = threading.Lock()  # the feeders' threads share the two below
        self._retries: dict[str, str] = {}  # ticket id -> its failure, if no one retries it
        self._handed: dict[str, float] = {}  # ids handed back -> until when others may take them
        # What each of this process's consumers runs now: a ticket pending under one of them
        # and not here is an orphan (a take whose answer a fail-over lost, a failed finish).
        self._running: dict[str, tuple[str, ...]] = {}

    def serve(
        self,
        client: Any,
        consumer: str,
        tickets: list[Ticket],
        cost: float,
        serve: Serve,
        take_next: TakeNext | None = None,
    ) -> tuple[list[Ticket], float] | None:
        """Serve the tickets (each charged ``cost`` when taken), holding them meanwhile, then
        finish them with their lanes' deficits corrected by the engine time they really took.
        ``take_next(client, finish)``: the consumer's next take, run with the finish of one
        lane's tickets (keys, args) in one script, or None if it takes nothing now; its
        answer (tickets, cost) is returned (None: no take was made)."""
        wanted: list[Ticket] = []
        with self._retries_lock:
            self._running[consumer] = tuple(ticket.id for ticket in tickets)
        try:
            wanted = wanted_tickets(client, tickets, self._marker, self._image)
        except REDIS_ERRORS:  # unsure whether anyone waits: compute (reclaimed otherwise)
            now = time.time()
            wanted = [t for t in tickets if t.deadline > now and not t.awaits_image]
            # An image it could not read: that ticket stays pending, an orphan this process's
            # own sweep reclaims.
            tickets = [t for t in tickets if not (t.awaits_image and t.deadline > now)]
        seconds: Mapping[str, float] = {}
        try:
            if wanted:
                seconds = serve(wanted) or {}
        except Exception:  # serve reports per ticket; never let a feeder die
            log.exception("dispatch: serving %d tickets failed", len(wanted))
        finally:
            handed = self._hand_back(client, consumer, tickets)
            done = [t for t in tickets if t.id not in handed]
            taken: tuple[list[Ticket], float] | None = None
            try:
                calls = finish_calls(self._names, self._marker, done, seconds, cost)
                if take_next is not None and len(calls) == 1:
                    taken = take_next(client, calls[0])
                if taken is None:
                    for keys, args in calls:
                        QUEUE_FINISH(client, keys, args)
            except REDIS_ERRORS:
                pass  # the tickets stay pending and are reclaimed, then dropped as done
            # Those dropped unrun, once out of the queue: a waiter that submits again on
            # hearing it queues a new ticket rather than join the dropped one.
            with self._retries_lock:
                self._running.pop(consumer, None)  # finished, or pending still: an orphan
            kept = {ticket.id for ticket in wanted}
            for ticket in tickets:
                if ticket.id not in kept:
                    self._store.publish(self._keys.done(ticket.key), f"gone:{ticket.id}")
        return taken

    def retry(self, ticket: Ticket, marker: str) -> None:
        """``ticket`` failed here with an unexpected error (``marker``): once its call ends
        it is handed back for another engine if this was its first delivery and another
        engine process is live, else its requesters are told ``marker`` then."""
        if ticket.deliveries > 1 or self._max_deliveries < 2:
            self.fail(ticket, marker)
            return
        with self._retries_lock:
            self._retries[ticket.id] = marker

    def _hand_back(self, client: Any, consumer: str, tickets: list[Ticket]) -> set[str]:
        """The ids of ``tickets`` handed back to the queue (``retry``); those that could not
        be are failed with their marker."""
        with self._retries_lock:
            failed = [(t, self._retries.pop(t.id)) for t in tickets if t.id in self._retries]
        handed: set[str] = set()
        for ticket, marker in failed:
            names = self._names
            try:
                back = QUEUE_RETRY(
                    client, [names.stream(ticket.lane), names.engines, names.bell],
                    [GROUP, consumer, ticket.id, self._live_ms, self._live_ms,
                     f"{self._process}-"],
                )  # fmt: skip
            except REDIS_ERRORS:
                back = 0
            if back:
                handed.add(ticket.id)
                with self._retries_lock:
                    self._handed[ticket.id] = time.monotonic() + self._claim_ms / 1000
                metrics.DISPATCH_TICKETS.labels(outcome="retried").inc()
                log.warning("ticket %s handed back for another engine: %s", ticket.id, marker)
            else:
                self.fail(ticket, marker)
        return handed

    def _image(self, ticket: Ticket) -> str:
        return self._names.image(ticket.key, ticket.sha256)

    def finish(
        self,
        client: Any,
        tickets: list[Ticket],
        seconds: Mapping[str, float],
        charged: float = 0.0,
    ) -> None:
        """Acknowledge and delete ``tickets`` (per lane), each lane's deficit corrected from
        ``charged`` per ticket to the engine seconds they took (``seconds``, by id)."""
        for keys, args in finish_calls(self._names, self._marker, tickets, seconds, charged):
            QUEUE_FINISH(client, keys, args)

    def reject(self, client: Any, rejected: list[Decoded]) -> None:
        """Entries that cannot be computed: a ticket in a format this engine does not read
        is failed (its requesters hear why); each is then deleted."""
        for decoded in rejected:
            if decoded.marker:
                metrics.DISPATCH_TICKETS.labels(outcome="failed").inc()
                self.fail(decoded.ticket, decoded.marker)
        self.finish(client, [decoded.ticket for decoded in rejected], {})

    def reclaim(self, client: Any, consumer: str) -> list[Ticket]:
        """Tickets in any lane whose holder stopped reporting (it died) or was handed them
        back, and this process's orphans (pending under one of its consumers, which does not
        run them); and the register's engines that stopped reporting and hold none, removed."""
        names = self._names
        now = time.monotonic()
        with self._retries_lock:  # not taken by another engine in time: ours to run again
            self._handed = {i: until for i, until in self._handed.items() if until > now}
            # Not orphans: what its consumers run, and what it handed back (others' to take).
            running = [i for ids in self._running.values() for i in ids] + list(self._handed)
        own = f"{self._process}-" if self._process else ""
        cutoff = int(time.time() * 1000) - self._live_ms  # reported before: gone
        stale = QUEUE_STALE(
            client, [names.lanes, names.stream_prefix, names.engines],
            [GROUP, self._batch_max, cutoff, INTERJECTOR, own, *running],
        )  # fmt: skip
        tickets: list[Ticket] = []
        for i in range(0, len(stale), 4):
            lane, entry_id = as_text(stale[i]), as_text(stale[i + 1])
            owner, delivered = as_text(stale[i + 2]), int(stale[i + 3])
            if entry_id in self._handed:
                continue  # handed back by this process (``retry``): another engine's to run
            least_idle = self._live_ms // 4  # not just claimed by another engine
            claimed = client.xclaim(names.stream(lane), GROUP, consumer, least_idle, [entry_id])
            if not claimed or claimed[0][1] is None:
                continue  # someone else claimed it first, or it was deleted
            deliveries = delivered + 1
            decoded = decode(entry_id, claimed[0][1], deliveries, lane)
            if decoded.malformed:
                continue
            if decoded.marker:
                self.reject(client, [decoded])
                continue
            ticket = decoded.ticket
            metrics.DISPATCH_TICKETS.labels(outcome="reclaimed").inc()
            log.warning("reclaimed ticket %s of %s (delivery %d)", entry_id, owner, deliveries)
            if deliveries > self._max_deliveries:
                metrics.DISPATCH_TICKETS.labels(outcome="abandoned").inc()
                gone = deliveries - 1
                self.fail(ticket, f"error:no engine survived this image ({gone} deliveries)")
                self.finish(client, [ticket], {})
                continue
            tickets.append(ticket)
        return tickets

    def forget(self, client: Any, consumer: str) -> None:
        """Leave the consumer group of every lane, except where this consumer still holds
        tickets (a finish that failed): deleting it would drop them from the pending list
        unacknowledged, never delivered or reclaimed again, yet still counted as waiting.
        Kept, they are reclaimed once it leaves the register, like a dead consumer's. Its
        ``:handed`` name (``retry``) goes too once it holds nothing."""
        try:
            for lane in client.smembers(self._names.lanes):
                stream = self._names.stream(as_text(lane))
                try:
                    for name in (consumer, f"{consumer}:handed"):
                        if not client.xpending_range(
                            stream, GROUP, min="-", max="+", count=1, consumername=name
                        ):
                            client.xgroup_delconsumer(stream, GROUP, name)
                except redis.ResponseError:
                    pass  # that lane's stream or group is gone
        except REDIS_ERRORS:
            pass

    def succeeded(self, ticket: Ticket) -> None:
        """The ticket's entry is stored: its waiters read it now."""
        self._store.publish(self._keys.done(ticket.key), f"ok:{ticket.id}")

    def fail(self, ticket: Ticket, marker: str) -> None:
        """Tell the requesters (marker key, then the done channel) that ``ticket`` failed:
        ``marker`` is ``kind:detail`` (error, timeout, busy:<seconds>, bug) or ``lost`` (no
        entry could be stored: they compute for themselves)."""
        channel = self._keys.done(ticket.key)
        if marker == "lost":
            self._store.publish(channel, f"lost:{ticket.id}")
            return
        # An engine's timeout comes after its requester's own (which started earlier, at
        # submit), as does any failure past the deadline: no one is left to read a marker.
        if not marker.startswith("timeout:") and time.time() < ticket.deadline:
            error_key = self._keys.ticket_error(ticket.key, ticket.id)
            self._store.run("dispatch", lambda c: c.set(error_key, marker, ex=ERROR_TTL_S))
        # The key is free before anyone hears: a request made on hearing it (a retry) queues
        # a new ticket rather than join this failed one until its entry is deleted
        # (``finish``).
        marker_keys = [self._marker(ticket), self._image(ticket)]
        self._store.run("dispatch", lambda c: QUEUE_RELEASE(c, marker_keys, [ticket.id]))
        self._store.publish(channel, f"error:{ticket.id}:{marker}")
