"""A request that stops waiting for the engine (``EngineTimeout``) or a full queue
(``EngineBusy``) is load, not a broken engine (issue 25): neither marks the engine failing
(``Computer.failing``, which pauses the feeders ``UNHEALTHY_PAUSE_SECONDS`` between tickets), nor
reaches ``on_engine_outcome`` (/readyz), on any path: a call made here (``compute``), a ticket
of the global queue (``serve``), a batch (``_many``). Nor is such a call retried: a timed-out
batch is still running in the engine and its requesters' time is gone, so re-running its
images one by one would only queue engine work for nobody. Engine doubles held and released
by events; the served stack under the same burst: tests/test_served_overload.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis
from prometheus_client import REGISTRY

from app.cache import assembly
from app.cache.breaker import CircuitBreaker
from app.cache.keys import digest_image
from app.cache.region import OcrCache
from app.cache.store import RedisStore
from app.config import Settings
from app.engine_calls.compute import _probe_of
from app.engine_calls.engine_runner import EngineRunner
from app.engine_side.feeders import UNHEALTHY_PAUSE_SECONDS
from app.engine_state import EngineState
from app.engines.base import OcrRequest
from app.imaging import decode_image
from app.queue.ticket import Ticket
from app.vocabulary import (
    CacheControls,
    EngineBusy,
    EngineError,
    EngineTimeout,
    OcrParams,
    OcrResult,
)
from tests.test_cache_unit import IMAGES, WAIT, CountingEngine, wait_for

pytestmark = pytest.mark.unit


class SerialEngine(CountingEngine):
    """One call at a time, like the in-process Paddle engine; also takes a list of images
    in one call (``ENGINE_BATCH_MAX``), held by the same events as a single call."""

    slots = 1
    batching = True

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def recognize_many(self, requests: list[OcrRequest]) -> list[OcrResult]:
        self.batches.append(len(requests))
        self.entered.set()
        assert self.release.wait(WAIT), "the test never released the engine"
        return [OcrResult(r.image.width, r.image.height, ()) for r in requests]


@dataclass
class Front:
    """One process's front door with what it tells readiness (``on_engine_outcome``)."""

    cache: OcrCache
    engine: SerialEngine
    state: EngineState
    outcomes: list[bool] = field(default_factory=list)

    @property
    def failing(self) -> bool:
        return bool(self.cache._computer.failing)


@pytest.fixture()
def ocr_timeout() -> float:
    """Long enough for a feeder on a loaded host to take the ticket before its requester stops
    waiting (a ticket taken after that is dropped unread: no engine call, no timeout to
    count)."""
    return 3.0


@pytest.fixture()
def front(
    base_settings: Settings, redis_client: redis.Redis, ocr_timeout: float
) -> Iterator[Front]:
    engine = SerialEngine()
    # One engine failure would make /readyz unready: a timeout counted as one would show.
    state = EngineState(engine, wait_seconds=5, unready_after=1)  # type: ignore[arg-type]
    state._ready.set()
    outcomes: list[bool] = []

    def record(ok: bool) -> None:
        outcomes.append(ok)
        state.record(ok)

    settings = base_settings.with_overrides(ocr_timeout_seconds=ocr_timeout)
    r = settings.redis
    store = RedisStore(r.url, r.timeout_ms, r.connect_timeout_ms,
                       CircuitBreaker(r.breaker_failures, r.breaker_cooldown_seconds))  # fmt: skip
    cache = assembly.for_settings(
        settings, engine, store,  # type: ignore[arg-type]
        lambda data: decode_image(data, settings.server.max_image_pixels),
        on_engine_outcome=record,
    )  # fmt: skip
    assert cache.dispatch_ready(WAIT), "the engine's feeder never reported in"
    yield Front(cache, engine, state, outcomes)
    engine.release.set()
    cache.close()


def calls(outcome: str) -> float:
    return REGISTRY.get_sample_value(
        "ocr_engine_calls_total", {"engine": "double", "outcome": outcome}
    ) or 0.0  # fmt: skip


def engine_idle(cache: OcrCache) -> bool:
    """This cache's engine (the process-wide gauges count other tests' engines too)."""
    runner = cache._computer.runner
    return runner.running == 0 and runner.waiting == 0


def assert_load_not_failure(front: Front) -> None:
    assert not front.failing, "a timeout marked the engine failing (the feeders would pause)"
    assert False not in front.outcomes, front.outcomes
    assert front.state.ready and front.state.status == "ready"


# ``here`` calls this process's engine at once (no feeder to wait for): a shorter timeout.
@pytest.mark.parametrize(
    ("where", "ocr_timeout"), [("here", 1.0), ("global queue", 3.0)], ids=["here", "global queue"]
)
def test_a_timeout_is_not_an_engine_failure_and_the_next_request_has_no_pause(front, where):
    """``here``: a ``no-store`` request computes with this process's engine
    (``Computer.compute``); ``global queue``: a feeder takes the ticket (``Computer.serve``).
    After the timed-out call ends, the next miss is computed at once: no feeder pause."""
    controls = CacheControls(no_store=where == "here")
    before = calls("timeout")
    front.engine.hold()
    with pytest.raises(EngineTimeout):
        front.cache.get_or_compute(IMAGES[0], None, controls)
    assert front.engine.entered.is_set(), "the ticket was never taken before its deadline"
    wait_for(lambda: calls("timeout") == before + 1, "the timeout was not counted")
    assert_load_not_failure(front)
    front.engine.release.set()
    wait_for(lambda: engine_idle(front.cache), "the timed-out call never ended")
    started = time.monotonic()
    outcome = front.cache.get_or_compute(IMAGES[1], None, controls)
    assert outcome.result.lines and time.monotonic() - started < UNHEALTHY_PAUSE_SECONDS / 2
    assert_load_not_failure(front)


