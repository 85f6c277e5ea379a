"""The ticket: one queued miss, what an engine anywhere needs to compute it and store it under
its key, and its wire format (a Redis stream entry: plain strings and JSON, nothing is
unpickled).

**Format.** Each ticket names its wire format in the field ``fmt``, written by the front
that submits it (``FORMAT``); a ticket without the field is format 1 (the layout before the
field existed). An engine reads only the formats it knows (``READS``): any other ticket is
failed with a clear error marker instead of being misread, so two adjacent releases of
fronts and engines share one queue during a rolling update. Whatever the format, a ticket
keeps its envelope as it is (``key``, ``sha256``, ``deadline``): what an engine needs to
fail a ticket it cannot read.

Format 2 (what fronts write): ``fmt`` (``2``), ``key`` (the entry key), ``sha256`` (of the
image bytes), ``params`` (JSON of ``OcrParams``), ``ns`` (the tenant namespace), ``ttl``
(seconds), ``deadline`` (wall clock), ``archive`` (``1``: it may go to the cold tier). The
image bytes are not in the ticket: the front writes them to their own key
(``QueueKeys.image``, as long-lived as the ticket's marker) in the same round trip as the
submission, and the engine reads them with the markers (``claims.py``). A value that passes
through a Lua script costs the queue's master far more than the same value in a plain
``SET``/``MGET`` (~35 µs a 20 KB image each way on the development machine: ``make
bench-queue``), and the submission and the take are scripts. An image gone (evicted) when
its ticket is taken: the ticket is dropped and its waiters hear ``gone`` (they submit again).

Format 1 (fronts of earlier releases; still read): the same fields and ``data`` (the image
bytes) in the ticket.

**Optional fields** (written only when there is something to say; an engine that does not
know one ignores it, and an engine reads a ticket without it, so adding one keeps the
format): ``traceparent`` and ``tracestate``, the W3C trace context of the request that
queued it (``app.tracing``), which the engine's span continues.

**Failure markers** (``kind:detail``), how an engine tells a ticket's requesters that it
failed (``failure`` turns one into the requester's exception): ``error``, ``timeout``,
``busy:<seconds>``, ``bug``; ``lost`` (no entry could be stored: they compute for
themselves).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from app.vocabulary import (
    EngineBusy,
    EngineError,
    EngineTimeout,
    OcrCacheError,
    OcrParams,
)

log = logging.getLogger(__name__)

FORMAT = "2"  # what a front writes
READS = frozenset({"1", "2"})  # what an engine reads
GROUP = "engines"  # the consumer group of every lane's stream
INTERJECTOR = "-interject"  # an engine's interjector consumes as ``{engine}-interject``
# An error marker outlives any waiter that could still read it: each of a failed ticket's
# waiters finds it, whether or not the announcement on the done channel reached it first
# (each ticket's marker is its own: a later request of the image queues a new ticket).
ERROR_TTL_S = 60
BACKGROUND = "+jobs"  # the suffix of a lane of document jobs' pages (no tenant name has "+")
DEFAULT_LANE = "~"  # the default tenant's lane (not a tenant name), and every ticket's in FIFO
# A busy engine's interjector's longest wait for its doorbell (``interjection.py``); an
# engine counts as live within three of it at least (``TicketQueue.live_ms``).
BLOCK_MS = 1000
# An idle engine process's longest wait for the doorbell (one listener for all its slots:
# ``feeders.py``): what one idle process costs the queue, and how long a stop may wait on a
# Redis Cluster (a single node's blocked read is ended at once).
LISTEN_MS = 5000


class UnknownFormat(OcrCacheError, ValueError):
    """A ticket in a wire format this engine does not read."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self.fmt = fmt

    @property
    def marker(self) -> str:
        """What its requesters are told."""
        return (
            f"error:ticket format {self.fmt!r} is unknown to this engine (it reads "
            f"{', '.join(sorted(READS))}): queued by a newer front; retry once the engines "
            "run the same release"
        )


