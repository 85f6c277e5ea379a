"""The engine's one thread and its interjected calls (``app/engines/engine_thread.py``), and
what the engine runner charges a call that was paused for one (``EngineRunner``)."""

from __future__ import annotations

import threading
import time

import pytest

from app.engine_calls.engine_runner import EngineRunner
from app.engines.engine_thread import EngineThread
from app.vocabulary import EngineTimeout

pytestmark = pytest.mark.unit

WAIT = 10.0


def test_calls_run_in_order_on_one_thread() -> None:
    engine = EngineThread("test-engine")
    names: list[str] = []
    futures = [engine.submit(lambda: names.append(threading.current_thread().name)) for _ in "abc"]
    for future in futures:
        future.result(WAIT)
    assert names == ["test-engine"] * 3
    assert not engine.on_thread() and engine.submit(engine.on_thread).result(WAIT)


def test_an_interjected_call_runs_at_the_next_yield_point_and_the_call_resumes() -> None:
    """The long call stops at its yield point, the interjected one runs there on the same
    thread, and the long call goes on from where it was."""
    engine = EngineThread("test-engine")
    events: list[str] = []
    at_step = threading.Event()
    go_on = threading.Event()

    def long_call() -> str:
        events.append("long: step 1")
        at_step.set()
        assert go_on.wait(WAIT)
        engine.yield_point()
        events.append("long: step 2")
        return "long"

    long = engine.submit(long_call)
    assert at_step.wait(WAIT)
    short = engine.interject(lambda: events.append("short") or "short")
    go_on.set()
    assert (long.result(WAIT), short.result(WAIT)) == ("long", "short")
    assert events == ["long: step 1", "short", "long: step 2"]


def test_an_interjected_call_is_not_interjected_into() -> None:
    """Two urgent calls: the second waits for the first to end (it does not run at the
    first's yield point), then both ran before the paused call resumed."""
    engine = EngineThread("test-engine")
    events: list[str] = []
    second: list = []

    def first_urgent() -> None:
        second.append(engine.interject(lambda: events.append("second")))
        events.append("first: before its yield point")
        engine.yield_point()
        events.append("first: after it")

    def long_call() -> None:
        engine.interject(first_urgent)
        engine.yield_point()
        events.append("long: resumed")

    engine.submit(long_call).result(WAIT)
    second[0].result(WAIT)
    assert events == ["first: before its yield point", "first: after it", "second", "long: resumed"]


def test_an_interjected_call_on_an_idle_engine_runs_at_once_and_before_queued_calls() -> None:
    engine = EngineThread("test-engine")
    events: list[str] = []
    hold, holding = threading.Event(), threading.Event()
    engine.submit(lambda: holding.set() or hold.wait(WAIT))
    assert holding.wait(WAIT)
    queued = engine.submit(lambda: events.append("queued"))
    urgent = engine.interject(lambda: events.append("urgent"))
    hold.set()
    queued.result(WAIT), urgent.result(WAIT)
    assert events == ["urgent", "queued"]
    assert engine.interject(lambda: "at once").result(WAIT) == "at once"


def test_a_call_cancelled_before_it_started_never_runs() -> None:
    engine = EngineThread("test-engine")
    hold, holding, ran = threading.Event(), threading.Event(), []
    engine.submit(lambda: holding.set() or hold.wait(WAIT))
    assert holding.wait(WAIT)
    cancelled = engine.interject(lambda: ran.append("urgent"))
    assert cancelled.cancel()
    hold.set()
    engine.submit(lambda: None).result(WAIT)
    assert ran == []


def test_an_error_reaches_its_caller_and_the_thread_goes_on() -> None:
    engine = EngineThread("test-engine")
    with pytest.raises(ZeroDivisionError):
        engine.submit(lambda: 1 / 0).result(WAIT)
    assert engine.submit(lambda: "next").result(WAIT) == "next"


def test_the_paused_call_is_not_charged_for_the_interjected_work() -> None:
    """Engine seconds (the round robin's correction, quotas, metrics): the paused call is
    charged its wall time less the interjected work's (which has its own engine call's),
    and an engine call made inside the interjected work runs inline on the engine's thread."""
    engine = EngineThread("test-engine")
    queued = threading.Event()

    def interject(call):  # type: ignore[no-untyped-def]
        future = engine.interject(call)
        queued.set()  # the long call reaches its yield point only once the work waits
        return future

    runner = EngineRunner(1, 4, WAIT, interject=interject)
    outer: list[float] = []
    inner: list[float] = []
    started = threading.Event()

    def long_step() -> str:
        started.set()
        time.sleep(0.1)
        assert queued.wait(WAIT)
        engine.yield_point()
        time.sleep(0.1)
        return "long"

    def work() -> tuple[str, bool]:
        time.sleep(0.2)  # the ticket's own reading and storing
        return runner.run(lambda: time.sleep(0.3) or "short", elapsed=inner), engine.on_thread()

    result: list[str] = []
    began = time.perf_counter()
    caller = threading.Thread(
        target=lambda: result.append(
            runner.run(lambda: engine.submit(long_step).result(WAIT), elapsed=outer)
        )
    )
    caller.start()
    assert started.wait(WAIT)
    assert runner.interjected(work, WAIT) == ("short", True)
    caller.join(WAIT)
    wall = time.perf_counter() - began
    assert result == ["long"]
    assert inner[0] >= 0.3 and outer[0] >= 0.2
    assert outer[0] <= wall - 0.5  # neither the work nor its engine call is the long one's


def test_without_an_engine_that_interjects_the_work_runs_on_the_callers_thread() -> None:
    runner = EngineRunner(1, 4, WAIT)
    assert runner.interjected(lambda: threading.current_thread().name, WAIT) == (
        threading.current_thread().name
    )


def test_interjected_work_that_never_started_times_out_and_never_runs() -> None:
    engine = EngineThread("test-engine")
    runner = EngineRunner(1, 4, WAIT, interject=engine.interject)
    hold, holding, ran = threading.Event(), threading.Event(), []
    engine.submit(lambda: holding.set() or hold.wait(WAIT))
    assert holding.wait(WAIT)
    with pytest.raises(EngineTimeout):
        runner.interjected(lambda: ran.append(1), 0.05)
    hold.set()
    engine.submit(lambda: None).result(WAIT)
    assert ran == []


def test_a_call_is_charged_only_what_overlaps_the_work_before_it() -> None:
    """Interjected work that began on an idle engine before a call was made: the call
    waits for it to end and is charged its own time only, never less than nothing."""
    engine = EngineThread("test-engine")
    runner = EngineRunner(1, 4, WAIT, interject=engine.interject)
    working, called = threading.Event(), threading.Event()

    def work() -> None:
        working.set()
        time.sleep(0.2)  # half of the work, before the call is made
        assert called.wait(WAIT)
        time.sleep(0.2)  # the other half, which the call waits for (however late it came)

    def call() -> None:
        waiting = engine.submit(lambda: time.sleep(0.1))  # behind the work on the engine
        called.set()
        waiting.result(WAIT)

    worker = threading.Thread(target=lambda: runner.interjected(work, WAIT))
    worker.start()
    assert working.wait(WAIT)
    time.sleep(0.2)  # half of the work is done before the call is made
    spent: list[float] = []
    began = time.perf_counter()
    runner.run(call, elapsed=spent)
    wall = time.perf_counter() - began
    worker.join(WAIT)
    assert 0.1 <= spent[0] <= wall - 0.15  # its own 0.1 s, not the rest of the work's
