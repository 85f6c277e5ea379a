"""Interjection (``DISPATCH_INTERJECT``, an engine that can pause its call: the in-process
one, between recognition batches).

No order of the queue shortens the wait for an engine to *finish* a page, and a back-fill's
long pages keep every engine for seconds. So while its engine computes, each slot's
interjector waits on a second doorbell for a ticket the round robin may give it
(``scheduler.py``): the lane with the most credit of those that may interject. When that
ticket's tenant has nothing running (but the very call it
would pause, while other tenants hold the other engines: its short page need not wait for
its own long one, and takes no engine time from anyone else; a tenant alone keeps its own
order) and every live engine is busy, it takes the ticket and the engine runs it at the next
pause of its page, which then resumes (``app/engines/engine_thread.py``).

Another goes into the same call only once that call has run on its own at least as long as
it was paused for the ones before, so a paused page keeps at least half its engine and
always ends; none goes into a call whose requesters' time is nearly up; a tenant with a
ticket running elsewhere waits its turn as before, so a flood gains nothing; an idle engine
anywhere takes the ticket instead. Each call is charged its own engine time.

A submission rings the shared bell once: one interjector hears it, maybe not the one whose
call may take the page (the one engine running that tenant's pages). One that may not take
it rings that engine's own bell (``queue_take.lua``), so the page waits for no look on a
timer; a ring so passed is not passed again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from app import metrics
from app.cache.keys import QueueKeys
from app.cache.store import REDIS_ERRORS
from app.engine_side.claims import Claims
from app.engine_side.connections import BLOCK_MS, Connections
from app.engine_side.scheduler import Scheduler
from app.queue.ticket import INTERJECTOR, Ticket, as_text

log = logging.getLogger(__name__)

LOOK_SECONDS = 5.0  # an interjector unrung takes a look this often while its engine computes

# Computes tickets and stores them (all of it inside the engine's call in progress when told
# so: interjected); answers the engine seconds each ticket's call took (by id).
Serve = Callable[[Sequence[Ticket], bool], Mapping[str, float]]


class Call(NamedTuple):
    """The call a slot's engine runs: what its interjector decides by."""

    number: int  # this process's count of calls begun (0: none running)
    deadline: float  # when its first requester stops waiting (wall clock)
    began: float  # when it began (monotonic)
    lane: str  # the lane of its tickets ("": several)


NO_CALL = Call(0, 0.0, 0.0, "")


class Calls:
    """The call each slot's engine runs now, shared by its feeder (which begins and ends
    calls) and its interjector (which waits on them). ``mean_seconds``: an engine call's
    mean here."""

    def __init__(
        self, slots: int, stopped: threading.Event, mean_seconds: Callable[[], float]
    ) -> None:
        self._stopped = stopped
        self._mean_seconds = mean_seconds
        self._changed = threading.Condition()
        self._running = [NO_CALL] * slots
        self._count = 0

    def running(self, slot: int) -> Call:
        return self._running[slot]

    def computes(self, slot: int, busy: bool, deadline: float = 0.0, lane: str = "") -> None:
        """The slot's engine starts (or ends) a call (of ``lane``'s tickets): its
        interjector's cue."""
        with self._changed:
            self._count += 1
            self._running[slot] = (
                Call(self._count, deadline, time.monotonic(), lane) if busy else NO_CALL
            )
            self._changed.notify_all()

    def wake(self) -> None:
        """Stopping: every waiter looks again."""
        with self._changed:
            self._changed.notify_all()

    def may_pause(self, slot: int) -> bool:
        """The slot's call has time to be paused for one more call (two of this engine's
        mean) before its first requester stops waiting."""
        return self._running[slot].deadline - time.time() > 2 * self._mean_seconds()

    def next_call(self, slot: int, last: int) -> int:
        """The call the slot's engine runs now, once it is not ``last`` (0: stopped)."""
        with self._changed:
            while not self._stopped.is_set() and self._running[slot].number in (0, last):
                self._changed.wait()
            return 0 if self._stopped.is_set() else self._running[slot].number

    def lane_while(self, slot: int, call: int) -> str | None:
        """The lane of the slot's ``call`` ("": several) while it runs; None once it ended."""
        with self._changed:
            if self._stopped.is_set() or self._running[slot].number != call:
                return None
            return self._running[slot].lane

    def on_its_own(self, slot: int, call: int, lent: float) -> bool:
        """Wait until the slot's ``call`` has run on its own (its time less the ``lent``
        seconds it was paused for) at least ``lent`` seconds; False: it ended first."""
        with self._changed:
            while not self._stopped.is_set() and self._running[slot].number == call:
                short = 2 * lent - (time.monotonic() - self._running[slot].began)
                if short <= 0:
                    return True
                self._changed.wait(short)
            return False


