"""Line reuse (``CACHE_LINES``, issue 27) on the real engine and a real Redis: every answer
with reuse on - the first time, from stored lines, and with part of each batch found -
equals the answer with reuse off; tenants, engines, schemas and contexts never share a line;
a damaged, forged or moved line is a miss, sealed or not; a store that fails costs reuse,
never the answer; the request controls reach the line store; no text a redaction policy
masks is stored; the counters and the wiring through the app.

The whole corpus: ``make lines-exact`` (``LINES_CORPUS=all``); the template figures:
``make bench-lines``."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import orjson
import pytest
import redis
from PIL import Image, ImageDraw, ImageFont

from app import metrics
from app.cache.breaker import CircuitBreaker
from app.cache.codec import Codec
from app.cache.keys import KeySpace
from app.cache.lines import RedisLineStore, _bound
from app.cache.store import RedisStore
from app.engines.base import OcrRequest
from app.engines.lines import LineId, LineStore, decode_reading, encode_reading
from app.engines.redacting import with_redaction
from app.imaging import decode_image
from app.vocabulary import CacheControls, CacheStatus
from bench.templates import FONTS, document
from tests.conftest import CORPUS, PHOTOTEST, corpus_bytes

pytestmark = pytest.mark.integration

KEYS = (("k1", b"0123456789abcdef0123456789abcdef"),)
# A few pages for `make test`: with crops padded by a wider neighbour whose reading changes
# when recognised alone (bench/results/line_neighbours.json), and a Chinese page.
SUBSET = ("tesseract_phototest.png", "donut_document.png", "paddleocr_doc_11.jpg")


def _corpus() -> list[str]:
    if os.environ.get("LINES_CORPUS") == "all":
        return sorted(
            line.split("\t")[0]
            for line in (CORPUS / "MANIFEST.tsv").read_text().splitlines()[1:]
            if line.strip()
        )
    return list(SUBSET)


@pytest.fixture()
def lines_engine(engine: Any) -> Iterator[Any]:
    """The session's engine, with reuse switched off again afterwards."""
    yield engine
    engine.use_line_store(None)


def _store(
    url: str, fingerprint: str, codec: Codec | None = None, schema: str = "s"
) -> RedisLineStore:
    raw = RedisStore(url, 1000, 1000, CircuitBreaker(3, 2.0))
    keys = KeySpace("ocr", fingerprint)
    return RedisLineStore(raw, keys, codec or Codec(), lambda: 600, schema)


def _count() -> tuple[float, float]:
    return (
        metrics.LINES.labels(outcome="reused")._value.get(),  # type: ignore[attr-defined]
        metrics.LINES.labels(outcome="recognized")._value.get(),  # type: ignore[attr-defined]
    )


def _since(before: tuple[float, float]) -> list[float]:
    """(reused, recognized) since ``before``."""
    return [a - b for a, b in zip(_count(), before, strict=True)]


def _faults(what: str) -> float:
    return metrics.LINE_FAULTS.labels(what=what)._value.get()  # type: ignore[attr-defined]


class _Wrapped:
    """A ``LineStore`` in front of the real one: what a test changes, the rest passes on."""

    def __init__(self, inner: LineStore) -> None:
        self.inner = inner

    def fetch(self, namespace: str, lines: Sequence[LineId]) -> list[bytes | None]:
        return self.inner.fetch(namespace, lines)

    def keep(
        self, namespace: str, lines: Sequence[tuple[LineId, bytes]], ttl: int | None = None
    ) -> None:
        self.inner.keep(namespace, lines, ttl)

    def count(self, reused: int, recognized: int) -> None:
        self.inner.count(reused, recognized)

    def fault(self, what: str) -> None:
        self.inner.fault(what)


