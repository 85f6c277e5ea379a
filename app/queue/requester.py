"""The requester's side of the global miss queue: a front submits its miss as a ticket and
waits for its entry. One queue per engine fingerprint (and sealing key: during a rotation of
``CACHE_ENCRYPTION_KEYS`` a front's misses go only to engines whose entries it can open)
that every free engine of every worker and replica pulls from (``feeders.py``), so no engine
idles while a miss waits anywhere; or, with ``DISPATCH_SHARDS``, one such queue per shard
(each on its own Redis Cluster master, served by its own engines), a miss going to its entry
key's shard (``shard_of``: one image always meets one shard). Each tenant's tickets wait
in a lane of their own (a Redis stream); engines take from the lanes by deficit round robin
over engine time (``scheduler.py``), so one tenant's back-fill cannot hold another's single
miss behind it.

Submitting is idempotent per key: a ticket already queued or running for the same entry key
(a marker beside the stream names it) makes the caller a waiter on it, so one image is
computed once across processes and replicas, without a lease. A waiter blocks on the entry's
done channel (``app/cache/notify.py``), which says how its ticket ended: ``ok`` (read the
entry), ``error``, ``lost`` (no entry could be stored: compute it here) or ``gone`` (it left
the queue unrun: its creator gave up, or an engine dropped it past its deadline; submit
again). Waiting costs Redis nothing else but a fallback check every
``DISPATCH_CHECK_SECONDS``, one call per lane for all this process's waiters in it
(``watch.py``), and at once after the listener reconnected (a notice sent meanwhile is
lost), for what sends no notice: a ticket that vanished (taken by the LRU with its stream)
is submitted again, a lane the LRU took from the ring is put back. A ticket whose marker
alone was evicted still runs (``claims.py``): its waiters go on waiting. Every key here may
be evicted under ``allkeys-lru``: that costs a resubmission or one local engine call, never
a wait to the deadline.

- **Bounded per lane**: a new ticket is refused (``EngineBusy``) when ``DISPATCH_QUEUE_MAX``
  tickets per live engine (one, with none live) are already waiting in its tenant's lane (a
  tenant's flood fills only its own); live engines are the slots whose process reported
  them within the live window (``live_ms``, ``app/engine_side/heartbeat.py``). Its
  ``Retry-After``: the mean engine call times the tickets waiting, over the live engines.
- **Scale to zero**: a ticket is queued whether or not an engine is live; it waits for one
  to start (KEDA's activation on the backlog, ``app/queue/backlog.py``) up to its deadline.
- **Deadlines**: a waiter stops at its own (``OCR_TIMEOUT_SECONDS``); the ticket's creator
  then deletes it if no engine has started it. A ticket runs on its creator's deadline: a
  waiter that joined it with more time left is not failed by that deadline (an engine's
  ``timeout:``), it submits again. An entry that appears while the caller's own ticket is
  still queued (another process stored it) withdraws that ticket unstarted.
- **Shards help each other**: with several shards, a miss that waits behind its own
  shard's busy engines (more tickets waiting in its lane than engines free of it, none live
  included, or rings on the idle engines' bell that no engine heard) asks another
  shard for help, each in turn: its number pushed on that shard's help bell
  (``asks.py``), where an idle engine of that shard hears it and takes from this one
  (``app/engine_side/helping.py``); the lane's fallback check asks again while its tickets
  wait. One or two commands on another master, and only while a shard is behind.
- **Redis down**: the caller computes with its own engine (``None``; a front's is the direct
  path to an engine process, ``app/engines/direct.py``).

- **Withdrawn**: a caller waiting inside ``cancellable(event)`` (a document job's page)
  stops once ``event`` is set: its ticket is deleted if no engine has started it, and it
  raises ``Withdrawn`` (a ticket another request joined is then submitted again by that one).

What a ticket carries, and its wire format: ``ticket.py``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from typing import Any

from app import metrics, tracing
from app.cache.keys import KeySpace, QueueKeys, shard_of
from app.cache.notify import Notifier
from app.cache.scripts import QUEUE_CANCEL, QUEUE_SUBMIT
from app.cache.store import RedisStore
from app.queue.asks import HelpAsks
from app.queue.ticket import BACKGROUND, DEFAULT_LANE, GROUP, Ticket, as_text, failure
from app.queue.watch import Alive, LaneWatch
from app.vocabulary import EngineBusy, EngineTimeout, OcrCacheError, OcrResult

Read = Callable[[str], tuple[bool, OcrResult | None, str | None]]

# A waiter's fallback check on its ticket: first after ``poll_seconds``
# (``DISPATCH_CHECK_SECONDS``), then at doubling gaps up to this or ``poll_seconds``,
# whichever is longer (``TicketQueue._wait``). What sends no notice is rare (the LRU taking a
# queued ticket), and a listener that reconnected makes every waiter check at once.
CHECK_MAX_SECONDS = 16.0
WAKE_SECONDS = 0.5  # how soon a waiter sees its withdrawal (a local wait: no Redis command)

_CANCEL: ContextVar[threading.Event | None] = ContextVar("ticket_cancel", default=None)


class Withdrawn(OcrCacheError):
    """The caller stopped waiting for its ticket (``cancellable``): a cancelled job's page."""

    code = "withdrawn"


