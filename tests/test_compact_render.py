"""Every protocol renders the same answer from a stored (compact) entry as from the engine's
own result: the real engine on real images, through the real codec (with the shipped
dictionary, and encrypted), then each protocol's renderer on both."""

from __future__ import annotations

import dataclasses
import hashlib

import orjson
import pytest

from app.cache.codec import Codec
from app.engines.base import OcrRequest
from app.engines.tasks import EXTRACTION
from app.imaging import decode_image
from app.protocols import paddlex, pdserving, rest
from app.vocabulary import CacheStatus, OcrResult, Outcome
from tests.conftest import CORPUS, PHOTOTEST

pytestmark = pytest.mark.integration

IMAGES = (PHOTOTEST, CORPUS / "sroie_000.jpg", CORPUS / "paddleocr_doc_11.jpg")
KEY = "ocr:v1:fp:ocr-x:{abc}"
KEYS = (("k1", b"\x07" * 32),)


def _stored(result: OcrResult, sha: str, fp: str, keys: tuple = ()) -> OcrResult:
    codec = Codec(keys)
    entry = codec.decode(codec.encode(result, sha, fp, 60, KEY), sha, fp, KEY)
    assert entry is not None
    return entry.result


def _renders(result: OcrResult, params, task: str = "ocr") -> list[bytes]:  # type: ignore[no-untyped-def]
    outcome = Outcome(result, CacheStatus.HIT, "l2")
    shown = paddlex.shown_lines(result, params, 0.0)
    return [
        rest.render(outcome, {"name": "paddleocr"}, 0.0, task),
        rest.render(outcome, {"name": "paddleocr"}, 0.5, task),
        pdserving.result_string(result, 0.5).encode(),
        pdserving.result_string(result, 0.0).encode(),
        orjson.dumps(paddlex.pruned_result(result, params, 0.0)),
        orjson.dumps(paddlex.pruned_result(result, params, 0.7)),
        repr(shown).encode(),
    ]


@pytest.mark.parametrize("word_boxes", [False, True], ids=["lines", "word-boxes"])
def test_every_protocol_renders_a_stored_entry_as_the_engine_result(engine, word_boxes):  # type: ignore[no-untyped-def]
    params = dataclasses.replace(engine.default_params, return_word_box=word_boxes)
    for path in IMAGES:
        data = path.read_bytes()
        result = engine.recognize(OcrRequest(data, decode_image(data, 60_000_000), params))
        assert result.lines, path.name
        assert not word_boxes or any(line.words for line in result.lines)
        sha = hashlib.sha256(data).hexdigest()
        for keys in ((), KEYS):
            stored = _stored(result, sha, engine.fingerprint, keys)
            assert stored == result, path.name
            assert _renders(stored, params) == _renders(result, params), path.name


def test_text_task_results_render_the_same(engine):  # type: ignore[no-untyped-def]
    """HunyuanOCR's text tasks (parsing, extraction): the text is stored verbatim."""
    text = '{"name": "Ada Lovelace", "total": "12,30 \u20ac", "note": "line\\nbreak \\"q\\""}'
    result = OcrResult(896, 528, (), text)
    stored = _stored(result, hashlib.sha256(b"x").hexdigest(), engine.fingerprint)
    for task in ("parsing", EXTRACTION):
        assert _renders(stored, engine.default_params, task) == _renders(
            result, engine.default_params, task
        )