class _Hiding(_Wrapped):
    """Stored lines the store does not find: ``hide(i, line)`` of each fetch's i-th line."""

    def __init__(self, inner: LineStore, hide: Callable[[int, LineId], bool]) -> None:
        super().__init__(inner)
        self._hide = hide

    def fetch(self, namespace: str, lines: Sequence[LineId]) -> list[bytes | None]:
        values = self.inner.fetch(namespace, lines)
        return [
            None if self._hide(i, line) else v
            for i, (line, v) in enumerate(zip(lines, values, strict=True))
        ]


class _Failing(_Wrapped):
    """A store whose reads, writes and counting raise what redis-py's cluster client raises
    outside ``RedisError`` (``RedisStore`` catches it now; another store might not)."""

    def fetch(self, namespace: str, lines: Sequence[LineId]) -> list[bytes | None]:
        raise redis.exceptions.SlotNotCoveredError("no node for the slot")

    def keep(
        self, namespace: str, lines: Sequence[tuple[LineId, bytes]], ttl: int | None = None
    ) -> None:
        raise redis.exceptions.SlotNotCoveredError("no node for the slot")

    def count(self, reused: int, recognized: int) -> None:
        raise RuntimeError("counting failed")


def _request(data: bytes, engine: Any, namespace: str, **params: Any) -> OcrRequest:
    p = dataclasses.replace(engine.default_params, **params)
    return OcrRequest(data, decode_image(data, 200_000_000), p, namespace)


def _off_cold_warm(engine: Any, store: RedisLineStore, request: OcrRequest) -> list[Any]:
    engine.use_line_store(None)
    off = engine.recognize(request)
    engine.use_line_store(store)
    return [off, engine.recognize(request), engine.recognize(request)]


@pytest.mark.slow
@pytest.mark.parametrize("name", _corpus())
def test_reuse_answers_what_reuse_off_answers(lines_engine, redis_server, name):
    """Default parameters, then word boxes with textline orientation on: the first answer
    with reuse on (its lines recognised) and the second (every line from Redis) are the
    answer of reuse off, byte for byte."""
    store = _store(redis_server.url, lines_engine.fingerprint)
    data = corpus_bytes(CORPUS / name)
    modes: list[dict[str, Any]] = [{}]
    if name in SUBSET[:1] or os.environ.get("LINES_CORPUS") == "all":
        modes.append({"return_word_box": True, "textline_orientation": True})
    for mode in modes:
        request = _request(data, lines_engine, f"exact{len(mode)}", **mode)
        off, cold, before = *_off_cold_warm(lines_engine, store, request)[:2], _count()
        warm = lines_engine.recognize(request)
        reused, recognized = (a - b for a, b in zip(_count(), before, strict=True))
        assert cold.to_dict() == off.to_dict(), (name, mode)
        assert warm.to_dict() == off.to_dict(), (name, mode)
        assert recognized == 0 and reused >= len(off.lines), (name, mode)


def test_a_page_interjected_into_a_reusing_page_answers_as_alone(lines_engine, redis_server):
    """Interjection (the fair queue's) while line reuse recognises a page's unseen crops:
    the page paused between two of its own batches (the predictor as the stock one left
    it), the other page computed with reuse too, in its own tenant; both answers are
    those of reuse off."""
    from tests.test_engine import interjected

    store = _store(redis_server.url, lines_engine.fingerprint)
    long = _request(corpus_bytes(CORPUS / "paddleocr_doc_11.jpg"), lines_engine, "paused-beside-on")
    short = _request(corpus_bytes(PHOTOTEST), lines_engine, "interjected")
    lines_engine.use_line_store(None)
    off = [lines_engine.recognize(long), lines_engine.recognize(short)]
    lines_engine.use_line_store(store)
    before = _count()
    answers = interjected(
        lines_engine, lambda: lines_engine.recognize(long), lambda: lines_engine.recognize(short)
    )
    assert answers[2] == ["long: start", "short", "long: end"]
    assert [answers[0].to_dict(), answers[1].to_dict()] == [a.to_dict() for a in off]
    assert _since(before)[1] >= len(off[0].lines) + len(off[1].lines)  # all recognised