@dataclass(frozen=True)
class Ticket:
    """What an engine anywhere needs to compute one miss and store it under its key."""

    key: str
    sha256: str
    params: OcrParams
    namespace: str
    ttl: int
    deadline: float  # wall clock (time.time()): hosts' clocks are assumed roughly in sync
    data: bytes = field(repr=False)
    archive: bool = True  # may go to the cold tier (not when the caller chose its own TTL)
    id: str = ""
    deliveries: int = 1
    lane: str = DEFAULT_LANE  # the lane it was read from (the engines' side)
    trace: str = ""  # optional: the queuing request's W3C ``traceparent``
    tracestate: str = ""  # optional: its ``tracestate``
    # Format 2 read by an engine: ``data`` is still to be read from the image's own key.
    awaits_image: bool = False

    def fields(self) -> list[str | bytes]:
        """The stream entry's fields, in format ``FORMAT`` (optional ones only when set; the
        image goes to its own key)."""
        params = json.dumps(self.params.to_dict(), separators=(",", ":"))
        fields: list[str | bytes] = [
            "fmt", FORMAT, "key", self.key, "sha256", self.sha256, "params", params,
            "ns", self.namespace, "ttl", str(self.ttl), "deadline", repr(self.deadline),
            "archive", "1" if self.archive else "0",
        ]  # fmt: skip
        if self.trace:
            fields += ["traceparent", self.trace]
            if self.tracestate:
                fields += ["tracestate", self.tracestate]
        return fields

    def carrier(self) -> dict[str, str]:
        """Its W3C trace context ({} without one)."""
        if not self.trace:
            return {}
        if not self.tracestate:
            return {"traceparent": self.trace}
        return {"traceparent": self.trace, "tracestate": self.tracestate}

    @classmethod
    def from_fields(
        cls,
        ticket_id: str,
        raw: dict[bytes, bytes],
        deliveries: int = 1,
        lane: str = DEFAULT_LANE,
    ) -> Ticket:
        """A ticket read from its stream entry; ``UnknownFormat`` for a format not in
        ``READS``, ``KeyError``/``TypeError``/``ValueError`` for a malformed one."""
        text = {k.decode(): v for k, v in raw.items()}
        fmt = text.get("fmt", b"1").decode(errors="replace")
        if fmt not in READS:
            raise UnknownFormat(fmt)
        params = OcrParams.from_dict(json.loads(text["params"]))
        inline = fmt == "1"
        return cls(
            key=text["key"].decode(), sha256=text["sha256"].decode(),
            params=params, namespace=text["ns"].decode(), ttl=int(text["ttl"]),
            deadline=float(text["deadline"]), data=text["data"] if inline else b"",
            awaits_image=not inline, id=ticket_id,
            archive=text.get("archive", b"1") == b"1", deliveries=deliveries, lane=lane,
            trace=text.get("traceparent", b"").decode(errors="replace"),
            tracestate=text.get("tracestate", b"").decode(errors="replace"),
        )  # fmt: skip

    @classmethod
    def envelope(cls, ticket_id: str, raw: dict[bytes, bytes], lane: str) -> Ticket:
        """Only what every format keeps (key, SHA-256, deadline): enough to fail it."""
        text = {k.decode(): v for k, v in raw.items()}
        return cls(
            text["key"].decode(), text["sha256"].decode(), OcrParams(), "", 0,
            float(text["deadline"]), b"", id=ticket_id, lane=lane,
        )  # fmt: skip

    @classmethod
    def blank(cls, ticket_id: str, lane: str) -> Ticket:
        """A malformed entry, known by its id alone (to delete it)."""
        return cls("", "", OcrParams(), "", 0, 0.0, b"", id=ticket_id, lane=lane)


@dataclass(frozen=True)
class Decoded:
    """What an engine made of a stream entry: a ticket to compute (``ok``), one to fail with
    ``marker`` (an unknown format: ``ticket`` is its envelope), or a ``malformed`` entry to
    drop unread (``ticket`` knows only its id and lane)."""

    ticket: Ticket
    marker: str = ""
    malformed: bool = False

    @property
    def ok(self) -> bool:
        return not self.marker and not self.malformed


def decode(
    entry_id: bytes | str, raw: dict[bytes, bytes], deliveries: int = 1, lane: str = DEFAULT_LANE
) -> Decoded:
    """A stream entry as a ticket, or why it cannot be computed."""
    ticket_id = as_text(entry_id)
    try:
        return Decoded(Ticket.from_fields(ticket_id, raw, deliveries, lane))
    except UnknownFormat as exc:
        log.warning("failing dispatch ticket %s: format %r unknown here", ticket_id, exc.fmt)
        try:
            return Decoded(Ticket.envelope(ticket_id, raw, lane), exc.marker)
        except (KeyError, TypeError, ValueError):
            pass
    except (KeyError, TypeError, ValueError):
        pass
    log.warning("dropping a malformed dispatch ticket %s", ticket_id)
    return Decoded(Ticket.blank(ticket_id, lane), malformed=True)


def by_lane(tickets: Sequence[Ticket]) -> dict[str, list[Ticket]]:
    lanes: dict[str, list[Ticket]] = {}
    for ticket in tickets:
        lanes.setdefault(ticket.lane, []).append(ticket)
    return lanes


class TicketFailed(EngineError):
    """An engine failed on this ticket (raised in the requester)."""


class EngineCrashed(OcrCacheError):
    """An engine call ended in an unexpected exception (a bug, not an engine failure): the
    requester answers it as the last resort does (500, logged, counted)."""


def failure(marker: str) -> OcrCacheError:
    """The requester's exception for an engine's marker ``kind:detail``."""
    kind, _, detail = marker.partition(":")
    if kind == "bug":
        return EngineCrashed(f"unexpected error in the engine: {detail}")
    if kind == "timeout":
        return EngineTimeout(detail or "OCR timed out")
    if kind == "busy":
        seconds, _, message = detail.partition(":")
        return EngineBusy(message or "the engine queue is full", max(1, int(seconds or 1)))
    return TicketFailed(detail or "the engine failed")


def as_text(value: bytes | str) -> str:
    """A Redis reply (bytes, or str from a decoding client) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
