"""Who computes a miss: the one place that decides.

1. In this process, the threads that miss the same image share one flight
   (``SingleFlight``): one of them goes on, the others wait for its outcome (COALESCED).
2. Across processes and replicas, that one submits the miss to the global queue
   as a ticket (``app.queue.requester.TicketQueue``): submitting is idempotent per key, so
   a miss already queued or running anywhere makes it a waiter on that ticket; the next
   free engine of any worker computes it and stores it in every tier
   (``compute.Computer.serve``).
3. It computes with its engine (``Computer.compute_and_store``; on a front the engine is a
   proxy to an engine process's direct endpoint, ``app.engines.direct``) when there is no queue
   to use: caching off or Redis down (the queue answers nothing), a request that recomputes
   (``no-cache``) or stores nothing (``no-store``: its result has no way back through Redis),
   or a ticket that ended without an entry to read. With no engine live, a queued miss waits
   for one to start (up to its deadline); these direct calls get 503 at once.

Before any of that, a tenant's miss quotas (``quotas.Quotas.miss``: misses in flight, engine
seconds per minute) may refuse the miss (429); hits never meet them.

A waiting request never waits past its deadline (``OCR_TIMEOUT_SECONDS``) and is never
answered with another input's result: flights are keyed by the entry key, the image's
SHA-256, whether it accepts similar answers and whether it recomputes (`no-cache`).

Traced (``app.tracing``): the wait on the queue is a ``queue.wait`` span (lane, whether it
joined another request's ticket, seconds waited) whose W3C context travels in the ticket, so
the engine's span joins the request's trace; a thread that joined another's flight links
its span to the trace that computed it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from app import tracing
from app.cache.codec import Codec
from app.cache.keys import KeySpace
from app.cache.quotas import Quotas
from app.cache.singleflight import SingleFlight
from app.cache.store import Store
from app.cache.tier import Probe
from app.engine_calls.compute import Computer
from app.queue.requester import TicketQueue
from app.queue.ticket import Ticket
from app.vocabulary import CacheStatus, OcrResult, Outcome

log = logging.getLogger(__name__)


class MissPath:
    def __init__(
        self,
        computer: Computer,
        queue: TicketQueue | None,
        store: Store,
        keys: KeySpace,
        codec: Codec,
        timeout_seconds: float,
        keep: Callable[[Probe, OcrResult, float], None] = lambda probe, result, ttl: None,
        clock: Callable[[], float] = time.time,
        quotas: Quotas | None = None,
    ) -> None:
        """``keep``: a result another process stored, read from L2, for the tiers before it
        (L1); ``quotas``: the tenants' miss quotas (none: unlimited)."""
        self._quotas = quotas
        self._computer = computer
        self._queue = queue
        self._store = store
        self._keys = keys
        self._codec = codec
        self._timeout = timeout_seconds
        self._keep = keep
        self._clock = clock
        # Each flight's outcome with its computing span's W3C context (a joiner's link).
        self._flights: SingleFlight[tuple[Outcome, dict[str, str]]] = SingleFlight()

    @property
    def queue(self) -> TicketQueue | None:
        """The global miss queue (None: caching off or no Redis)."""
        return self._queue

    def resolve(self, probe: Probe, look_again: Callable[[Probe], None]) -> Outcome:
        """The probe's outcome: another thread's (COALESCED), a tier's found on a second
        look once this thread's turn came (``look_again``: another computation may have
        finished meanwhile), or a computation (MISS)."""
        choices = f"{int(probe.controls.similar)}{int(probe.controls.no_cache)}"
        flight = f"{probe.key}#{probe.digest.sha256}#{choices}"
        (outcome, computing), shared = self._flights.do(
            flight, lambda: (self._miss(probe, look_again), tracing.TRACER.current().carrier())
        )
        if shared:
            tracing.TRACER.current().link(computing)
            return Outcome(outcome.result, CacheStatus.COALESCED, outcome.tier, outcome.details)
        return outcome

    def _miss(self, probe: Probe, look_again: Callable[[Probe], None]) -> Outcome:
        controls = probe.controls
        if not controls.no_cache:
            look_again(probe)
            if probe.outcome is not None:
                return probe.outcome
        probe.image  # noqa: B018 - an invalid image is the client's error, before any queue
        if self._quotas is None:
            return self._compute(probe)
        with self._quotas.miss(controls.namespace):
            return self._compute(probe)

    def _compute(self, probe: Probe) -> Outcome:
        controls = probe.controls
        timeout = None  # the engine call's own (OCR_TIMEOUT_SECONDS)
        queue = self._queue
        if queue is not None and not controls.no_cache and not controls.no_store:
            lane = queue.lane(controls.namespace, controls.background)
            with tracing.TRACER.span("queue.wait", {"ocr.queue.lane": lane}) as span:
                began = time.monotonic()
                ticket, expires = self._ticket(probe, span.carrier(), lane), [0.0]
                read = self._reader(probe, expires)
                log.debug("miss %s: queued on lane %s", probe.key, lane)
                result, joined = queue.request(ticket, read, self._timeout)
                span.set("ocr.queue.waited_seconds", time.monotonic() - began)
                span.set("ocr.queue.joined", joined)
                span.set("ocr.queue.answered", result is not None)
            if result is not None:
                self._keep(probe, result, expires[0] - self._clock())
                return Outcome(result, CacheStatus.COALESCED if joined else CacheStatus.MISS)
            timeout = ticket.deadline - self._clock()  # what is left (none: answered at once)
        with tracing.TRACER.span("engine.call"):
            return Outcome(self._computer.compute_and_store(probe, timeout), CacheStatus.MISS)

    def _ticket(self, probe: Probe, trace: dict[str, str], lane: str) -> Ticket:
        """``trace``: the W3C context the engine's span continues (none: tracing off)."""
        controls = probe.controls
        return Ticket(
            key=probe.key, sha256=probe.digest.sha256, params=probe.params,
            namespace=controls.namespace, ttl=controls.ttl or self._computer.ttl(),
            deadline=self._clock() + self._timeout, data=probe.data,
            archive=not controls.ttl, trace=trace.get(tracing.TRACEPARENT, ""),
            tracestate=trace.get(tracing.TRACESTATE, ""), lane=lane,
        )  # fmt: skip

    def _reader(
        self, probe: Probe, expires: list[float]
    ) -> Callable[[str], tuple[bool, OcrResult | None, str | None]]:
        """(Redis ok, the entry's result, the ticket's error marker), in one round trip; the
        entry's expiry goes to ``expires`` (what L1 may keep it for)."""

        def read(ticket_id: str) -> tuple[bool, OcrResult | None, str | None]:
            error_key = self._keys.ticket_error(probe.key, ticket_id)
            ok, (value, error) = self._store.get_many([probe.key, error_key])
            entry = self._codec.decode(
                value, probe.digest.sha256, self._keys.fingerprint, probe.key
            )
            if entry is None:
                return ok, None, error.decode() if error else None
            expires[0] = entry.expires_at
            return ok, entry.result, None

        return read