def test_a_page_without_reuse_interjected_into_a_reusing_page_stays_without(
    lines_engine, redis_server
):
    """A request that may neither read nor write lines (``no-cache`` with ``no-store``, or
    bypass), interjected into another tenant's page that reuses lines: it is recognised
    by the stock recognizer, not the paused page's (which would look it up and store it in
    that tenant's namespace); the paused page counts its own lines only."""
    from app.engines.base import LineUse
    from tests.test_engine import interjected

    store = _store(redis_server.url, lines_engine.fingerprint)
    long_data = corpus_bytes(CORPUS / "paddleocr_doc_11.jpg")
    short = dataclasses.replace(
        _request(corpus_bytes(PHOTOTEST), lines_engine, "other"),
        lines=LineUse(read=False, write=False),
    )
    lines_engine.use_line_store(None)
    off = lines_engine.recognize(short)
    lines_engine.use_line_store(store)
    before = _count()
    lines_engine.recognize(_request(long_data, lines_engine, "alone-beside-off"))
    alone = _since(before)
    before = _count()
    long = _request(long_data, lines_engine, "paused-beside-off")  # its lines unseen yet
    answers = interjected(
        lines_engine, lambda: lines_engine.recognize(long), lambda: lines_engine.recognize(short)
    )
    assert answers[2] == ["long: start", "short", "long: end"]
    assert answers[1].to_dict() == off.to_dict()
    assert _since(before) == alone  # the paused page's lines, none of the interjected one's


def test_template_copies_reuse_their_labels_exactly(lines_engine, redis_server):
    """Two copies of one invoice layout with other values: the second reuses lines of the
    first, and both answers are those of reuse off; the re-scanned copy is exact too."""
    store = _store(redis_server.url, lines_engine.fingerprint)
    docs = [document("invoice", 0), document("invoice", 1), document("invoice", 1, True)]
    results = []
    for data in docs:
        request = _request(data, lines_engine, "template")
        lines_engine.use_line_store(None)
        off = lines_engine.recognize(request)
        lines_engine.use_line_store(store)
        before = _count()
        on = lines_engine.recognize(request)
        results.append([a - b for a, b in zip(_count(), before, strict=True)])
        assert on.to_dict() == off.to_dict()
    assert results[0][0] == 0  # the first copy: nothing to reuse
    assert results[1][0] > 0 and results[1][1] > 0  # labels reused, values recognised


def test_tenants_and_engines_do_not_share_lines(lines_engine, redis_server):
    store = _store(redis_server.url, lines_engine.fingerprint)
    request = _request(PHOTOTEST.read_bytes(), lines_engine, "tenant_a")
    lines_engine.use_line_store(store)
    lines_engine.recognize(request)
    before = _count()
    lines_engine.recognize(dataclasses.replace(request, namespace="tenant_b"))
    reused, recognized = (a - b for a, b in zip(_count(), before, strict=True))
    assert reused == 0 and recognized > 0
    client = redis.Redis.from_url(redis_server.url)
    names = [k.decode() for k in client.scan_iter("ocr.tenant_a:*:line1:*")]
    assert names and all(f":{lines_engine.fingerprint}:line1:s:w" in n for n in names)
    # Another engine fingerprint (models, versions, device, redaction policy) reads nothing,
    # nor another line schema (OpenCV's version): the same fingerprint, other readings.
    context, digest = names[0].rsplit(":", 2)[-2:]
    line = LineId(digest, context)
    assert store.fetch("tenant_a", [line])[0] is not None
    assert _store(redis_server.url, "0" * 16).fetch("tenant_a", [line]) == [None]
    assert _store(redis_server.url, lines_engine.fingerprint, schema="t").fetch(
        "tenant_a", [line]
    ) == [None]
    assert store.fetch("tenant_a", [LineId(digest, "w999")]) == [None]  # another context


