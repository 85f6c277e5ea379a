"""Line reuse (``CACHE_LINES``, issue 27) on the real engine and a real Redis: every answer
with reuse on - the first time and from stored lines - equals the answer with reuse off;
tenants, engines and contexts never share a line; a damaged or forged line is a miss; no
text a redaction policy masks is stored; the counter and the wiring through the app.

The whole corpus: ``make lines-exact`` (``LINES_CORPUS=all``); the template figures:
``make bench-lines``."""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis
from PIL import Image, ImageDraw, ImageFont

from app import metrics
from app.cache.breaker import CircuitBreaker
from app.cache.codec import Codec
from app.cache.keys import KeySpace
from app.cache.lines import RedisLineStore
from app.cache.store import RedisStore
from app.engines.base import OcrRequest
from app.engines.lines import LineId, decode_reading, encode_reading
from app.engines.redacting import with_redaction
from app.imaging import decode_image
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


def _store(url: str, fingerprint: str, codec: Codec | None = None) -> RedisLineStore:
    raw = RedisStore(url, 1000, 1000, CircuitBreaker(3, 2.0))
    return RedisLineStore(raw, KeySpace("ocr", fingerprint), codec or Codec(), lambda: 600)


def _count() -> tuple[float, float]:
    return (
        metrics.LINES.labels(outcome="reused")._value.get(),  # type: ignore[attr-defined]
        metrics.LINES.labels(outcome="recognized")._value.get(),  # type: ignore[attr-defined]
    )


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
    names = [k.decode() for k in client.scan_iter("ocr.tenant_a:*:line:*")]
    assert names and all(f":{lines_engine.fingerprint}:line:w" in n for n in names)
    # Another engine fingerprint (models, versions, device, redaction policy) reads nothing.
    digest, context = names[0].rsplit(":", 2)[-1], names[0].rsplit(":", 2)[-2]
    line = LineId(digest, context)
    assert store.fetch("tenant_a", [line])[0] is not None
    assert _store(redis_server.url, "0" * 16).fetch("tenant_a", [line]) == [None]
    assert store.fetch("tenant_a", [LineId(digest, "w999")]) == [None]  # another context


def test_a_damaged_or_forged_line_is_a_miss(redis_server):
    url, fp = redis_server.url, "f" * 16
    client = redis.Redis.from_url(url)
    sealed = _store(url, fp, Codec(KEYS))
    line, other = LineId("a" * 64, "w320"), LineId("b" * 64, "w320")
    reading = encode_reading(("Total due", 0.99, None))
    sealed.keep("forge", [(line, reading), (other, reading)])
    assert sealed.fetch("forge", [line]) == [reading]
    name = KeySpace("ocr", fp).line(line.context, line.digest, "forge")
    value = client.get(name)
    assert value is not None
    client.set(name, value[:-1] + bytes([value[-1] ^ 1]))  # one bit flipped
    assert sealed.fetch("forge", [line]) == [None]
    client.set(name, value[: len(value) // 2])  # cut short
    assert sealed.fetch("forge", [line]) == [None]
    # Moved under another crop's key: bound to its own key and crop digest.
    client.set(name, client.get(KeySpace("ocr", fp).line(other.context, other.digest, "forge")))
    assert sealed.fetch("forge", [line]) == [None]
    # Written without the key (a writer to Redis who has no key): refused when keys are set.
    _store(url, fp).keep("forge", [(line, encode_reading(("FORGED", 1.0, None)))])
    assert sealed.fetch("forge", [line]) == [None]


def test_readings_decode_only_in_their_exact_form():
    words = [40.5, [["T", "o"], ["1"]], [[1, 2], [9]], ["en&num", "en&num"]]
    assert decode_reading(encode_reading(("To 1", 0.5, words)), True) == ("To 1", 0.5, words)
    assert decode_reading(encode_reading(("To 1", 0.5, None)), False) == ("To 1", 0.5, None)
    for bad in (
        b"not json",
        b'["x"]',
        b'["x", 1]',  # an integer score is not what the recognizer answers
        b"[1, 0.5]",
        b'{"text": "x"}',
        orjson.dumps(["x", 0.5, [40.5, [["x"]], [[1]], []]]),
        orjson.dumps(["x", 0.5, [40.5, [["x"]], [["1"]], ["en&num"]]]),
        orjson.dumps(["x", 0.5, [40.5, [["x"]], [[1, 2]], ["en&num"]]]),
    ):
        assert decode_reading(bad, with_words=b"[40.5" in bad) is None, bad
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
    values = [client.get(k) for k in client.scan_iter("ocr.redact:*:line:*")]
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
        assert list(redis_client.scan_iter("ocr.acme:*:line:*"))
        assert not list(redis_client.scan_iter("ocr:*:line:*"))
        text = client.get("/metrics").get_data(as_text=True)
        reused = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith('ocr_lines_total{outcome="reused"}')
        ]
        assert reused and reused[0] > 0
    finally:
        make_app()  # the shared engine's reuse off again (the assembly's say)
