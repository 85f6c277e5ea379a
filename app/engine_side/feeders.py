"""The loop that feeds an engine: one feeder thread per engine slot takes the next ticket only
when its engine is free, so a miss goes to whichever engine of any worker or replica frees
up first.

Each turn of a feeder: when an engine died (``heartbeat.py`` saw it stop reporting) or a
ticket was handed back, claim the tickets whose holder is gone (``claims.py``); else take
the next tickets by the round robin (``scheduler.py``); with none, wait for the queue's
doorbell (``Doorbell``: one ``BLPOP`` per process, whatever its idle slots, rung by every
submission); serve them, holding them meanwhile, and finish them (``claims.py``), with the
next take in the same script when nothing else comes first (stopping, an engine failing,
a dead engine's tickets to reclaim). The
process's reports run on a thread of their own (``Heartbeat.run``), so an idle process
costs the queue about one command a second. With interjection, each slot also has an
interjector (``interjection.py``).

With several queue shards (``DISPATCH_SHARDS``) a process serves its own and helps the
others when idle (``helping.py``): its listener also hears the shard's help bell.

While its engine fails (its own errors, not requests that stopped waiting) a feeder takes
one batch per ``UNHEALTHY_PAUSE_SECONDS``: a failing engine must not drain the fleet's queue
into errors, yet it still probes, so it recovers; a ticket it failed that way is handed back
for another engine once (``Claims.retry``). Once ``broken()`` (its engine failed that many
tickets in a row: ``ENGINE_UNREADY_AFTER_FAILURES``) it takes none at all and leaves the
live register; an engine process then retires (``app.engine_process``).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

from app.cache.keys import KeySpace
from app.cache.store import REDIS_ERRORS, RedisStore
from app.engine_side.claims import Claims
from app.engine_side.connections import BLOCK_MS, Connections
from app.engine_side.heartbeat import Heartbeat
from app.engine_side.helping import Helping
from app.engine_side.interjection import Calls, Interjector, Serve
from app.engine_side.scheduler import Scheduler
from app.queue.requester import TicketQueue
from app.queue.ticket import LISTEN_MS, Ticket, as_text
from app.vocabulary import EngineError

log = logging.getLogger(__name__)

__all__ = ["BLOCK_MS", "UNHEALTHY_PAUSE_SECONDS", "Feeders", "Serve", "stop_all"]

UNHEALTHY_PAUSE_SECONDS = 5.0


class Feeders:
    """This process's engine slots, feeding on the queue of ``queue``, made of the parts
    above: ``heartbeat``, ``scheduler``, ``claims``, ``calls`` (and the interjector).
    ``mean_seconds``: an engine call's mean here (the round robin's quantum and a ticket's
    cost when taken); ``label``, ``labels``, ``hold_seconds``: the queue's gauges
    (``Heartbeat``); ``interjecting``: the engine can run a ticket inside the call in
    progress, so each slot also has an interjector."""

    def __init__(
        self,
        store: RedisStore,
        keys: KeySpace,
        queue: TicketQueue,
        *,
        slots: int,
        claim_ms: int,
        max_deliveries: int,
        batch_max: int,
        mean_seconds: Callable[[], float] = lambda: 1.0,
        label: Callable[[str], str] = lambda namespace: namespace or "default",
        labels: Callable[[], list[str]] = lambda: ["default"],
        hold_seconds: float = 300.0,
        interjecting: bool = False,
    ) -> None:
        names = queue.names
        self._store = store
        self._names = names
        self._slots = slots
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        # Unique per start: a restarted process (the same host name and pid in a container)
        # never reports its predecessor's tickets as its own (``claims.py``).
        self._name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._interjecting = interjecting
        self._broken: Callable[[], bool] = lambda: False
        self._connections = Connections(store)
        self.heartbeat = Heartbeat(
            names, label=label, labels=labels, hold_seconds=hold_seconds, live_ms=queue.live_ms,
            sweep_seconds=2 * claim_ms / 1000, lost_channel=keys.queue_lost_channel(),
        )  # fmt: skip
        self.reported = self.heartbeat.reported  # a slot has reported in: tickets are taken
        self._help = Helping(
            store, keys, queue.shards, queue.shards.index(names), self.heartbeat,
            process=self._name, claim_ms=claim_ms, max_deliveries=max_deliveries,
            batch_max=batch_max, mean_seconds=mean_seconds, live_ms=queue.live_ms,
        )  # fmt: skip
        self._doorbell = Doorbell(store, names.bell, self._stopped, self._help.bell)
        self.claims = Claims(
            # The home shard's markers: a ticket taken here is this shard's (a malformed one,
            # decoded with no key, too; the requester's own choice would follow its key).
            store, keys, names, marker=lambda ticket: names.marker(ticket.key, ticket.sha256),
            claim_ms=claim_ms,
            max_deliveries=max_deliveries, batch_max=batch_max, process=self._name,
            live_ms=queue.live_ms,
        )  # fmt: skip
        self.scheduler = Scheduler(
            names, mean_seconds=mean_seconds, batch_max=batch_max, live_ms=queue.live_ms,
            rejected=self.claims.reject,
        )  # fmt: skip
        self.calls = Calls(slots, self._stopped, mean_seconds)
        self._interjector = Interjector(
            names, self.calls, self.scheduler, self.claims, self._connections,
            name=self._name, slots=slots, stopped=self._stopped,
        )  # fmt: skip
        _live.add(self)

    def start(
        self,
        wait_ready: Callable[[], None],
        serve: Serve,
        healthy: Callable[[], bool],
        broken: Callable[[], bool] = lambda: False,
    ) -> None:
        """``wait_ready`` blocks until the engine is loaded; ``serve`` computes tickets and
        stores them (``succeeded``/``fail``/``retry``); ``healthy()`` False: its last call
        failed; ``broken()`` True: it failed too many in a row to take any more."""
        self._broken = broken
        reporter = threading.Thread(
            target=self.heartbeat.run, args=(self._store, self._stopped, self._doorbell.wake),
            name="dispatch-report", daemon=True,
        )  # fmt: skip
        reporter.start()
        self._threads.append(reporter)
        for slot in range(self._slots):
            thread = threading.Thread(
                target=self._feed, args=(slot, wait_ready, serve, healthy, broken),
                name=f"dispatch-{slot}", daemon=True,
            )  # fmt: skip
            thread.start()
            self._threads.append(thread)
            if self._interjecting:
                thread = threading.Thread(
                    target=self._interjector.run, args=(slot, serve, healthy),
                    name=f"dispatch-interject-{slot}", daemon=True,
                )  # fmt: skip
                thread.start()
                self._threads.append(thread)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop reading new tickets (tickets being computed finish); wakes blocked reads."""
        self._stopped.set()
        self.calls.wake()
        self._doorbell.wake_local()
        self.heartbeat.kick()
        self._connections.unblock_all()
        for thread in self._threads:
            thread.join(timeout)
        _live.discard(self)

    def succeeded(self, ticket: Ticket) -> None:
        """The ticket's entry is stored: its waiters read it now."""
        self._claims_of(ticket).succeeded(ticket)

    def fail(self, ticket: Ticket, marker: str) -> None:
        """Tell the ticket's requesters it failed (``Claims.fail``)."""
        self._claims_of(ticket).fail(ticket, marker)

    def retry(self, ticket: Ticket, marker: str) -> None:
        """The engine failed the ticket unexpectedly: another engine runs it once more, if
        one is live (``Claims.retry``); else its requesters are told ``marker``."""
        self._claims_of(ticket).retry(ticket, marker)

    def _claims_of(self, ticket: Ticket) -> Claims:
        """The claims of the shard ``ticket`` came from: a helped one's, else its own."""
        return self._help.claims_of(ticket) or self.claims

    def _feed(
        self,
        slot: int,
        wait_ready: Callable[[], None],
        serve: Serve,
        healthy: Callable[[], bool],
        broken: Callable[[], bool],
    ) -> None:
        self._store.pooled_reads()  # its one connection of its own is ``client`` below
        while not self._stopped.is_set():
            try:
                wait_ready()
                break
            except EngineError:  # not loaded (yet): keep out of the queue
                self._stopped.wait(1.0)
        consumer = f"{self._name}-{slot}"
        client: Any = None
        backoff, joined, look, reclaim = 0.1, False, True, False
        # The shard this slot was asked to help, while that one has tickets and its own none;
        # ``asked``: a waiter's check asked (the first look reclaims there too).
        helping: int | None = None
        asked = False
        # What the take that ran with the last finish gave (None: no such take).
        taken: tuple[list[Ticket], float] | None = None

        def take_next(client: Any, finish: Any) -> tuple[list[Ticket], float] | None:
            # Only when this loop would take at once anyway: not stopping, not broken, its
            # engine healthy, no dead engine's tickets to reclaim first.
            if self._stopped.is_set() or broken() or not healthy() or self.heartbeat.reap.is_set():
                return None
            return self.scheduler.take(client, consumer, finishing=finish)

        while not self._stopped.is_set():
            if broken():  # takes nothing; out of the register, so no ticket is handed to it
                if joined:
                    self.heartbeat.leave(consumer, client, self._store)
                    joined = False
                self._stopped.wait(UNHEALTHY_PAUSE_SECONDS)
                continue
            if not joined:
                self.heartbeat.join(consumer)
                joined = True
            if not healthy() and self._stopped.wait(UNHEALTHY_PAUSE_SECONDS):
                break
            try:
                if client is None:
                    client = self._connections.open(slot)
                tickets: list[Ticket] = []
                cost = 0.0
                if taken is not None:  # taken with the last finish: no look of its own
                    (tickets, cost), taken, look = taken, None, False
                # An engine died, or a hand-back: reclaim (after the tickets taken with the
                # last finish, if any: the flag stays set, and no take runs with the finish)
                if not tickets and (reclaim or self.heartbeat.reap.is_set()):
                    self.heartbeat.reap.clear()
                    reclaim = False
                    tickets = self.claims.reclaim(client, consumer)
                if not tickets and look and not self._stopped.is_set():
                    tickets, cost = self.scheduler.take(client, consumer)
                away = None
                if not tickets and helping is not None and not self._stopped.is_set():
                    tickets, cost = self._help.take(client, consumer, helping, asked)
                    away, helping = (helping, helping) if tickets else (None, None)
                asked = False
                look = True
                if not tickets and not self._stopped.is_set():
                    heard = self._doorbell.listen(client)
                    # A quiet doorbell: nothing was submitted, so nothing to take (the lanes'
                    # upkeep rings it if rings were lost); "retry": reclaim, then take if
                    # there was nothing to reclaim (a ring it took from a submission); a
                    # shard's number: help it (its own queue was just found empty).
                    ask = self._help.asked(heard)
                    helping, asked = ask if ask is not None else (None, False)
                    look, reclaim = heard != "quiet" and ask is None, heard == "retry"
                    continue
                backoff = 0.1
            except REDIS_ERRORS as exc:
                log.debug("dispatch feeder: %s; retrying", exc.__class__.__name__)
                self._connections.drop(slot, client)
                client = None
                helping, asked, look = None, False, True  # its own queue first (a helped
                # shard's master may be the one failing: the next ask tells again)
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            if not tickets:
                continue
            self._doorbell.hand_over()  # more may wait: another idle slot looks (or listens)
            lanes = {ticket.lane for ticket in tickets}
            lane = lanes.pop() if len(lanes) == 1 else ""
            self.calls.computes(slot, True, min(t.deadline for t in tickets), lane)
            try:
                if away is None:
                    taken = self.claims.serve(
                        client, consumer, tickets, cost, lambda ts: serve(ts, False), take_next
                    )
                else:  # another shard's: finished there, then this slot's own queue first
                    self._help.serve(
                        away, client, consumer, tickets, cost, lambda ts: serve(ts, False)
                    )
            finally:
                self.calls.computes(slot, False)
        if client is not None:  # stopped between tickets: nothing of ours is pending
            self.claims.forget(client, consumer)
            self._help.forget(client, consumer)
        if joined:
            self.heartbeat.leave(consumer, client)
        self._connections.drop(slot, client)