def test_a_damaged_or_forged_line_is_a_miss(redis_server):
    url, fp = redis_server.url, "f" * 16
    client = redis.Redis.from_url(url)
    sealed = _store(url, fp, Codec(KEYS))
    line, other = LineId("a" * 64, "w320"), LineId("b" * 64, "w320")
    reading = encode_reading(("Total due", 0.99, None))
    sealed.keep("forge", [(line, reading), (other, reading)])
    assert sealed.fetch("forge", [line]) == [reading]
    name = sealed.name("forge", line)
    value = client.get(name)
    assert value is not None
    client.set(name, value[:-1] + bytes([value[-1] ^ 1]))  # one bit flipped
    assert sealed.fetch("forge", [line]) == [None]
    client.set(name, value[: len(value) // 2])  # cut short
    assert sealed.fetch("forge", [line]) == [None]
    # Moved under another crop's key: bound to its own key and crop digest.
    client.set(name, client.get(sealed.name("forge", other)))
    assert sealed.fetch("forge", [line]) == [None]
    # Written without the key (a writer to Redis who has no key): refused when keys are set.
    _store(url, fp).keep("forge", [(line, encode_reading(("FORGED", 1.0, None)))])
    assert sealed.fetch("forge", [line]) == [None]


def test_an_unsealed_line_moved_to_another_context_or_tenant_is_a_miss(redis_server):
    """Without CACHE_ENCRYPTION_KEYS a value is still bound to its own key (crop, context,
    schema, namespace): copied to the same crop's key of another context or tenant, it does
    not open."""
    url, fp = redis_server.url, "e" * 16
    client = redis.Redis.from_url(url)
    store = _store(url, fp)
    line = LineId("c" * 64, "w320")
    reading = encode_reading(("Invoice No:", 0.98, None))
    store.keep("moved_a", [(line, reading)])
    assert store.fetch("moved_a", [line]) == [reading]
    value = client.get(store.name("moved_a", line))
    for namespace, target in (("moved_b", line), ("moved_a", LineId(line.digest, "w640"))):
        client.set(store.name(namespace, target), value)
        assert store.fetch(namespace, [target]) == [None], (namespace, target)
    client.set(_store(url, fp, schema="t").name("moved_a", line), value)
    assert _store(url, fp, schema="t").fetch("moved_a", [line]) == [None]  # another schema


def test_lines_are_read_and_written_in_chunks(redis_server):
    """300 lines: three MGETs and three pipelines of at most 128 keys, every line back."""
    store = _store(redis_server.url, "d" * 16)
    lines = [LineId(f"{i:064x}", "w320") for i in range(300)]
    readings = [encode_reading((f"line {i}", 0.5, None)) for i in range(300)]
    client = redis.Redis.from_url(redis_server.url)

    def calls(command: str) -> int:
        return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))

    sets, mgets = calls("set"), calls("mget")
    store.keep("chunks", list(zip(lines, readings, strict=True)))
    assert calls("set") - sets == 300
    assert store.fetch("chunks", lines) == readings
    assert calls("mget") - mgets == 3