@contextmanager
def cancellable(event: threading.Event) -> Iterator[None]:
    """Tickets waited for in this context are withdrawn once ``event`` is set."""
    token = _CANCEL.set(event)
    try:
        yield
    finally:
        _CANCEL.reset(token)


def lane_full(lane: str, tenant: str, waiting: int, engines: int, mean: float) -> EngineBusy:
    """The refusal of a submission to a full lane (counted), its ``Retry-After`` the wait
    ahead: ``waiting`` tickets of ``mean`` seconds over the live engines."""
    metrics.ENGINE_QUEUE_DROPPED.labels(reason="full").inc()
    metrics.TENANT_REJECTIONS.labels(tenant=tenant, reason="queue_full").inc()
    retry = max(1, math.ceil(mean * waiting / max(1, engines)))
    whose = "the engine queue" if lane == DEFAULT_LANE else f"tenant {lane!r}'s lane"
    return EngineBusy(
        f"{whose} is full ({waiting} waiting for {engines} engines); retry later", retry
    )


def leave_trace(
    store: RedisStore, names: QueueKeys, ticket: Ticket, ticket_id: str, ttl_ms: int
) -> None:
    """A traced request that queued a ticket leaves its context beside it, for the requests
    that join the ticket (from any front) to link to: one write, when traced."""
    key, context = names.trace(ticket_id), f"{ticket.trace}\n{ticket.tracestate}"
    store.run("dispatch", lambda c: c.set(key, context, px=ttl_ms))


def link_to_queuer(store: RedisStore, span: tracing.Span, names: QueueKeys, ticket_id: str) -> None:
    """A request that joined a ticket another request queued (another front's, it may be)
    links to the trace that queued it, when that one was traced."""
    ok, context = store.run("dispatch", lambda c: c.get(names.trace(ticket_id)))
    if not ok or not context:
        return
    text = context.decode(errors="replace") if isinstance(context, bytes) else str(context)
    parent, _, state = text.partition("\n")
    span.link({tracing.TRACEPARENT: parent, **({tracing.TRACESTATE: state} if state else {})})


