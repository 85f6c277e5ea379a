"""The engine side of a miss: an engine call in this process (bounded, timed, counted) and
the result stored in every tier; and the tickets this process's feeders took from the global
queue, computed and stored the same way, their requesters told (``app.engine_side.feeders``).

A ticket is computed only if its key is what its own bytes, parameters and tenant make:
a writer to Redis cannot queue image B's bytes under image A's key. One whose entry is
already in L2 is answered from it; one whose requesters' deadline has passed is failed,
not computed.

Only the engine's own errors mark it failing (readiness, the feeders' pause): a request that
stopped waiting (``EngineTimeout``) or a full queue (``EngineBusy``) is load, not a broken
engine. Nor is either retried: a timed-out call is still running (it cannot be interrupted)
and its requesters' time is gone, and a full queue stays full. A queued ticket the engine
failed on its own (``EngineError``) or by a bug is handed back for another engine process,
once (``Feeders.retry``): a broken engine fails no request a healthy one can answer.

Traced (``app.tracing``): each ticket is an ``engine.ticket`` span continuing the trace its
requester put in it (``Ticket.trace``); the engine call an ``engine.recognize`` span under the
first ticket of its batch (linked to the others'), and storing each result a ``cache.write``.
PaddleOCR's pipeline detects and recognises inside one call, so the call is one span (its
batch size and images as attributes), not one per phase.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from app import metrics, tracing
from app.cache.keys import KeySpace, digest_image
from app.cache.tier import Chain, Probe
from app.engine_calls.engine_runner import EngineRunner
from app.engines.base import Engine, LineUse, OcrRequest
from app.imaging import DecodedImage
from app.queue.ticket import Ticket
from app.vocabulary import (
    TENANT_NAME,
    CacheControls,
    ClientError,
    EngineBusy,
    EngineError,
    EngineTimeout,
    OcrParams,
    OcrResult,
)

if TYPE_CHECKING:
    from app.engine_side.feeders import Feeders  # only an engine's serve them: typing only

log = logging.getLogger("app.cache.region")  # the name its log lines have always carried


class Ttl:
    """``CACHE_TTL_SECONDS``, shortened by up to ``CACHE_TTL_JITTER`` at random (entries
    written together do not expire together)."""

    def __init__(self, seconds: int, jitter: float) -> None:
        self.seconds = seconds
        self.jitter = jitter
        self._jitter = int(seconds * jitter)

    def __call__(self) -> int:
        if not self._jitter:
            return self.seconds
        return max(1, self.seconds - random.randint(0, self._jitter))


def line_use(controls: CacheControls) -> LineUse:
    """What line reuse may do for a request (``CACHE_LINES``), as its controls say for
    entries: bypassed (``pipeline.profile``), neither read nor write; ``no-cache``, write
    only (recompute, refresh); ``no-store``, read only; ``X-Cache-TTL`` caps the line TTL."""
    if controls.bypass:
        return LineUse(read=False, write=False)
    return LineUse(read=not controls.no_cache, write=not controls.no_store, ttl=controls.ttl)


def _request(probe: Probe) -> OcrRequest:
    controls = probe.controls
    return OcrRequest(probe.data, probe.image, probe.params, controls.namespace, line_use(controls))


class Computer:
    def __init__(
        self,
        engine: Engine,
        runner: EngineRunner,
        chain: Chain,
        keys: KeySpace,
        ttl: Ttl,
        decode: Callable[[bytes], DecodedImage],
        wait_for_engine: Callable[[], None] = lambda: None,
        on_engine_outcome: Callable[[bool], None] = lambda ok: None,
        charge: Callable[[str, float], None] = lambda namespace, seconds: None,
        direct: bool = False,
    ) -> None:
        """``charge(namespace, seconds)``: a tenant's engine call took this long (its
        quota, its metrics); ``direct``: the engine is a front's proxy to an engine process,
        which counts and charges the call itself (here: ``ocr_direct_calls_total``)."""
        self._engine = engine
        self._calls, self._seconds = (
            (metrics.DIRECT_CALLS, metrics.DIRECT_SECONDS)
            if direct
            else (metrics.ENGINE_CALLS, metrics.ENGINE_SECONDS)
        )
        self._charge = charge
        self.runner = runner
        self._chain = chain
        self._keys = keys
        self.ttl = ttl
        self._decode = decode
        self._wait_for_engine = wait_for_engine
        self._on_engine_outcome = on_engine_outcome
        self.failures = 0  # the engine's own failures in a row (its feeders slow, then stop)

    @property
    def failing(self) -> bool:
        """The engine's last call failed: its feeders slow down."""
        return self.failures > 0

    def _outcome(self, ok: bool) -> None:
        self.failures = 0 if ok else self.failures + 1
        self._on_engine_outcome(ok)

    def compute(
        self, probe: Probe, timeout: float | None = None, seconds: list[float] | None = None
    ) -> OcrResult:
        """One engine call here, for ``probe`` (its image decoded first); its engine
        seconds are charged to the probe's tenant (and appended to ``seconds``)."""
        self._wait_for_engine()
        kind, spent = self._engine.kind, list[float]()
        request = _request(probe)
        namespace = probe.controls.namespace
        charged = threading.Lock()  # held once its engine time is charged: by one side only

        def charge() -> float:
            total = sum(spent)
            if total and charged.acquire(blocking=False):
                self._charge(namespace, total)
            return total

        def late(result: OcrResult) -> None:
            """Its caller timed out, yet the call ended: the result kept for a retry (its
            engine time charged then, unless the caller saw it end)."""
            charge()
            self._chain.record(probe, result, probe.controls.ttl or self.ttl())

        try:
            result = self.runner.run(
                self._engine.recognize, request, timeout=timeout, elapsed=spent, late=late
            )
        except EngineBusy:
            self._calls.labels(engine=kind, outcome="busy").inc()
            raise  # load, not an engine failure: readiness is unchanged
        except EngineTimeout:
            self._calls.labels(engine=kind, outcome="timeout").inc()
            raise  # the request stopped waiting: not the engine's failure
        except EngineError:
            self._calls.labels(engine=kind, outcome="error").inc()
            self._outcome(False)
            raise
        finally:
            total = charge()  # 0 while an orphan runs on: ``late`` charges it
            if seconds is not None:
                seconds.append(total)
        self._outcome(True)
        self._calls.labels(engine=kind, outcome="ok").inc()
        # The engine's own time (a call that waited in the worker queue is not slower).
        self._seconds.labels(engine=kind).observe(sum(spent))
        return result

    def _spent(self, namespace: str, total: float, seconds: list[float] | None) -> None:
        """An engine call of ``namespace``'s took ``total`` seconds (0: it never ran here, or
        is still running after its caller gave up)."""
        if total:
            self._charge(namespace, total)
        if seconds is not None:
            seconds.append(total)

    def compute_and_store(self, probe: Probe, timeout: float | None = None) -> OcrResult:
        result = self.compute(probe, timeout)
        self._chain.record(probe, result, probe.controls.ttl or self.ttl())
        return result

    def _many(
        self, probes: list[Probe], deadlines: list[float], seconds: list[float] | None = None
    ) -> list[OcrResult | Exception]:
        """Probes with one set of parameters, each with its requester's deadline (wall
        clock): one engine call where the engine takes a list (``recognize_many``), bounded
        by the last deadline (the requesters who leave earlier stop waiting on their own side;
        the others still get their results, and every result is stored). A batch the engine
        failed is retried image by image, each within its own time left, so one bad image
        fails only itself; a batch that timed out or was refused is not (its time is gone,
        or the queue is full: every probe gets that answer, and none counts as a failure).
        ``seconds`` gets each probe's engine seconds (a batch's shared out evenly)."""
        if len(probes) > 1 and self._engine.batching:
            self._wait_for_engine()
            kind, spent = self._engine.kind, list[float]()
            requests = [_request(probe) for probe in probes]

            def late(results: list[OcrResult]) -> None:  # kept for the retries, as one call's
                for probe, result in zip(probes, results, strict=True):
                    self._spent(probe.controls.namespace, sum(spent) / len(probes), None)
                    self._chain.record(probe, result, probe.controls.ttl or self.ttl())

            try:
                results = self.runner.run(
                    self._engine.recognize_many, requests,
                    timeout=max(deadlines) - time.time(), elapsed=spent, late=late,
                )  # fmt: skip
            except (EngineTimeout, EngineBusy) as exc:
                outcome = "timeout" if isinstance(exc, EngineTimeout) else "busy"
                for probe in probes:
                    self._calls.labels(engine=kind, outcome=outcome).inc()
                    self._spent(probe.controls.namespace, 0.0, seconds)
                return [exc for _ in probes]
            except EngineError:
                pass  # one by one below: each image's own outcome
            else:
                self._outcome(True)
                share = sum(spent) / len(probes)
                for probe in probes:
                    self._calls.labels(engine=kind, outcome="ok").inc()
                    self._seconds.labels(engine=kind).observe(share)
                    self._spent(probe.controls.namespace, share, seconds)
                return list(results)
        answers: list[OcrResult | Exception] = []
        for probe, deadline in zip(probes, deadlines, strict=True):
            try:
                answers.append(self.compute(probe, deadline - time.time(), seconds))
            except EngineError as exc:
                answers.append(exc)
        return answers

    # The tickets of the global queue (``Feeders``' ``serve``) -----------------------------

    def serve(
        self, feeders: Feeders, tickets: Sequence[Ticket], interject: bool = False
    ) -> dict[str, float]:
        """Compute tickets, store each result in every tier and tell its requesters; a
        failed ticket gets an error marker instead (never an entry). A ticket whose entry is
        already in L2 (queued in the instant another ticket of that image finished) is not
        computed.
        Answers each computed ticket's engine seconds, by id (the round robin's correction).
        ``interject``: all of it on the engine's thread, inside its call in progress
        (``EngineRunner.interjected``)."""
        if not interject:
            return self._serve(feeders, tickets)
        try:
            left = max(ticket.deadline for ticket in tickets) - time.time()
            return self.runner.interjected(lambda: self._serve(feeders, tickets, True), left)
        except EngineTimeout as exc:  # never started: its requesters hear of it now
            for ticket in tickets:
                feeders.fail(ticket, f"timeout:{exc}")
            return {}

    def _serve(
        self, feeders: Feeders, tickets: Sequence[Ticket], interjected: bool = False
    ) -> dict[str, float]:
        spans = _ticket_spans(tickets, interjected)
        try:
            return self._serve_traced(feeders, tickets, spans)
        finally:
            for span in spans.values():
                span.end()

    def _serve_traced(
        self, feeders: Feeders, tickets: Sequence[Ticket], spans: dict[str, tracing.Span]
    ) -> dict[str, float]:
        spent: dict[str, float] = {}
        genuine: list[tuple[Ticket, Probe]] = []
        for ticket in tickets:
            if not _is_genuine(self._engine, self._keys, ticket):
                # Only a writer to Redis could queue this (a key that is not the one its image,
                # params and tenant name): refused, so no entry can be stored under it.
                log.warning("dispatch: ticket %s does not match its key; refused", ticket.id)
                feeders.fail(ticket, "error:a queued ticket that does not match its key")
                metrics.DISPATCH_TICKETS.labels(outcome="failed").inc()
                continue
            genuine.append((ticket, _probe_of(self._keys, self._decode, ticket)))
        l2 = self._chain.index("l2")
        self._chain.lookup([probe for _, probe in genuine], start=l2, stop=l2 + 1)
        groups: dict[OcrParams, list[tuple[Ticket, Probe]]] = {}
        for ticket, probe in genuine:
            if probe.outcome is not None:
                metrics.DISPATCH_TICKETS.labels(outcome="already_stored").inc()
                feeders.succeeded(ticket)
                continue
            if ticket.deadline <= time.time():  # its requester stopped waiting since it was read
                metrics.DISPATCH_TICKETS.labels(outcome="caller_gone").inc()
                metrics.ENGINE_QUEUE_DROPPED.labels(reason="caller_gone").inc()  # as _wanted
                feeders.fail(ticket, "timeout:the requester's deadline passed before the engine")
                continue
            try:
                probe.image  # noqa: B018 - decoded now: a bad image fails only its ticket
            except ClientError as exc:  # cannot happen for a ticket its requester decoded
                feeders.fail(ticket, f"error:{exc}")
                continue
            groups.setdefault(ticket.params, []).append((ticket, probe))
        for members in groups.values():
            answered: set[str] = set()
            seconds: list[float] = []
            try:
                # The requesters' deadlines bound the call, not this process's own timeout.
                with (
                    spans[members[0][0].id].active(),
                    tracing.TRACER.span(
                        "engine.recognize",
                        {"ocr.engine": self._engine.kind, "ocr.batch": len(members)},
                    ) as call,
                ):
                    for ticket, _ in members[1:]:
                        call.link(spans[ticket.id].carrier())
                    answers = self._many(
                        [probe for _, probe in members],
                        [ticket.deadline for ticket, _ in members],
                        seconds,
                    )
                spent.update(zip((ticket.id for ticket, _ in members), seconds, strict=False))
                for (ticket, probe), answer in zip(members, answers, strict=True):
                    with spans[ticket.id].active():
                        _answer(self._chain, feeders, ticket, probe, answer)
                    answered.add(ticket.id)
            except Exception as exc:  # a bug: another engine runs it, or its requesters hear now
                log.exception("dispatch: serving %d tickets failed", len(members))
                self._outcome(False)  # this process's feeders slow down, then stop
                for ticket, _ in members:
                    if ticket.id not in answered:
                        feeders.retry(ticket, f"bug:{exc.__class__.__name__}")
                        metrics.DISPATCH_TICKETS.labels(outcome="failed").inc()
        return spent