def test_readings_decode_only_in_their_exact_form():
    words = [40.5, [["T", "o"], [" "], ["1"]], [[1, 2], [5], [9]], ["en&num", "symbol", "en&num"]]
    assert decode_reading(encode_reading(("To 1", 0.5, words)), True) == ("To 1", 0.5, words)
    assert decode_reading(encode_reading(("To 1", 0.5, None)), False) == ("To 1", 0.5, None)
    assert decode_reading(encode_reading(("", 0.0, [10.0, [], [], []])), True) is not None
    # A character decoded in the batch's padding, past the crop's own columns (as read).
    late = ("EE", 0.39, [18.35, [["E", "E"]], [[16, 20]], ["en&num"]])
    assert decode_reading(encode_reading(late), True) == late

    def reading(text: str, columns: Any, groups: Any, positions: Any, kinds: Any) -> bytes:
        return orjson.dumps([text, 0.5, [columns, groups, positions, kinds]])

    for bad in (
        b"not json",
        b'["x"]',
        b'["x", 1]',  # an integer score is not what the recognizer answers
        b"[1, 0.5]",
        b'["x", 1.5]',  # a score above 1
        b'{"text": "x"}',
        # Word information that PaddleX's word boxes would divide by or index into:
        reading("x", 40.5, [["x"]], [[1]], []),
        reading("x", 40.5, [["x"]], [["1"]], ["en&num"]),
        reading("x", 40.5, [["x"]], [[1, 2]], ["en&num"]),
        reading("x", 0.0, [["x"]], [[1]], ["en&num"]),  # no columns
        reading("x", -3.0, [["x"]], [[1]], ["en&num"]),
        reading("x", 40, [["x"]], [[1]], ["en&num"]),  # an integer column count
        reading("", 40.5, [[]], [[]], ["en&num"]),  # an empty word
        reading("ab", 40.5, [["a", "b"]], [[5, 3]], ["en&num"]),  # positions descending
        reading("ab", 40.5, [["a", "b"]], [[3, 3]], ["en&num"]),
        reading("ab", 40.5, [["a", "b"]], [[-1, 3]], ["en&num"]),
        reading("ab", 40.5, [["a", "c"]], [[1, 3]], ["en&num"]),  # not the text
        reading("ab", 40.5, [["ab"]], [[1]], ["en&num"]),  # a word of a string, not chars
        reading("ab", 40.5, [["a", "b"]], [[1, 3]], ["word"]),  # an unknown kind
        reading("ab", 40.5, [["a", "b"]], [[1, 3]], [["en&num"]]),
    ):
        assert decode_reading(bad, with_words=bad.count(b"[") > 1) is None, bad
    assert decode_reading(encode_reading(("x", 0.5, None)), True) is None  # another form


def _phone_page() -> bytes:
    img = Image.new("RGB", (640, 200), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.truetype(str(FONTS / "DejaVuSans.ttf"), 28)
    draw.text((30, 40), "Customer service", font=font, fill="black")
    draw.text((30, 120), "Tel 13812345678", font=font, fill="black")
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def test_no_text_the_redaction_policy_masks_is_stored(lines_engine, redis_server):
    """The masked line is recognised every time (never stored), the others are stored and
    reused, and the answer is reuse off's, masked."""
    redacting = with_redaction(lines_engine, ("phone",), "")
    store = _store(redis_server.url, redacting.fingerprint)
    request = _request(_phone_page(), lines_engine, "redact")
    lines_engine.use_line_store(None)
    off = redacting.recognize(request)
    assert any("*" in line.text for line in off.lines) and len(off.lines) == 2
    redacting.use_line_store(store)  # type: ignore[attr-defined]
    assert redacting.recognize(request) == off
    before = _count()
    assert redacting.recognize(request) == off
    assert [a - b for a, b in zip(_count(), before, strict=True)] == [1, 1]
    client = redis.Redis.from_url(redis_server.url)
    values = [client.get(k) for k in client.scan_iter("ocr.redact:*:line1:*")]
    assert len(values) == 1 and b"Customer" in values[0]
    assert not any(b"1381234" in (value or b"") for value in values)


def test_lines_through_the_app_counted_per_tenant(make_app, redis_client):
    """CACHE_LINES=on wired by the assembly: the tenant's namespace reaches the engine, the
    second copy of a template reuses lines, /metrics counts them."""
    app = make_app(cache_lines=True, cache_tenant_header="X-Tenant")
    client = app.test_client()
    try:
        for copy in (0, 1):
            answer = client.post(
                "/v1/ocr",
                data={"file": (io.BytesIO(document("card", copy)), "card.png")},
                headers={"X-Tenant": "acme"},
            )
            assert answer.status_code == 200 and answer.headers["X-Cache"] == "MISS"
        assert list(redis_client.scan_iter("ocr.acme:*:line1:*"))
        assert not list(redis_client.scan_iter("ocr:*:line1:*"))
        text = client.get("/metrics").get_data(as_text=True)
        reused = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith('ocr_lines_total{outcome="reused"}')
        ]
        assert reused and reused[0] > 0
    finally:
        make_app()  # the shared engine's reuse off again (the assembly's say)