class Interjector:
    """The interjectors of one set of feeders (one thread per slot, ``run``); ``name``: the
    feeders' consumer prefix (slot ``s``'s engine is ``{name}-{s}``); a slot's connection
    is registered under ``slots + slot``."""

    def __init__(
        self,
        names: QueueKeys,
        calls: Calls,
        scheduler: Scheduler,
        claims: Claims,
        connections: Connections,
        *,
        name: str,
        slots: int,
        stopped: threading.Event,
    ) -> None:
        self._names = names
        self._calls = calls
        self._scheduler = scheduler
        self._claims = claims
        self._connections = connections
        self._name = name
        self._slots = slots
        self._stopped = stopped

    def run(self, slot: int, serve: Serve, healthy: Callable[[], bool]) -> None:
        """While the slot's engine computes a call: a ticket of the lane with the most credit
        whose tenant has nothing running (but this call, while another tenant runs) and every
        engine is busy, interjected into that call; another once the call has run on its own
        as long as it was paused (so it keeps at least half its engine and always ends); none
        into a call whose requesters' time is nearly up."""
        calls, engine = self._calls, f"{self._name}-{slot}"  # the engine's consumer: what it holds
        consumer, key = f"{engine}{INTERJECTOR}", self._slots + slot
        shared, own = self._names.interject_bell, self._names.engine_bell_prefix + engine
        client: Any = None
        call = 0
        while (call := calls.next_call(slot, call)) and not self._stopped.is_set():
            lent = 0.0  # seconds this call was paused for (each ticket's whole serving)
            while calls.on_its_own(slot, call, lent):
                if not healthy() or not calls.may_pause(slot):
                    break
                try:
                    if client is None:
                        client = self._connections.open(key)
                    tickets, cost = list[Ticket](), 0.0
                    rung, looked = "", time.monotonic()
                    while (lane := calls.lane_while(slot, call)) is not None:
                        # On a ring, else now and then (a ring lost to the LRU): not every
                        # wait, which costs Redis. A shared ring reaches one interjector: one
                        # that may not take is told to pass it to the engine that may.
                        if rung or time.monotonic() - looked >= LOOK_SECONDS:
                            looked = time.monotonic()
                            paused, pass_on = (lane, engine), rung == shared
                            tickets, cost = self._scheduler.take(
                                client, consumer, True, paused, pass_on
                            )
                            if tickets:
                                break
                        heard = client.blpop([shared, own], timeout=BLOCK_MS / 1000)
                        rung = as_text(heard[0]) if heard else ""
                    if rung == shared and not tickets:  # as its call ended: another's
                        client.lpush(shared, "1")
                except REDIS_ERRORS as exc:
                    log.debug("dispatch interjector: %s", exc.__class__.__name__)
                    self._connections.drop(key, client)
                    client = None
                    break  # this call goes without: the next one may have one
                if not tickets:
                    break  # the call ended
                metrics.DISPATCH_TICKETS.labels(outcome="interjected").inc(len(tickets))
                began = time.monotonic()
                self._claims.serve(client, consumer, tickets, cost, lambda ts: serve(ts, True))
                lent += time.monotonic() - began
        if client is not None:
            self._claims.forget(client, consumer)
        self._connections.drop(key, client)
