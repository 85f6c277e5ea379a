"""A ticket names its wire format (``fmt``), so two adjacent releases of fronts and engines
share one queue during a rolling update: fronts write format 2 (the image in its own key);
a ticket without the field is format 1 (the layout before it existed, the image inside) and
is computed, as is one that says ``1``; a ticket in a format this engine does not read is
failed with a clear error marker, never misread; a format 2 ticket whose image was evicted is
dropped and its waiter submits again. Against a real embedded Redis, with the counting
engine doubles of the unit layer."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest
import redis
from prometheus_client import REGISTRY

from app.cache.keys import QueueKeys, digest_image
from app.config import Settings
from app.queue.ticket import FORMAT, READS, Ticket, TicketFailed, UnknownFormat, decode
from app.vocabulary import CacheStatus, OcrParams, OcrResult
from tests.helpers import stand_in_engine
from tests.test_cache_unit import IMAGES, WAIT, CountingEngine, make_cache

pytestmark = pytest.mark.unit


class SerialEngine(CountingEngine):
    slots = 1  # one feeder


@pytest.fixture()
def settings(base_settings: Settings, redis_client: redis.Redis) -> Settings:
    return base_settings


def a_ticket(data: bytes = b"image", **changes: Any) -> Ticket:
    return Ticket("ocr:v1:fp:task:{md5}", digest_image(data).sha256, OcrParams(), "acme", 60,
                  time.time() + 60, data, archive=False, **changes)  # fmt: skip


def format_1(ticket: Ticket) -> list[str | bytes]:
    """What a front of the release before the ``fmt`` field wrote: the image inside."""
    return [*ticket.fields()[2:], "data", ticket.data]


def raw(fields: list[str | bytes]) -> dict[bytes, bytes]:
    """The fields as a stream entry reads back (bytes both sides)."""
    as_bytes = [f.encode() if isinstance(f, str) else f for f in fields]
    return dict(zip(as_bytes[::2], as_bytes[1::2], strict=True))


def failed() -> float:
    return REGISTRY.get_sample_value("ocr_dispatch_tickets_total", {"outcome": "failed"}) or 0.0


def test_a_front_writes_its_format_and_an_engine_reads_it_back() -> None:
    ticket = a_ticket()
    fields = ticket.fields()
    assert fields[:2] == ["fmt", FORMAT] and FORMAT in READS
    assert "data" not in fields and ticket.data not in fields  # its image goes to its own key
    back = Ticket.from_fields("1-0", raw(fields), deliveries=2, lane="acme")
    assert back == replace(ticket, id="1-0", deliveries=2, lane="acme", data=b"",
                           awaits_image=True)  # fmt: skip


def test_a_ticket_without_the_field_is_format_1() -> None:
    """What fronts of the release before the field wrote: read as it always was."""
    fields = format_1(a_ticket())
    assert "fmt" not in fields
    decoded = decode("1-0", raw(fields), lane="acme")
    assert decoded.ok and decoded.ticket.key == a_ticket().key
    assert decoded.ticket.data == b"image" and not decoded.ticket.awaits_image
    said = decode("1-0", raw(["fmt", "1", *fields]), lane="acme")
    assert said.ok and said.ticket == decoded.ticket


def test_a_ticket_of_an_unknown_format_is_not_misread() -> None:
    fields = ["fmt", "3", *a_ticket().fields()[2:]]
    with pytest.raises(UnknownFormat):
        Ticket.from_fields("1-0", raw(fields))
    decoded = decode("1-0", raw(fields), lane="acme")
    assert not decoded.ok and not decoded.malformed
    assert decoded.ticket.key == a_ticket().key and decoded.ticket.id == "1-0"
    assert decoded.marker.startswith("error:ticket format '3' is unknown to this engine")
    # Without even its envelope (key, SHA-256, deadline): malformed, dropped unread.
    gone = decode("2-0", raw(["fmt", "3", "key", "k"]), lane="acme")
    assert gone.malformed and gone.ticket.id == "2-0"


def plant(client: Any, names: QueueKeys, fields: list[str | bytes]) -> str:
    """A ticket written straight into the default lane, as another release's front would:
    the lane in the round robin's ring, the idle engines' doorbell rung."""
    try:
        client.xgroup_create(names.stream("~"), "engines", id="0", mkstream=True)
    except redis.ResponseError:  # BUSYGROUP: it exists
        pass
    entry = client.xadd(names.stream("~"), raw(fields))
    client.sadd(names.lanes, "~")
    if client.lpos(names.ring, "~") is None:
        client.lpush(names.ring, "~")
    client.lpush(names.bell, "1")
    return entry.decode()


def test_an_engine_computes_a_queued_ticket_without_the_field(settings, redis_client) -> None:
    engine = SerialEngine()
    cache = make_cache(settings, engine)
    names = cache.keys.dispatch()
    key = cache.key_for(digest_image(IMAGES[0]), OcrParams())
    old = Ticket(key, digest_image(IMAGES[0]).sha256, OcrParams(), "", 60, time.time() + 60,
                 IMAGES[0])  # fmt: skip
    plant(redis_client, names, format_1(old))
    deadline = time.monotonic() + WAIT
    while redis_client.xlen(names.stream("~")) or not redis_client.exists(key):
        assert time.monotonic() < deadline, "the ticket was not computed"
        time.sleep(0.01)
    assert engine.calls == 1
    assert cache.get_or_compute(IMAGES[0]).status is CacheStatus.HIT


def test_an_engine_fails_a_ticket_of_a_newer_format_and_its_waiter_hears_why(
    settings, redis_client
) -> None:
    """A newer front queued a ticket this engine cannot read: its waiters get the error at
    once (not at their deadline), the engine never sees it, and it leaves the queue."""
    front = make_cache(settings, SerialEngine())
    front.close()  # its own feeders take nothing: the engine below does
    queue = front._misses._queue
    assert queue is not None
    names = queue.names
    stand_in_engine(redis_client, names.engines)
    key = front.key_for(digest_image(IMAGES[0]), OcrParams())
    newer = Ticket(key, digest_image(IMAGES[0]).sha256, OcrParams(), "", 60, time.time() + 60,
                   IMAGES[0])  # fmt: skip
    entry = plant(redis_client, names, ["fmt", "3", *newer.fields()[2:], "more", "fields"])
    redis_client.set(queue.marker(newer), entry, px=60_000)  # as submitting leaves it
    joined = threading.Event()

    def read(ticket_id: str) -> tuple[bool, OcrResult | None, str | None]:
        joined.set()
        error = redis_client.get(front.keys.ticket_error(key, ticket_id))
        return True, None, error.decode() if error else None

    before = failed()
    engine = SerialEngine()
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(queue.request, newer, read, WAIT)
        assert joined.wait(WAIT)  # a waiter on the newer front's ticket
        make_cache(settings, engine)  # an engine of this release starts
        with pytest.raises(TicketFailed, match="ticket format '3' is unknown to this engine"):
            asked.result(WAIT)
    assert engine.calls == 0
    assert failed() == before + 1
    deadline = time.monotonic() + WAIT
    while redis_client.xlen(names.stream("~")):
        assert time.monotonic() < deadline, "the unreadable ticket stayed in the queue"
        time.sleep(0.01)
    assert not redis_client.exists(queue.marker(newer))  # its key is free for a new ticket


def test_a_ticket_whose_image_was_evicted_is_submitted_again(settings, redis_client) -> None:
    """The LRU took a queued ticket's image (format 2: its own key): the engine that takes
    the ticket drops it unrun, its waiter hears ``gone`` and submits again (its image
    written anew), and the second ticket is computed: one engine call, no error."""
    front = make_cache(settings, SerialEngine())
    front.close()  # its own feeders take nothing: the engine below does
    queue = front._misses._queue
    assert queue is not None
    stand_in_engine(redis_client, queue.names.engines)
    key = front.key_for(digest_image(IMAGES[0]), OcrParams())
    ticket = Ticket(key, digest_image(IMAGES[0]).sha256, OcrParams(), "", 60, time.time() + 60,
                    IMAGES[0])  # fmt: skip

    def read(ticket_id: str) -> tuple[bool, OcrResult | None, str | None]:
        return True, OcrResult(1, 1) if redis_client.exists(key) else None, None

    def image_gone() -> float:
        sample = {"outcome": "image_gone"}
        return REGISTRY.get_sample_value("ocr_dispatch_tickets_total", sample) or 0.0

    before = image_gone()
    engine = SerialEngine()
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(queue.request, ticket, read, WAIT)
        deadline = time.monotonic() + WAIT
        while not redis_client.exists(queue.marker(ticket)):
            assert time.monotonic() < deadline, "the ticket was not queued"
            time.sleep(0.01)
        first = redis_client.get(queue.marker(ticket))
        assert redis_client.get(queue.image(ticket)) == IMAGES[0]
        (_, fields), = redis_client.xrange(queue.stream(ticket))  # fmt: skip
        assert fields[b"fmt"] == b"2" and IMAGES[0] not in fields.values()
        redis_client.delete(queue.image(ticket))  # evicted
        make_cache(settings, engine)  # an engine starts and takes it
        result, joined = asked.result(WAIT)
    assert result is not None and not joined
    assert engine.calls == 1 and image_gone() == before + 1
    assert redis_client.get(queue.marker(ticket)) != first  # a second ticket computed it
    assert redis_client.exists(key)
