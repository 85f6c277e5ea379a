"""The engine queue is bounded and work whose caller has gone is dropped (real engine).

Six pages at once with a short OCR_TIMEOUT_SECONDS used to leave five queued on the engine
after their callers got 504: the engine ran for nobody and the next request timed out too.
"""

from __future__ import annotations

import base64
import threading
import time
from dataclasses import replace

import grpc
import pytest
from prometheus_client import REGISTRY, generate_latest

from app import grpc_server
from app.cache.keys import digest_image
from app.engine_calls.engine_runner import EngineBusy
from app.vocabulary import EngineTimeout
from tests.conftest import CORPUS, PHOTOTEST, SHORT, WORD_CH, WORD_EN
from tests.fleet import wait_for
from tests.helpers import metric_sum

pytestmark = pytest.mark.integration

BIG = (CORPUS / "paddleocr_en_img_12.png").read_bytes()  # 1680 x 1048, detected at 2400+


def _metrics() -> str:
    return generate_latest(REGISTRY).decode()


def _big_calls(
    cache, n: int, images: list[bytes] | None = None, first: int = 2400, gap: float = 0.05
) -> tuple[list[threading.Thread], list[object]]:
    """``n`` distinct slow computations at once (distinct keys: nothing coalesces, and a
    test's ``first`` detection size apart from another's: an orphan's entry is stored), or
    one of each of ``images`` as they are; ``gap`` seconds apart (in order)."""
    params = cache.engine.default_params
    outcomes: list[object] = [None] * n

    def call(i: int) -> None:
        try:
            if images is not None:
                outcomes[i] = cache.get_or_compute(images[i]).status
                return
            outcomes[i] = cache.get_or_compute(
                BIG, replace(params, det_limit_type="min", det_limit_side_len=first + 32 * i)
            ).status
        except Exception as exc:  # the outcome under test
            outcomes[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(gap)  # in order: the first one runs, the others queue behind it
    return threads, outcomes


class HeldEngine:
    """The real engine, whose calls wait until ``release`` is set: the queue stays full for
    as long as a test looks at it, whatever the machine's speed."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.kind = engine.kind
        self.release = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def recognize(self, request):
        self.release.wait(120)
        return self._engine.recognize(request)


def _wait_depth(value: float, timeout: float, gauge: str = "ocr_engine_queue_depth") -> None:
    wait_for(lambda: metric_sum(_metrics(), gauge) == value, timeout, f"{gauge} {value:g}",
             _metrics)  # fmt: skip


def test_timed_out_calls_are_dropped_and_the_next_request_is_served(make_app):
    app = make_app(ocr_timeout_seconds=1.0, web_threads=8)
    cache = app.extensions["ocr"]["cache"]
    before = _metrics()
    threads, outcomes = _big_calls(cache, 6)
    for t in threads:
        t.join(timeout=60)
    after = _metrics()
    timeouts = [o for o in outcomes if isinstance(o, EngineTimeout)]
    assert len(timeouts) >= 5, outcomes  # the first may finish in time on a fast moment
    dropped = metric_sum(after, "ocr_engine_queue_dropped_total", reason="caller_gone")
    dropped -= metric_sum(before, "ocr_engine_queue_dropped_total", reason="caller_gone")
    assert dropped >= 4, outcomes  # never started: the engine did not run them for nobody
    depth = "ocr_engine_queue_depth"  # per process: other tests' engines count too
    assert metric_sum(after, depth) <= metric_sum(before, depth)  # none of ours waits
    # Only the call that had started still runs (one that a free moment let start as well
    # may run too: about 12 s each here); then the engine is free again. A liveness bound,
    # not a speed target: generous for a shared machine.
    deadline = time.monotonic() + 90
    while True:
        try:
            assert cache.get_or_compute(WORD_EN.read_bytes()).result.lines
            break
        except EngineTimeout:
            assert time.monotonic() < deadline, "the engine is still busy with dropped work"


def test_after_a_burst_past_its_deadline_a_small_page_runs_at_the_orphans_next_pause(make_app):
    """Issue 48's burst: one engine on one inference thread, a short ``OCR_TIMEOUT_SECONDS``
    (3 s), six distinct long pages sent at once (4 s or more each here): every one answers
    504 at its deadline, and the one that started runs on, an orphan nobody waits for (the
    others, with no time left, never begin). A small page sent just after goes in at the
    orphan's next pause (a recognition batch away) instead of waiting for its end, and is
    answered (200, not 504 at its own deadline, however long its feeder waited for the
    orphan's hold on Python's GIL). The orphan then resumes and its entry is stored: asking
    for that page again is a hit."""
    app = make_app(ocr_timeout_seconds=3.0, web_threads=8)
    cache = app.extensions["ocr"]["cache"]
    # The engine is shared with the tests before: one's orphan may still run on it.
    _wait_depth(0, 120, "ocr_engine_calls_running")
    before = _metrics()
    threads, outcomes = _big_calls(cache, 6, first=2592, gap=0.0)
    for t in threads:
        t.join(timeout=60)
    assert all(isinstance(o, EngineTimeout) for o in outcomes), outcomes
    params = cache.engine.default_params
    keys = [
        cache.key_for(digest_image(BIG), replace(params, det_limit_type="min",
                                                 det_limit_side_len=2592 + 32 * i))
        for i in range(6)
    ]  # fmt: skip

    def stored() -> int:  # the six pages whose entry is in L2 (read, never computed)
        return int(cache.store.run("test", lambda client: client.exists(*keys))[1] or 0)

    # The page that started runs on. Where the six threads' joins ran late on a busy host, it
    # can already have ended (a clean-clone run, 2026-12-07): then its entry is being stored.
    orphan_ended = cache.computer.runner.orphans == 0
    if orphan_ended:
        wait_for(lambda: stored() >= 1, 120, "the page that started: running or stored",
                 lambda: f"stored: {stored()} of the six; {_metrics()}")  # fmt: skip
    small = cache.get_or_compute(WORD_EN.read_bytes())  # EngineTimeout here: it waited
    running_on = cache.computer.runner.orphans  # 1: the orphan resumed after the small page
    assert small.result.lines and small.status.value == "MISS"
    yields = metric_sum(_metrics(), "ocr_engine_orphan_yields_total")
    yields -= metric_sum(before, "ocr_engine_orphan_yields_total")
    # The small page went in at the orphan's pause; or, on a fast moment, the orphan's last
    # recognition batch ended in the tenths of a second before the small page reached the
    # engine (a clean-clone run, 2026-12-07): nothing left to pause, nothing running on.
    assert yields == 1 or (yields == 0 and running_on == 0), (yields, running_on)
    wait_for(lambda: stored() >= 1, 120, "the orphan's entry stored once it ended",
             lambda: f"stored: {stored()} of the six; {_metrics()}")  # fmt: skip
    assert cache.computer.runner.orphans == 0


def test_a_full_queue_is_refused_in_every_protocol(make_app, engine):
    """The global miss queue (its depth is ``ocr_dispatch_queue_depth``, read from Redis at
    each scrape) refuses alike in every protocol (the worker's own queue, for calls made
    here: tests/test_cache_unit.py)."""
    held = HeldEngine(engine)  # the first call holds the engine until the checks are done
    app = make_app(engine_override=held, ocr_timeout_seconds=240.0, dispatch_queue_max=2)
    state = app.extensions["ocr"]["engine_state"]
    wait_for(lambda: state.ready, 60, f"the engine ready (status {state.status})")
    cache = app.extensions["ocr"]["cache"]
    cache.dispatch_ready(5)
    settings = app.extensions["ocr"]["settings"].with_overrides(host="127.0.0.1")
    server, port = grpc_server.start(cache, settings, port=0)
    stub = grpc_server.pb2_grpc.PipelineServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    http = app.test_client()
    image = base64.b64encode(SHORT.read_bytes()).decode()
    small = [
        WORD_EN.read_bytes(),
        PHOTOTEST.read_bytes(),
        (CORPUS / "rapidocr_issue_170.png").read_bytes(),
    ]

    def depth() -> float:
        scraped = http.get("/metrics").get_data(as_text=True)
        return metric_sum(scraped, "ocr_dispatch_queue_depth")

    threads, outcomes = _big_calls(cache, 3, small)  # one runs (held), two wait: full
    wait_for(lambda: depth() == 2, 60, "two tickets queued", _metrics)
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub.inference(grpc_server.pb2.Request(key=["image"], value=[image]), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        resp = http.post("/v1/ocr", json={"image": image})
        assert resp.status_code == 503 and int(resp.headers["Retry-After"]) >= 1
        assert resp.get_json()["error"]["code"] == "engine_busy"
        resp = http.post("/ocr/prediction", json={"key": ["image"], "value": [image]})
        assert resp.status_code == 503 and int(resp.headers["Retry-After"]) >= 1
        assert resp.get_json()["err_no"] == 10000
        resp = http.post("/ocr", json={"file": image, "fileType": 1})
        assert resp.status_code == 503 and int(resp.headers["Retry-After"]) >= 1
        assert resp.get_json()["errorCode"] == 503
        with pytest.raises(EngineBusy) as busy:
            cache.get_or_compute(WORD_CH.read_bytes())
        assert busy.value.retry_after >= 1
        assert depth() == 2
        # The backlog the fronts report (KEDA's figure): the running miss and the two queued.
        backlog = http.get("/metrics").get_data(as_text=True)
        assert metric_sum(backlog, "ocr_queue_backlog", kind="misses") == 3
        assert metric_sum(backlog, "ocr_queue_engines_live") >= 1
    finally:
        server.stop(0)
        held.release.set()
        for t in threads:
            t.join(timeout=240)
    assert all(str(o) == "MISS" for o in outcomes), outcomes  # queued work still completes
    # Refused requests were never cached: the image is a miss now, and then a hit.
    statuses = [http.post("/v1/ocr", json={"image": image}).headers["X-Cache"] for _ in "ab"]
    assert statuses == ["MISS", "HIT"]
    assert app.extensions["ocr"]["engine_state"].status == "ready"  # load is not a failure


def test_grpc_concurrency_is_bounded(grpc_front):
    """GRPC_MAX_CONCURRENT_RPCS: RPCs over the bound are refused at once, not queued."""
    app, endpoint = grpc_front(grpc_max_concurrent_rpcs=1)
    runner = app.extensions["ocr"]["cache"]._computer.runner
    stub = grpc_server.pb2_grpc.PipelineServiceStub(grpc.insecure_channel(endpoint))
    slow = grpc_server.pb2.Request(key=["image"], value=[base64.b64encode(BIG).decode()])
    first = stub.inference.future(slow, timeout=120)
    # The first RPC is in the engine now (a big page takes seconds).
    wait_for(lambda: runner.running or first.done(), 60, "the first RPC computing")
    small = base64.b64encode(WORD_EN.read_bytes()).decode()
    with pytest.raises(grpc.RpcError) as info:
        stub.inference(grpc_server.pb2.Request(key=["image"], value=[small]), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert first.result().err_no == 0
    assert stub.inference(grpc_server.pb2.Request(key=["image"], value=[small])).err_no == 0
