"""The waiters' fallback check on their tickets (``TicketQueue._wait``), made once per lane
for every ticket this process waits on in it, not once per waiter.

Notices tell a waiter how its ticket ended; what sends none (the LRU taking a lane's stream,
its ring or its bell; a notice lost while the listener reconnected) is found by a check every
``DISPATCH_CHECK_SECONDS``. Made by each waiter, that check cost the queue's master a script
call and six commands per waiting miss and per period: the largest share of a long wait's
cost there (issue 48). Here a waiter whose check is due asks for every ticket of its lane
that this process waits on, in one call (``queue_watch.lua``); a waiter due soon after reads
that answer, if the check began after its own wait did (its ticket existed then) and is
fresh (``fresh_seconds``). A lane's check then costs one call per process and period
however many misses wait in it, and its repairs (ring, lanes, doorbell, a silent holder's
reclaim) are made once for all of them. With queue shards, a check that finds tickets
waiting untaken, or held by a silent holder, tells ``waiting`` (the requester asks another
shard for help again).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from app.cache.keys import QueueKeys
from app.cache.scripts import QUEUE_WATCH
from app.cache.store import RedisStore
from app.queue.ticket import GROUP, INTERJECTOR, as_text

Alive = Callable[[bool], bool]


def _order(ticket_id: str) -> tuple[int, int]:
    """A stream id's place: its milliseconds, then its sequence."""
    ms, _, seq = ticket_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class _Lane:
    names: QueueKeys
    lane: str
    since: dict[int, tuple[str, float]] = field(default_factory=dict)  # waiter: (id, began)
    checked_at: float = float("-inf")  # when the last check began
    present: frozenset[str] = frozenset()  # what it found
    checking: threading.Lock = field(default_factory=threading.Lock)  # one check at a time


class LaneWatch:
    """The tickets this process waits on, by lane, and their last check."""

    def __init__(
        self,
        store: RedisStore,
        *,
        live_ms: int,
        fresh_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        waiting: Callable[[QueueKeys, bool], None] | None = None,
    ) -> None:
        self._store = store
        # Told the shard of a lane whose check found tickets waiting untaken, and whether a
        # holder of its tickets was silent.
        self._waiting = waiting
        self._live_ms = live_ms  # an engine silent this long is gone: its tickets reclaimed
        self._fresh = fresh_seconds
        self._clock = clock
        self._lock = threading.Lock()  # the lanes' table (each lane's check has its own)
        self._lanes: dict[str, _Lane] = {}
        self._waiters = itertools.count()

    @contextmanager
    def watching(self, names: QueueKeys, lane: str, ticket_id: str) -> Iterator[Alive]:
        """While a caller waits on ``ticket_id`` (queued in ``lane`` of the shard ``names``):
        yields its check, ``alive(news)``: is the ticket still queued or running? (True when
        Redis is unsure: the next read tells.) ``news``: asked after news that the queue may
        have lost tickets (a listener that reconnected, a lost queue announced): a check made
        before it does not answer."""
        stream, waiter = names.stream(lane), next(self._waiters)
        with self._lock:
            watched = self._lanes.setdefault(stream, _Lane(names, lane))
            watched.since[waiter] = (ticket_id, self._clock())
        try:
            yield lambda news: self._alive(stream, watched, waiter, news)
        finally:
            with self._lock:
                del watched.since[waiter]
                if not watched.since:
                    del self._lanes[stream]

    def _alive(self, stream: str, watched: _Lane, waiter: int, news: bool) -> bool:
        asked = self._clock()  # with news: only a check begun since answers
        with watched.checking:  # one check of a lane at a time: those due meanwhile read it
            with self._lock:
                ticket_id, began = watched.since[waiter]
                now = self._clock()
                # Begun after this waiter queued (strictly: its ticket among those asked), and
                # with news, no earlier than it asked.
                fresh = now - watched.checked_at < self._fresh
                after_news = not news or watched.checked_at >= asked
                if watched.checked_at > began and after_news and fresh:
                    return ticket_id in watched.present  # checked since it was queued
                ids = sorted({other for other, _ in watched.since.values()}, key=_order)
            names, lane = watched.names, watched.lane
            keys = (stream, names.ring, names.lanes, names.bell, names.engines, names.deficits)
            cutoff = int(time.time() * 1000) - self._live_ms  # reported before: gone
            args: list[str | int] = [lane, GROUP, cutoff, INTERJECTOR, ids[0], ids[-1], *ids]
            ok, answer = self._store.run("dispatch", lambda c: QUEUE_WATCH(c, keys, args))
            if not ok:
                return True
            present, state = answer
            with self._lock:
                watched.checked_at = now
                watched.present = frozenset(as_text(found) for found in present)
            if int(state) and self._waiting is not None:  # untaken (1) or a silent holder (2)
                self._waiting(names, int(state) == 2)
            return ticket_id in watched.present