def _is_genuine(engine: Engine, keys: KeySpace, ticket: Ticket) -> bool:
    """A ticket's key is what its own bytes, params and tenant make (and its SHA-256
    theirs)."""
    if ticket.namespace and not TENANT_NAME.fullmatch(ticket.namespace):
        return False
    try:
        engine.check_params(ticket.params)
    except ClientError:
        return False
    digest = digest_image(ticket.data)
    return digest.sha256 == ticket.sha256 and ticket.key == keys.entry(
        digest, keys.task(ticket.params), ticket.namespace
    )


def _probe_of(keys: KeySpace, decode: Callable[[bytes], DecodedImage], ticket: Ticket) -> Probe:
    """A queued ticket as the front door that queued it saw it (to store its result)."""
    controls = CacheControls(namespace=ticket.namespace, ttl=None if ticket.archive else ticket.ttl)
    return Probe(
        ticket.data, ticket.params, digest_image(ticket.data), keys.task(ticket.params),
        controls, key=ticket.key, decode=decode,
    )  # fmt: skip


def _answer(
    chain: Chain, feeders: Feeders, ticket: Ticket, probe: Probe, answer: OcrResult | Exception
) -> None:
    """A computed ticket's result stored in every tier and its requesters told, or told
    that it failed."""
    if isinstance(answer, EngineBusy):
        feeders.fail(ticket, f"busy:{answer.retry_after}:{answer}")
    elif isinstance(answer, EngineTimeout):
        feeders.fail(ticket, f"timeout:{answer}")
    elif isinstance(answer, EngineError):  # the engine's own failure: another may succeed
        feeders.retry(ticket, f"error:{answer}")
    elif isinstance(answer, Exception):
        feeders.fail(ticket, f"error:{answer}")
    else:
        metrics.DISPATCH_TICKETS.labels(outcome="computed").inc()
        with tracing.TRACER.span("cache.write", {"ocr.ttl": ticket.ttl}) as span:
            stored = chain.record(probe, answer, ticket.ttl)
            span.set("ocr.stored", stored)
        if stored:
            log.debug("dispatch: ticket %s computed and stored", ticket.id)
            feeders.succeeded(ticket)
        else:  # the requesters compute for themselves rather than wait in vain
            feeders.fail(ticket, "lost")
        return
    tracing.TRACER.current().set("ocr.ticket.failed", answer.__class__.__name__)
    metrics.DISPATCH_TICKETS.labels(outcome="failed").inc()


def _ticket_spans(tickets: Sequence[Ticket], interjected: bool) -> dict[str, tracing.Span]:
    """Each ticket's ``engine.ticket`` span, continuing the trace it carries (by ticket id)."""
    return {
        ticket.id: tracing.TRACER.remote(
            "engine.ticket",
            ticket.carrier(),
            {
                "ocr.ticket": ticket.id,
                "ocr.queue.lane": ticket.lane,
                "ocr.ticket.deliveries": ticket.deliveries,
                "ocr.interjected": interjected,
            },
        )  # fmt: skip
        for ticket in tickets
    }