def test_the_engines_own_error_is_a_failure(front):
    """The contrast that makes the test above mean something: an engine error is recorded."""
    front.engine.fail = 1
    with pytest.raises(EngineError):
        front.cache.get_or_compute(IMAGES[2], None, CacheControls(no_store=True))
    assert front.failing and front.outcomes[-1] is False and not front.state.ready
    front.cache.get_or_compute(IMAGES[3], None, CacheControls(no_store=True))
    assert not front.failing and front.outcomes[-1] is True and front.state.ready


def _probes(front: Front, n: int) -> list:
    computer = front.cache._computer
    tickets = [_ticket(front, data, time.time() + 60) for data in IMAGES[:n]]
    return [_probe_of(computer._keys, computer._decode, ticket) for ticket in tickets]


def _ticket(front: Front, data: bytes, deadline: float) -> Ticket:
    key = front.cache.key_for(digest_image(data), OcrParams())
    return Ticket(key, digest_image(data).sha256, OcrParams(), "", 60, deadline, data, id="1-0")


def test_a_timed_out_batch_is_not_rerun_image_by_image(front, redis_client):
    """``_many``: the batch's deadline passes while the engine still runs it. Every image
    is answered with the timeout at once: the old fallback re-ran each image with the
    batch's whole (already spent) time, so the feeder waited (1 + n) timeouts, and an image
    re-queued behind the batch started once the batch ended, for nobody. The batch's
    results, once it ends, are stored for the retries (a single call's were; a batch's
    were dropped)."""
    computer, engine = front.cache._computer, front.engine
    probes = _probes(front, 4)
    engine.hold()
    answers: list = []
    started = time.monotonic()
    thread = threading.Thread(
        target=lambda: answers.extend(computer._many(probes, [time.time() + 1.0] * len(probes)))
    )
    thread.start()
    thread.join(1.5)  # the batch timed out at 1 s; the old fallback was still re-running
    engine.release.set()  # the batch ends: a re-run queued behind it would start now
    thread.join(WAIT)
    assert time.monotonic() - started < 3.0
    assert len(answers) == 4 and all(isinstance(a, EngineTimeout) for a in answers), answers
    wait_for(lambda: engine_idle(front.cache), "the batch never ended")
    assert engine.batches == [4] and engine.calls == 0  # no image ran again for nobody
    assert_load_not_failure(front)
    keys = [probe.key for probe in probes]
    wait_for(lambda: redis_client.exists(*keys) == len(keys), "the late results stored")


def test_a_refused_batch_is_load_and_not_retried(front):
    """A full queue refuses the batch (``EngineBusy``): each image gets that answer, counted
    as busy, and nothing is retried (the queue is as full for each image)."""
    computer = front.cache._computer
    probes = _probes(front, 3)
    full = EngineRunner(1, 0, 60.0)  # no call may wait: every one is refused
    computer.runner, kept = full, computer.runner
    before = calls("busy")
    try:
        answers = computer._many(probes, [time.time() + 60] * len(probes))
    finally:
        computer.runner = kept
    assert all(isinstance(a, EngineBusy) for a in answers), answers
    assert calls("busy") == before + 3 and front.engine.batches == [] and front.engine.calls == 0
    assert_load_not_failure(front)


class Told:
    """What ``Computer.serve`` tells a ticket's requesters (``Feeders.fail``/``succeeded``)."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.stored: list[str] = []

    def fail(self, ticket: Ticket, marker: str) -> None:
        self.failed.append(marker)

    def succeeded(self, ticket: Ticket) -> None:
        self.stored.append(ticket.id)


def test_a_ticket_whose_time_is_gone_is_not_computed(front):
    """``serve`` with a ticket whose requester's deadline passed (between the feeder's check and
    the engine): answered as a timeout without an engine call (the engine used to get
    0.001 s of bound, long enough to start the call for nobody)."""
    told = Told()
    front.cache._computer.serve(told, [_ticket(front, IMAGES[0], time.time() - 0.01)])
    assert told.stored == [] and len(told.failed) == 1, told.failed
    assert told.failed[0].startswith("timeout:"), told.failed
    time.sleep(0.2)  # a call that slipped through would have started by now
    assert front.engine.calls == 0 and front.engine.batches == []
    assert_load_not_failure(front)


def test_the_runner_starts_nothing_for_a_caller_without_time():
    ran: list[int] = []
    runner = EngineRunner(1, 4, 60.0)
    for left in (0.0, -1.0):
        with pytest.raises(EngineTimeout):
            runner.run(ran.append, 1, timeout=left)
    assert ran == [] and runner.waiting == 0
    assert runner.run(lambda: "done", timeout=5) == "done"


def test_a_running_call_is_a_gauge_until_it_ends():
    """``ocr_engine_calls_running``: 1 while a call runs, even after its caller timed out."""
    gate = threading.Event()
    runner = EngineRunner(1, 4, 60.0)

    def running() -> float:
        return REGISTRY.get_sample_value("ocr_engine_calls_running") or 0.0

    base = running()
    with pytest.raises(EngineTimeout):
        runner.run(gate.wait, WAIT, timeout=0.2)
    assert running() == base + 1  # the caller left; the call still runs
    gate.set()
    wait_for(lambda: running() == base, "the running gauge never came down")