class Doorbell:
    """The queue's doorbell (a Redis list every submission pushes to), heard once per process:
    the first idle slot listens (``BLPOP``) for all of them, one command per ring or per
    ``LISTEN_MS``; the others wait on a local condition, which costs Redis nothing, until a
    slot that took tickets hands over (more may wait) or the listener's turn is free."""

    def __init__(
        self, store: RedisStore, bell: str, stopped: threading.Event, help_bell: str | None = None
    ) -> None:
        self._store = store
        self._bell = bell
        # With several shards: the help bell, heard after this one (``BLPOP`` reads its keys
        # in order).
        self._bells = [bell] if help_bell is None else [bell, help_bell]
        self._help_bell = help_bell
        self._stopped = stopped
        self._listening = threading.Lock()
        self._changed = threading.Condition()
        self._waiting = 0  # slots waiting here
        self._turns = 0  # hand-overs not yet taken by a waiting slot

    def listen(self, client: Any) -> str:
        """``ring`` (a ticket was submitted), ``retry`` (a ticket handed back, or an engine
        died: reclaim), ``help:<shard>`` (that shard asked for help),
        ``quiet`` (nothing for ``LISTEN_MS``) or ``woken`` (a waiting slot handed the turn:
        it looks)."""
        if self._listening.acquire(blocking=False):
            try:
                rung = client.blpop(self._bells, timeout=LISTEN_MS / 1000)
            finally:
                self._listening.release()
            if not rung:
                return "quiet"
            if as_text(rung[0]) == self._help_bell:
                return f"help:{as_text(rung[1])}"
            return "retry" if as_text(rung[1]) == "retry" else "ring"
        with self._changed:
            self._waiting += 1
            try:
                while not self._stopped.is_set() and not self._turns:
                    self._changed.wait(LISTEN_MS / 1000)
                    if not self._listening.locked():
                        break  # nobody listens now: this slot does
                if self._turns:
                    self._turns -= 1
            finally:
                self._waiting -= 1
        return "woken"

    def hand_over(self) -> None:
        """A slot took tickets: one waiting slot looks next."""
        with self._changed:
            if self._waiting > self._turns:
                self._turns += 1
                self._changed.notify()

    def wake_local(self) -> None:
        """Every waiting slot looks (stopping)."""
        with self._changed:
            self._turns = self._waiting
            self._changed.notify_all()

    def wake(self) -> None:
        """An engine died: an idle slot of this process reclaims its tickets (a waiting one
        at once; the listener by a ``retry`` ring, which any idle engine may hear)."""
        with self._changed:
            if self._waiting:
                self._turns = self._waiting
                self._changed.notify_all()
                return
        if self._listening.locked():
            self._store.run("dispatch", lambda client: client.lpush(self._bell, "retry"))


# Every started set of feeders, so tests (and shutdown) can stop them all.
_live: set[Feeders] = set()


def stop_all() -> None:
    for feeders in list(_live):
        feeders.stop()