# Faults: a store that raises, values damaged or moved without encryption -----------------


def _off(engine: Any, request: OcrRequest) -> dict[str, Any]:
    engine.use_line_store(None)
    return engine.recognize(request).to_dict()


def test_a_failing_store_costs_reuse_not_the_answer(make_app, lines_engine):
    """Every store call raising (the cluster client's SlotNotCoveredError, outside RedisError;
    counting too): the page is recognised as with reuse off, the engine is not failing, the
    faults are counted. A fault outside the store's calls (here the redaction rule) costs
    the page a computation with reuse off, and nothing more."""
    app = make_app(cache_lines=True)
    cache = app.extensions["ocr"]["cache"]
    data = document("card", 3)
    real = lines_engine._lines[0]  # the app's RedisLineStore
    off = _off(lines_engine, _request(data, lines_engine, "failing"))
    try:
        lines_engine.use_line_store(_Failing(real))
        fetches, keeps = _faults("fetch"), _faults("keep")
        controls = CacheControls(namespace="failing")
        outcome = cache.get_or_compute(data, None, controls)
        assert outcome.status is CacheStatus.MISS and outcome.result.to_dict() == off
        assert not cache._computer.failing
        assert (_faults("fetch") - fetches, _faults("keep") - keeps) == (1, 1)
        lines_engine.use_line_store(real, lambda text: 1 / 0 > 0)  # a bug in the reuse path
        pages = _faults("page")
        recompute = CacheControls(no_cache=True, namespace="failing")
        outcome = cache.get_or_compute(data, None, recompute)
        assert outcome.result.to_dict() == off and not cache._computer.failing
        assert _faults("page") - pages == 1
    finally:
        make_app()


def test_damaged_or_moved_lines_unsealed_are_misses(lines_engine, redis_server):
    """Without encryption keys: a value copied from another tenant's key of the same crop,
    and a value bound to its own key whose reading is malformed (no columns, an empty word:
    PaddleX's word boxes would divide by zero or index nothing), are misses: the page is
    recognised, exactly."""
    store = _store(redis_server.url, lines_engine.fingerprint)
    client = redis.Redis.from_url(redis_server.url)
    request = _request(PHOTOTEST.read_bytes(), lines_engine, "unsealed_a", return_word_box=True)
    off = _off(lines_engine, request)
    lines_engine.use_line_store(store)
    lines_engine.recognize(request)  # the lines stored in tenant a
    names = [k.decode() for k in client.scan_iter("ocr.unsealed_a:*:line1:*")]
    assert names
    for name in names:  # copied to tenant b's keys of the same crops and contexts
        client.set(name.replace("ocr.unsealed_a:", "ocr.unsealed_b:", 1), client.get(name))
    other = dataclasses.replace(request, namespace="unsealed_b")
    before = _count()
    assert lines_engine.recognize(other).to_dict() == off
    assert _since(before)[0] == 0
    codec, fp = Codec(), lines_engine.fingerprint
    for at, name in enumerate(names):  # well bound, badly formed
        words = [0.0, [["T"]], [[1]], ["en&num"]] if at % 2 else [9.5, [[]], [[]], ["en&num"]]
        forged = encode_reading(("T" if at % 2 else "", 0.9, words))
        client.set(name, codec.encode_blob(forged, _bound(name), fp, 600, name))
    before = _count()
    assert lines_engine.recognize(request).to_dict() == off
    assert _since(before)[0] == 0