class TicketQueue:
    """One per front door (per process): submits its misses and waits for their entries.
    ``fair``: each tenant's tickets in a lane of their own (``DISPATCH_FAIRNESS=drr``), else
    every ticket in the default lane (arrival order); ``share(namespace)``: a tenant's share,
    ``label(namespace)`` its metrics label."""

    def __init__(
        self,
        store: RedisStore,
        keys: KeySpace,
        notifier: Notifier,
        *,
        per_engine_max: int,
        live_ms: int,
        poll_seconds: float,
        mean_seconds: Callable[[], float],
        writer: str = "",
        fair: bool = True,
        share: Callable[[str], float] = lambda namespace: 1.0,
        background_share: float = 1.0,
        label: Callable[[str], str] = lambda namespace: namespace or "default",
        clock: Callable[[], float] = time.monotonic,
        shards: int = 1,
        home: int = 0,
    ) -> None:
        self._store, self._keys, self._notifier = store, keys, notifier
        # Every shard of the queue (``DISPATCH_SHARDS``: a ticket goes to its entry key's,
        # ``shard_of``), and the one this process's engines serve (``DISPATCH_SHARD``).
        self.shards = keys.dispatch_shards(writer, shards)
        self.names = self.shards[home]
        self._per_engine_max = per_engine_max
        self.live_ms = live_ms  # an engine that reported this lately is live
        self._poll_seconds = poll_seconds
        self._mean_seconds = mean_seconds
        self._fair, self._share, self._background_share = fair, share, background_share
        self._label, self._clock = label, clock
        # The fallback checks, one per lane for all this process's waiters in it; one made
        # within half a period answers a waiter due meanwhile. With shards, a miss behind busy
        # engines asks another shard for help, and a check still finding it asks again.
        self._ask = HelpAsks(store, self.shards)  # with one shard, asks nothing
        self._watch = LaneWatch(store, live_ms=live_ms, fresh_seconds=poll_seconds / 2,
                                clock=clock, waiting=self._ask.still_waiting)  # fmt: skip

    def lane(self, namespace: str, background: bool = False) -> str:
        """The lane of a tenant's tickets; ``background``: of its document jobs' pages, a
        lane of their own with ``JOBS_SHARE`` of the tenant's share (one lane in FIFO)."""
        lane = namespace if self._fair and namespace else DEFAULT_LANE
        return lane + BACKGROUND if background and self._fair else lane

    def names_of(self, ticket: Ticket) -> QueueKeys:
        """The queue shard of ``ticket``: its entry key's (the only one with several)."""
        return self.shards[shard_of(ticket.key, len(self.shards))]

    def stream(self, ticket: Ticket) -> str:
        return self.names_of(ticket).stream(ticket.lane)

    def marker(self, ticket: Ticket) -> str:
        return self.names_of(ticket).marker(ticket.key, ticket.sha256)

    def image(self, ticket: Ticket) -> str:
        return self.names_of(ticket).image(ticket.key, ticket.sha256)

    def request(self, ticket: Ticket, read: Read, timeout: float) -> tuple[OcrResult | None, bool]:
        """(``ticket``'s result once an engine stored it, whether it joined a ticket another
        request had queued); None: compute it here instead (Redis down, or the ticket ended
        without an entry to read). With no engine live it waits for one to start, up to its
        deadline (``EngineTimeout``). ``read(ticket id)`` answers (Redis ok, the
        entry's result, the ticket's error marker)."""
        channel = self._keys.done(ticket.key)
        event = self._notifier.register(channel)  # before submitting: no message is missed
        deadline = self._clock() + timeout
        try:
            while True:
                submitted = self._submit(ticket, deadline)
                if submitted is None:
                    return None, False
                ticket_id, created, lane = submitted
                with self._watch.watching(self.names_of(ticket), lane, ticket_id) as alive:
                    again, result, joined = self._wait(
                        replace(ticket, lane=lane), ticket_id, created, event, read, deadline, alive
                    )
                if not again:
                    return result, joined
        finally:
            self._notifier.unregister(channel, event)

    def _submit(self, ticket: Ticket, deadline: float) -> tuple[str, bool, str] | None:
        """(ticket id, created by us, the lane it waits in: another's when it joined a ticket
        queued in another lane), or None: no queue to use."""
        marker_ttl = str(max(1000, int((deadline - self._clock()) * 1000)))
        lane, names = ticket.lane, self.names_of(ticket)
        weight = self._background_share if lane.endswith(BACKGROUND) else 1.0
        share = f"{self._share(ticket.namespace) * weight:g}"

        def run(client: Any) -> Any:
            keys = (names.stream(lane), names.engines, self.marker(ticket), names.ring,
                    names.lanes, names.shares, names.bell, names.interject_bell,
                    names.stream_prefix)  # fmt: skip
            now = str(int(time.time() * 1000))
            limits = (self._per_engine_max, self.live_ms, marker_ttl, lane, share, now)
            # The image to its own key in the same round trip (``ticket.py``, format 2); also
            # when it joins or the lane is full: the same bytes, for a marker's life at most.
            image = ("SET", self.image(ticket), ticket.data, "PX", marker_ttl)
            return QUEUE_SUBMIT.after(client, [image], keys, [GROUP, *limits, *ticket.fields()])

        ok, answer = self._store.run("dispatch", run)
        if not ok:
            return None
        raw_id, waiting, engines = answer[:3]
        created = int(waiting) >= 0
        held_in = as_text(answer[3]) if len(answer) > 3 and not created else lane
        ticket_id = as_text(raw_id)
        if not ticket_id:
            tenant, mean = self._label(ticket.namespace), self._mean_seconds()
            raise lane_full(lane, tenant, int(waiting), int(engines), mean)
        if created:
            self._ask.queued(names, answer)
        span = tracing.TRACER.current()  # the request's ``queue.wait`` span, when traced
        if created:  # its place in its lane when queued
            span.set("ocr.queue.position", int(waiting))
            if ticket.trace:
                leave_trace(self._store, names, ticket, ticket_id, int(marker_ttl))
        elif span.recording:
            link_to_queuer(self._store, span, names, ticket_id)
        return ticket_id, created, held_in

    def _wait(
        self,
        ticket: Ticket,
        ticket_id: str,
        created: bool,
        event: Any,
        read: Read,
        deadline: float,
        alive: Alive,
    ) -> tuple[bool, OcrResult | None, bool]:
        """(submit again, the result, whether another ticket computed it); a result None:
        compute here.

        Waiting costs Redis nothing but the notices: the entry's done channel says ``ok``,
        ``error``, ``lost`` (compute it here) or ``gone`` (the ticket left the queue unrun:
        submit again), and a notice wakes a read. A check on the ticket itself (``alive``:
        ``watch.py``, one call a lane for every waiter of this process) is only the fallback
        for what sends no notice (the LRU took the ticket's stream, a notice lost while the
        listener reconnected): at
        ``poll_seconds``, then at doubling gaps up to ``CHECK_MAX_SECONDS`` (or
        ``poll_seconds`` if longer), so a long wait costs a few checks more than a short one,
        not one per half second. The local wake-ups in between (deadline, withdrawal) send
        nothing."""
        seen, cancel = 0, _CANCEL.get()
        gap = self._poll_seconds
        # A joiner reads at once: the ticket it joined may have announced its entry before
        # this caller registered (between the engine's notice and its finish).
        next_check = self._clock() + (0 if not created else gap)
        while True:
            if cancel is not None and cancel.is_set():
                self._give_up(ticket_id, ticket, created, "withdrawn")
                raise Withdrawn(f"ticket {ticket_id} withdrawn by its caller")
            messages = event.messages[seen:]  # one snapshot: nothing appended is skipped
            seen += len(messages)
            for message in messages:
                if message == f"lost:{ticket_id}":
                    return False, None, False
                if message.startswith(f"error:{ticket_id}:"):
                    if self._outlives(message.split(":", 2)[2], created, deadline):
                        return True, None, False
                    raise failure(message.split(":", 2)[2])
            finished = f"ok:{ticket_id}" in messages
            gone = f"gone:{ticket_id}" in messages  # left unrun: submit again (after a read)
            now = self._clock()
            # "": the listener reconnected, and a notice sent meanwhile is lost: check now.
            checking = now >= next_check or "" in messages
            if messages or checking:  # a notice (any ticket's entry of this key), or the check
                ok, result, error = read(ticket_id)
                if result is not None:
                    # Ours (finished: nothing to withdraw), or another ticket's stored
                    # meanwhile: then ours is withdrawn unstarted.
                    joined = not created or (
                        not finished and self._give_up(ticket_id, ticket, created, "")
                    )
                    return False, result, joined
                if error is not None:
                    if self._outlives(error, created, deadline):
                        return True, None, False
                    raise failure(error)
                if not ok and self._store.breaker_state != "closed":
                    # Redis stopped answering (its breaker opened): this process's own engine.
                    # One failed read on a slow moment is not that: the next check tells (a
                    # miss sent the direct way while its engine restarted was answered 503).
                    self._give_up(ticket_id, ticket, created)
                    return False, None, False
                if finished:  # done, and its entry is already gone (evicted): one call here
                    return False, None, False
                if gone:
                    return True, None, False
            remaining = deadline - now
            if remaining <= 0:
                self._give_up(ticket_id, ticket, created)
                raise EngineTimeout(f"OCR took longer than OCR_TIMEOUT_SECONDS ({ticket_id})")
            if checking:
                gap = min(2 * gap, max(CHECK_MAX_SECONDS, self._poll_seconds))
                next_check = now + gap
                if not alive("" in messages):
                    # Finished since the read (its entry is stored before it leaves the queue,
                    # a failure's marker too), or dropped, or its marker or stream evicted:
                    # then submit again.
                    ok, result, error = read(ticket_id)
                    if result is not None:
                        return (
                            False,
                            result,
                            not created or self._give_up(ticket_id, ticket, created, ""),
                        )
                    if error is not None and not self._outlives(error, created, deadline):
                        raise failure(error)
                    return True, None, False
            # Local wake-ups (a withdrawal, the deadline) cost nothing; Redis is asked only at
            # the next check or on a notice.
            event.wait(min(remaining, WAKE_SECONDS, max(0.0, next_check - self._clock())))
            event.clear()

    def _outlives(self, error: str, created: bool, deadline: float) -> bool:
        """A joined ticket ran out of its creator's time (the ticket's deadline), not ours: this
        waiter submits again rather than fail before its own deadline."""
        return not created and error.startswith("timeout:") and self._clock() < deadline

    def _give_up(
        self, ticket_id: str, ticket: Ticket, created: bool, reason: str = "caller_gone"
    ) -> bool:
        """Stop waiting: a ticket this caller created is deleted if no engine started it
        (whether it was; counted as dropped for ``reason``)."""
        if not created:
            return False
        ok, deleted = self._store.run(
            "dispatch",
            lambda c: QUEUE_CANCEL(
                c,
                [self.stream(ticket), self.marker(ticket), self.image(ticket)],
                [GROUP, ticket_id],
            ),
        )
        if ok and deleted:
            # Whoever joined it hears that it left unrun, and submits again (or reads the
            # entry that made it unneeded).
            self._store.publish(self._keys.done(ticket.key), f"gone:{ticket_id}")
            if reason:
                metrics.ENGINE_QUEUE_DROPPED.labels(reason=reason).inc()
        return bool(ok and deleted)
