"""Upstream parity: our ``/ocr`` answers equal PaddleX's own basic-serving app's.

The oracle is PaddleX's ``create_pipeline_app`` (tests/paddlex_reference.py) running on the
same local models and engine settings. Each case sends one request to both and compares the
whole answers (tests/parity.py says what is left out). ``make test`` runs a representative
subset of the corpus; ``make parity`` (PARITY_CORPUS=all) runs all of it.
"""

from __future__ import annotations

import base64
import csv
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.conftest import CORPUS
from tests.parity import comparable, differences, reference_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# A text page, a word crop, a no-text crop, a rotated page, an EXIF-rotated photo, a
# transparent PNG, a dense receipt, the 4961x7016 scan, Korean and vertical text.
SUBSET = (
    "tesseract_phototest.png",
    "paddleocr_word_en_1.png",
    "paddleocr_word_ch_4.jpg",
    "tesseract_phototest_rotated_180.png",
    "rapidocr_img_exif_orientation.jpg",
    "rapidocr_white_font_transparent.png",
    "sroie_000.jpg",
    "sroie_282.jpg",
    "rapidocr_korean.jpg",
    "rapidocr_text_vertical_words.png",
)


def _corpus() -> list[str]:
    with open(CORPUS / "MANIFEST.tsv", encoding="utf-8") as fh:
        return [row["file"] for row in csv.DictReader(fh, delimiter="\t")]


IMAGES = _corpus() if os.environ.get("PARITY_CORPUS") == "all" else list(SUBSET)


@pytest.fixture(scope="session")
def upstream(base_settings, tmp_path_factory) -> Iterator[str]:  # type: ignore[no-untyped-def]
    log = tmp_path_factory.mktemp("paddlex-reference") / "server.log"
    with reference_server(base_settings.paddle.work_dir, log) as url:
        yield url


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def both(client, upstream: str, body: Any, raw: bytes | None = None) -> tuple[Any, Any]:  # type: ignore[no-untyped-def]
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    ours = client.post("/ocr", data=data, headers=headers)
    theirs = requests.post(f"{upstream}/ocr", data=data, headers=headers, timeout=600)
    return (
        comparable(ours.status_code, ours.get_json()),
        comparable(theirs.status_code, theirs.json()),
    )


def assert_same(ours: Any, theirs: Any) -> None:
    found = differences(ours, theirs)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("name", IMAGES)
def test_corpus_image_default_request(client, upstream, name):
    """What the documentation's client sends: the file and its type, nothing else."""
    body = {"file": b64((CORPUS / name).read_bytes()), "fileType": 1}
    assert_same(*both(client, upstream, body))


OPTIONS = {
    "visualize": False,
    "textDetLimitSideLen": 320,
    "textDetLimitType": "max",
    "textDetThresh": 0.2,
    "textDetBoxThresh": 0.5,
    "textDetUnclipRatio": 2.0,
    "useTextlineOrientation": True,
    "textRecScoreThresh": 0.9,
}


@pytest.mark.parametrize("name", ["tesseract_phototest_rotated_180.png", "sroie_019.jpg"])
def test_every_option(client, upstream, name):
    body = {"file": b64((CORPUS / name).read_bytes()), "fileType": 1, **OPTIONS}
    assert_same(*both(client, upstream, body))


@pytest.mark.parametrize("name", ["tesseract_phototest.png", "paddleocr_doc_11.jpg"])
def test_word_boxes(client, upstream, name):
    body = {"file": b64((CORPUS / name).read_bytes()), "fileType": 1, "returnWordBox": True}
    ours, theirs = both(client, upstream, body)
    assert_same(ours, theirs)
    assert ours["body"]["result"]["ocrResults"][0]["prunedResult"]["text_word"]


def test_unknown_fields_are_ignored_and_log_id_echoed(client, upstream):
    body = {"file": b64((CORPUS / "paddleocr_word_en_1.png").read_bytes()), "fileType": 1,
            "logId": "abc", "requestId": 7, "visualize": False}  # fmt: skip
    ours, theirs = both(client, upstream, body)
    assert_same(ours, theirs)


IMG = b64((CORPUS / "paddleocr_word_en_1.png").read_bytes())
BAD = [
    {},
    {"fileType": 1},
    {"file": 5, "fileType": 1},
    {"file": [IMG], "fileType": 1},
    {"file": IMG, "fileType": "1"},
    {"file": IMG, "fileType": 2},
    {"file": IMG, "fileType": 1, "textDetLimitSideLen": "big"},
    {"file": IMG, "fileType": 1, "visualize": "maybe", "useTextlineOrientation": "perhaps"},
    {"file": IMG, "fileType": 1, "textDetLimitType": 5},
    {"file": IMG},
    {"file": "%%%", "fileType": 1},
    {"file": "", "fileType": 1},
    {"file": b64(b"not an image"), "fileType": 1},
    {"file": b64(b"not a pdf"), "fileType": 0},
]


@pytest.mark.parametrize("body", BAD, ids=range(len(BAD)))
def test_client_errors(client, upstream, body):
    assert_same(*both(client, upstream, body))


@pytest.mark.parametrize("raw", [b"", b"{oops", b"[1, 2]", b'"file"', b'{"file": '])
def test_undecodable_bodies(client, upstream, raw):
    assert_same(*both(client, upstream, None, raw))


@pytest.mark.parametrize("method,path", [("GET", "/ocr"), ("POST", "/health"), ("PUT", "/ocr")])
def test_wrong_method_on_upstream_routes(client, upstream, method, path):
    ours = client.open(path, method=method)
    theirs = requests.request(method, f"{upstream}{path}", timeout=60)
    assert_same(
        comparable(ours.status_code, ours.get_json()),
        comparable(theirs.status_code, theirs.json()),
    )


def test_health(client, upstream):
    ours, theirs = client.get("/health"), requests.get(f"{upstream}/health", timeout=60)
    assert_same(
        comparable(ours.status_code, ours.get_json()),
        comparable(theirs.status_code, theirs.json()),
    )


def _pdf(*names: str) -> bytes:
    import io

    from PIL import Image

    pages = [Image.open(CORPUS / name).convert("RGB") for name in names]
    buf = io.BytesIO()
    pages[0].save(buf, "PDF", resolution=72, save_all=True, append_images=pages[1:])
    return buf.getvalue()


def test_pdf_pages(client, upstream):
    pdf = _pdf("tesseract_phototest.png", "paddleocr_word_en_1.png")
    assert_same(*both(client, upstream, {"file": b64(pdf), "fileType": 0}))