def test_crops_recognised_without_their_widest_neighbour_answer_exactly(lines_engine, redis_server):
    """The risky path: a stock batch partly found in the store, so its other crops are
    recognised without the neighbour that set its width. Every other stored line hidden
    (the 1st, 3rd, 5th of each batch of 6: its widest, the 6th, is found) on
    donut_document.png with word boxes and textline orientation on: the answer is reuse
    off's, byte for byte."""
    store = _store(redis_server.url, lines_engine.fingerprint)
    data = corpus_bytes(CORPUS / "donut_document.png")
    mode = {"return_word_box": True, "textline_orientation": True}
    request = _request(data, lines_engine, "hiding", **mode)
    off = _off(lines_engine, request)
    lines_engine.use_line_store(store)
    assert lines_engine.recognize(request).to_dict() == off  # every line stored
    lines_engine.use_line_store(_Hiding(store, lambda i, line: i % 2 == 0))
    before = _count()
    assert lines_engine.recognize(request).to_dict() == off
    reused, recognized = _since(before)
    assert reused > 0 and recognized > 0


# Request controls reach the line store --------------------------------------------------


def _line_keys(client: redis.Redis, namespace: str) -> dict[bytes, int]:
    return {k: int(client.ttl(k)) for k in client.scan_iter(f"ocr.{namespace}:*:line1:*")}


@pytest.mark.parametrize("control", ["bypass", "no_cache", "no_store", "ttl"])
def test_request_controls_reach_the_line_store(make_app, redis_client, control):
    """Through the front door (its queue, its feeders, the bypass branch): bypass
    (``pipeline.profile``) neither reads nor writes lines; ``no-cache`` writes them only
    (recomputed, refreshed); ``no-store`` reads them only; ``X-Cache-TTL`` caps their TTL,
    which is otherwise the entries' (``CACHE_LINES_TTL_SECONDS`` unset)."""
    app = make_app(cache_lines=True)
    cache = app.extensions["ocr"]["cache"]
    ns = f"ctl_{control}"

    def ocr(copy: int, **controls: Any) -> None:
        cache.get_or_compute(document("card", copy), None, CacheControls(namespace=ns, **controls))

    try:
        if control == "ttl":
            ocr(0, ttl=30)
            assert _line_keys(redis_client, ns) and max(_line_keys(redis_client, ns).values()) <= 30
            seen = set(_line_keys(redis_client, ns))
            ocr(1)
            new = {k: t for k, t in _line_keys(redis_client, ns).items() if k not in seen}
            assert new and all(86400 * 0.85 < t <= 86400 for t in new.values())
            return
        if control == "no_store":
            ocr(0, no_store=True)
            assert not _line_keys(redis_client, ns)
        ocr(0)
        stored = _line_keys(redis_client, ns)
        assert stored
        for key in stored:
            redis_client.expire(key, 50)
        before = _count()
        if control == "bypass":
            ocr(1, bypass=True)
            assert _since(before) == [0, 0]  # the stock pipeline: nothing read, nothing counted
            assert set(_line_keys(redis_client, ns)) == set(stored)
        elif control == "no_cache":
            ocr(0, no_cache=True)
            reused, recognized = _since(before)
            assert reused == 0 and recognized == len(stored)
            assert all(t > 50 for t in _line_keys(redis_client, ns).values())  # refreshed
        else:
            ocr(1, no_store=True)
            assert _since(before)[0] > 0  # read
            assert set(_line_keys(redis_client, ns)) == set(stored)  # nothing written
    finally:
        make_app()


def test_line_reuse_without_effect_says_so_at_start_up(make_app, caplog):
    with caplog.at_level(logging.WARNING, logger="app.cache.assembly"):
        make_app(cache_lines=True, cache_enabled=False)
    assert any("CACHE_LINES=on has no effect" in r.getMessage() for r in caplog.records)
    make_app()
