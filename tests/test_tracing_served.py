"""Traces of the served path (issue 40), through a real ``python -m app serve`` (nginx, the
front's granian workers, an engine process, the queue) exporting OTLP/HTTP to a receiver in
this test (``tests/otlp_receiver.py``, decoding with ``opentelemetry-proto``): a miss sent
with a ``traceparent`` comes back as spans of that trace from the front and the engine
process, the cache outcome on them; a hit's spans say hit; the JSON log lines of both
processes and the edge's access log carry the trace id. With ``OTEL_SDK_DISABLED=true`` (the
endpoint still set) nothing arrives. Off by default: tests/test_tracing.py."""

from __future__ import annotations

import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import CORPUS
from tests.fleet import wait_for
from tests.otlp_receiver import Receiver, Span
from tests.test_roles import serve

pytestmark = [pytest.mark.deploy, pytest.mark.slow]

IMAGE = CORPUS / "paddleocr_word_en_1.png"
JOINED = CORPUS / "sroie_000.jpg"
WAIT = 60.0  # the longest a batch of spans may take to arrive (they come in 0.2 s batches)


@pytest.fixture()
def receiver():
    receiving = Receiver()
    yield receiving
    receiving.close()


def traceparent() -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"


def spans_of(receiver: Receiver, trace_id: str, *names: str) -> dict[str, Span]:
    """The trace's spans by name, once every one of ``names`` arrived."""
    deadline = time.monotonic() + WAIT
    while True:
        found = {span.name: span for span in receiver.trace(trace_id)}
        if set(names) <= set(found):
            return found
        assert time.monotonic() < deadline, f"spans of {trace_id}: {sorted(found)}"
        time.sleep(0.1)


def _waiting(fleet) -> int:  # type: ignore[no-untyped-def]
    """Misses queued or running, as the front reads the queue."""
    return int(requests.get(f"{fleet.base}/readyz", timeout=10).json()["queue"]["misses_waiting"])


def computing_trace(receiver: Receiver, trace_ids: list[str]) -> str:
    """The one of ``trace_ids`` whose ticket the engine computed and stored (``cache.write``),
    once its spans and every request's server span arrived."""
    deadline = time.monotonic() + WAIT
    while True:
        traces = {t: {span.name for span in receiver.trace(t)} for t in trace_ids}
        computing = [t for t, names in traces.items() if "cache.write" in names]
        if computing and all("POST /v1/ocr" in names for names in traces.values()):
            assert len(computing) == 1, traces
            time.sleep(0.5)  # the joiners' spans end with their answers: already sent
            return computing[0]
        assert time.monotonic() < deadline, traces
        time.sleep(0.1)


