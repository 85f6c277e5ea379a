"""The lane scheduler: which ticket an engine takes next, by deficit round robin over engine
time across the tenants' lanes, in one script (``app/cache/scripts/queue_take.lua``) so every
worker and replica shares one schedule.

- The ring holds the lanes with waiting tickets. A lane that becomes active joins at its
  head, with one quantum (the cheapest lane's ticket) times its share of credit.
- The lane with the most credit left (a deficit above 0; ties: ring order) is served, each
  ticket charged its lane's mean engine time (learnt from the lane's finished tickets), and
  goes to the ring's tail once its credit is spent.
- When no lane has credit, each gets as many rounds of a quantum times its tenant's
  ``share`` as it takes for one to have some, in one step.
- A finished ticket corrects its lane's deficit to the engine time it really took
  (``claims.py``). A lane with nothing waiting leaves the ring and forgets its deficit (no
  banked credit, no debt).
- A take serves one lane, at most ``ENGINE_BATCH_MAX`` tickets, in one pass over the ring
  whatever the costs. A lane alone in the ring owes nobody: its tickets are read in turn,
  charged nothing, and it keeps no deficit (the pass that left it alone dropped it, and
  charged that pass's ticket nothing either; three commands a take, the common case of one
  tenant); a lane that joins it finds both just active.
- The queue's keys may be evicted like any other (``allkeys-lru``): a lane missing from the
  ring is put back, just active, by its waiters' checks and by every engine's report (which
  also drops a deficit a lane out of the ring kept); lost deficits or costs only reset the
  schedule.

So a tenant that floods gets the engines only while nobody else waits, and a tenant that
sends one page is served by the next engine that frees up. Work-conserving: whoever waits is
served. With ``DISPATCH_FAIRNESS=fifo`` there is one lane. With shares 3:1, two back-fills
get the engines' time 3:1 (``tests/test_fairness.py``; ``make bench-fairness``).

The same step decides interjection (``interjection.py``): in that mode, only while every
live engine is busy, it gives a ticket of the lane with the most credit among those with
nothing running (but, at most, the call it would pause, while another lane runs); a lane
running elsewhere is passed over (it holds engines already: its banked credit must not keep
a lane with nothing running waiting a whole call), a lane in debt still waits; else nothing,
and the ring stays as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.cache.keys import QueueKeys
from app.cache.scripts import QUEUE_FINISH_TAKE, QUEUE_TAKE
from app.queue.ticket import GROUP, Decoded, Ticket, as_text, decode


class Scheduler:
    """Takes tickets for a consumer by the round robin. ``mean_seconds``: this engine's mean
    call (a lane's cost until it has its own); ``batch_max``: tickets per engine call;
    ``live_ms``: how lately an engine reported to count as live (interjection's "every
    engine busy"); ``rejected(client, decoded)``: what becomes of entries that cannot be
    computed (``Claims.reject``)."""

    def __init__(
        self,
        names: QueueKeys,
        *,
        mean_seconds: Callable[[], float],
        batch_max: int,
        live_ms: int,
        rejected: Callable[[Any, list[Decoded]], None],
    ) -> None:
        self._names = names
        self._mean_seconds = mean_seconds
        self._batch_max = batch_max
        self._live_ms = live_ms
        self._rejected = rejected

    def take(
        self,
        client: Any,
        consumer: str,
        interject: bool = False,
        paused: tuple[str, str] = ("", ""),
        pass_on: bool = False,
        finishing: tuple[list[str], list[str | int]] | None = None,
    ) -> tuple[list[Ticket], float]:
        """The next tickets by the round robin, and what each was charged (seconds);
        ``interject``: one ticket to run inside this engine's call, if one may; ``paused``:
        that call's lane ("": several) and its engine's consumer; ``pass_on``: none may, but
        a lane's ticket may go inside the call of the engine that alone runs that lane's
        tickets: its interjector is rung (once: a ring so passed is not passed again);
        ``finishing``: the finish (keys, args) of the tickets this consumer just ran, done
        first in the same script (``QUEUE_FINISH_TAKE``: a round trip fewer per call)."""
        names, quantum = self._names, max(0.001, self._mean_seconds())  # a lane's first cost
        count, window = (1, str(self._live_ms)) if interject else (self._batch_max, "")
        keys = [names.ring, names.deficits, names.shares, names.costs, names.engines,
                names.lanes, names.stream_prefix, names.engine_bell_prefix]  # fmt: skip
        args = [GROUP, consumer, count, f"{quantum:.6f}", window, *paused, "1" if pass_on else ""]
        if finishing is None:
            answer = QUEUE_TAKE(client, keys, args)
        else:
            answer = QUEUE_FINISH_TAKE.run_chain(client, finishing, (keys, args))
        if not answer:
            return [], 0.0
        lane, entries, cost = as_text(answer[0]), answer[1], float(answer[2])
        tickets, rejected = [], []
        for entry_id, flat in entries:
            raw = dict(zip(flat[::2], flat[1::2], strict=True))
            decoded = decode(entry_id, raw, lane=lane)
            if decoded.ok:
                tickets.append(decoded.ticket)
            else:
                rejected.append(decoded)
        if rejected:
            self._rejected(client, rejected)
        return tickets, cost