def test_a_miss_and_a_hit_are_traced_across_the_front_and_the_engine(receiver, tmp_path):
    image = IMAGE  # a miss first: serve's Redis is its own
    with serve(
        tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="200",
        OTEL_TRACES_SAMPLER="always_on", LOG_FORMAT="json", LOG_LEVEL="debug",
    ) as fleet:  # fmt: skip
        miss_id, miss_parent = traceparent()
        answer = fleet.ocr(image, traceparent=miss_parent, tracestate="vendor=1")
        assert answer.status_code == 200 and answer.headers["X-Cache"] == "MISS"
        assert answer.headers["traceresponse"].split("-")[1] == miss_id
        hit_id, hit_parent = traceparent()
        again = fleet.ocr(image, traceparent=hit_parent)
        assert again.status_code == 200 and again.headers["X-Cache"] == "HIT"

        names = ("POST /v1/ocr", "cache.lookup", "queue.wait", "engine.ticket",
                 "engine.recognize", "ocr.detection", "ocr.recognition",
                 "cache.write")  # fmt: skip
        miss = spans_of(receiver, miss_id, *names)
        hit = spans_of(receiver, hit_id, "POST /v1/ocr")

        # Four requests for one new image: one computes, the others join it (in their
        # worker's single flight, or on its queued ticket from the other worker). The three
        # are sent once the first is in the queue (a receipt: seconds of engine time): sent
        # all at once, on a loaded machine the first ended before the others came (all hits).
        together = [traceparent() for _ in range(4)]
        with ThreadPoolExecutor(len(together)) as pool:
            first = pool.submit(fleet.ocr, JOINED, traceparent=together[0][1])
            wait_for(lambda: _waiting(fleet) >= 1 or first.done(), 60, "the first miss queued")
            rest = [pool.submit(fleet.ocr, JOINED, traceparent=t[1]) for t in together[1:]]
            answers = [first.result(), *(future.result() for future in rest)]
        assert [a.status_code for a in answers] == [200] * 4, "".join(fleet.output)[-4000:]
        joined = {t: a.headers["X-Cache"] for (t, _), a in zip(together, answers, strict=True)}
        computing = computing_trace(receiver, list(joined))
        output = "".join(fleet.output)

    # One trace across processes: the client's span → the front (from when the edge received
    # the request) → the lookup → the queue's wait → the engine process's ticket → its engine
    # call and write-back.
    server_span = miss["POST /v1/ocr"]
    assert server_span.parent_id == miss_parent.split("-")[2]
    edge = server_span.attributes
    assert edge["edge.read_seconds"] >= 0 and edge["edge.queued_seconds"] >= 0
    assert server_span.start_ns <= miss["cache.lookup"].start_ns
    assert miss["cache.lookup"].parent_id == miss["POST /v1/ocr"].span_id
    assert miss["queue.wait"].parent_id == miss["cache.lookup"].span_id
    assert miss["engine.ticket"].parent_id == miss["queue.wait"].span_id
    assert miss["engine.recognize"].parent_id == miss["engine.ticket"].span_id
    assert miss["cache.write"].parent_id == miss["engine.ticket"].span_id
    # The engine call's steps, children of its span in the engine process.
    # (textline orientation too, when the request asks for it: not here)
    for step in ("ocr.detection", "ocr.recognition"):
        assert miss[step].parent_id == miss["engine.recognize"].span_id, step
        assert miss[step].resource["ocr.role"] == "engine"
        assert miss["engine.recognize"].start_ns <= miss[step].start_ns
    assert miss["ocr.detection"].end_ns <= miss["ocr.recognition"].start_ns
    roles = {name: span.resource["ocr.role"] for name, span in miss.items()}
    assert roles["POST /v1/ocr"] == roles["queue.wait"] == "front"
    assert roles["engine.ticket"] == roles["cache.write"] == "engine"
    front, engine = miss["queue.wait"].resource, miss["engine.ticket"].resource
    assert front["service.name"] == engine["service.name"] == "ocr-cache"
    assert front["service.instance.id"] != engine["service.instance.id"]
    # The cache's outcome, the request's and the queue's attributes.
    assert miss["cache.lookup"].attributes["ocr.cache"] == "miss"
    server = miss["POST /v1/ocr"].attributes
    assert server["ocr.cache"] == "miss" and server["http.response.status_code"] == 200
    assert server["ocr.protocol"] == "rest" and server["ocr.request_id"]
    assert miss["queue.wait"].attributes["ocr.queue.lane"] == "~"
    assert miss["queue.wait"].attributes["ocr.queue.waited_seconds"] > 0
    assert miss["queue.wait"].attributes["ocr.queue.position"] >= 1  # its place when queued
    assert miss["cache.write"].attributes["ocr.stored"] is True
    # A hit is its server span alone (a span costs a hit about its own work): it says hit.
    assert hit["POST /v1/ocr"].attributes["ocr.cache"] == "hit"
    assert hit["POST /v1/ocr"].attributes["ocr.cache_tier"] in ("l1", "l2")
    assert hit["POST /v1/ocr"].attributes["ocr.images"] == 1
    assert {span.name for span in receiver.trace(hit_id)} == {"POST /v1/ocr"}

    # Single flight: the one trace that computed, and every other linked to it.
    # A request coalesced in its worker links to its worker's leader, which (if it joined the
    # other worker's ticket) links on to the computing trace: each reaches it through links.
    def linked(trace_id: str) -> set[str]:
        return {link[0] for span in receiver.trace(trace_id) for link in span.links}

    checked = 0
    for trace_id, outcome in joined.items():
        own_ticket = any(span.name == "engine.ticket" for span in receiver.trace(trace_id))
        if trace_id == computing or outcome == "HIT" or own_ticket:  # it joined nothing
            continue
        reached = linked(trace_id) | {far for near in linked(trace_id) for far in linked(near)}
        assert computing in reached, (trace_id, outcome, [s.name for s in receiver.trace(trace_id)])
        checked += 1
    assert checked >= 1, joined  # four at once: some joined the computing one

    # Logs: the JSON lines of the front and of the engine during the miss carry its ids; the
    # edge's access log names both traces.
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    ours = [line for line in lines if line.get("trace_id") == miss_id and "logger" in line]
    assert any("queued on lane" in line.get("message", "") for line in ours)
    assert any("computed and stored" in line.get("message", "") for line in ours)
    assert all(line["span_id"] for line in ours)
    assert any(line.get("logger") == "_granian" for line in lines)  # the server's own too
    assert not any(line.startswith("[INFO]") for line in output.splitlines())  # granian's text
    access = [line for line in lines if "request_bytes" in line]
    assert {miss_id, hit_id} <= {line.get("trace_id") for line in access}


def test_nothing_is_exported_with_the_sdk_disabled(receiver, tmp_path):
    image = IMAGE
    with serve(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
               OTEL_SDK_DISABLED="true", OTEL_BSP_SCHEDULE_DELAY="100") as fleet:  # fmt: skip
        _, parent = traceparent()
        for _ in range(2):
            answer = fleet.ocr(image, traceparent=parent)
            assert answer.status_code == 200 and "traceresponse" not in answer.headers
    # serve has stopped: every process flushed at exit what it had, if it had anything.
    assert receiver.requests == 0 and receiver.spans == []
