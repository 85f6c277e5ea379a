"""The document tier (app/cache/documents.py): a repeated PDF is answered from its pages'
entries without rendering it again, and only ever with its own pages' verified entries.

Real engine, real Redis, real pdfium; "rendered" is read from ``ocr_pdf_pages_rendered_total``
around each request."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from app.cache.codec import Codec
from app.cache.keys import digest_image
from tests.conftest import PHOTOTEST, WORD_CH, WORD_EN
from tests.helpers import metric_sum

pytestmark = pytest.mark.integration


def _pdf(*paths) -> bytes:  # type: ignore[no-untyped-def]
    pages = [Image.open(p).convert("RGB") for p in paths]
    buf = io.BytesIO()
    pages[0].save(buf, "PDF", resolution=72, save_all=True, append_images=pages[1:])
    return buf.getvalue()


PDF = _pdf(PHOTOTEST, WORD_EN)
OTHER = _pdf(WORD_CH, WORD_EN)


def ocr(client, pdf: bytes = PDF, headers=None, **body):  # type: ignore[no-untyped-def]
    payload = {"file": base64.b64encode(pdf).decode(), "fileType": 0, "visualize": False, **body}
    return client.post("/ocr", data=json.dumps(payload), headers=headers or {})


def rendered(client) -> float:  # type: ignore[no-untyped-def]
    return metric_sum(client.get("/metrics").get_data(as_text=True), "ocr_pdf_pages_rendered_total")


def doc_keys(redis_client) -> list[bytes]:  # type: ignore[no-untyped-def]
    return [k for k in redis_client.keys("*") if b":doc:" in k]


@pytest.fixture()
def pdf_client(make_app):  # type: ignore[no-untyped-def]
    return make_app(pdf_render_scale=1.0).test_client()


def test_a_repeated_pdf_is_not_rendered_again(pdf_client, redis_client):
    before = rendered(pdf_client)
    first = ocr(pdf_client)
    assert first.status_code == 200 and first.headers["X-Cache"] == "MISS"
    assert rendered(pdf_client) == before + 2
    assert len(doc_keys(redis_client)) == 1
    second = ocr(pdf_client)
    assert second.status_code == 200 and second.headers["X-Cache"] == "HIT"
    assert rendered(pdf_client) == before + 2  # nothing rendered
    assert second.get_json()["result"] == first.get_json()["result"]
    metrics = pdf_client.get("/metrics").get_data(as_text=True)
    assert metric_sum(metrics, "ocr_document_lookups_total", result="hit") >= 1


def test_pictures_need_the_pages_so_they_are_rendered(pdf_client):
    ocr(pdf_client)
    before = rendered(pdf_client)
    resp = ocr(pdf_client, visualize=True)
    assert resp.status_code == 200 and resp.headers["X-Cache"] == "HIT"
    assert rendered(pdf_client) == before + 2
    assert "ocrImage" in resp.get_json()["result"]["ocrResults"][0]


def test_a_page_gone_from_the_cache_renders_and_recomputes_it(pdf_client, redis_client):
    first = ocr(pdf_client).get_json()["result"]
    page_keys = [k for k in redis_client.keys("*") if b":doc:" not in k and b"{" in k]
    redis_client.delete(page_keys[0])
    before = rendered(pdf_client)
    again = ocr(pdf_client)
    assert again.status_code == 200 and again.headers["X-Cache"] in ("HIT,MISS", "MISS")
    assert rendered(pdf_client) == before + 2
    assert again.get_json()["result"] == first


def test_another_documents_page_list_is_refused(pdf_client, redis_client):
    """A page list moved under another document's key does not open there (it is bound to
    its document's SHA-256): the document is rendered and answered with its own pages."""
    ocr(pdf_client, OTHER)
    ocr(pdf_client, PDF)
    (other_key,) = [k for k in doc_keys(redis_client) if digest_image(OTHER).md5.encode() in k]
    (key,) = [k for k in doc_keys(redis_client) if k != other_key]
    redis_client.set(key, redis_client.get(other_key))
    before = rendered(pdf_client)
    resp = ocr(pdf_client, PDF)
    assert rendered(pdf_client) == before + 2
    texts = resp.get_json()["result"]["ocrResults"][0]["prunedResult"]["rec_texts"]
    assert texts[0].startswith("This is a lot of 12 point text")


def test_forged_page_lists_are_misses_with_encryption(make_app, redis_client):
    client = make_app(
        pdf_render_scale=1.0, cache_encryption_keys=(("k1", b"k" * 32),)
    ).test_client()
    ocr(client)
    (doc,) = doc_keys(redis_client)
    # A plaintext page list naming another image's page: what a writer without the key can do.
    page = digest_image(WORD_CH.read_bytes())
    listing = json.dumps([[page.md5, page.sha256]]).encode()
    spec = doc.decode().split(":doc:", 1)[1].rsplit(":", 1)[0]
    forged = Codec().encode_blob(listing, digest_image(PDF).sha256, spec, 600, doc.decode())
    redis_client.set(doc, forged)
    before = rendered(client)
    resp = ocr(client)
    assert resp.status_code == 200 and rendered(client) == before + 2


def test_tenants_do_not_share_page_lists(make_app, redis_client):
    client = make_app(pdf_render_scale=1.0, cache_tenant_header="X-Tenant").test_client()
    ocr(client, headers={"X-Tenant": "a"})
    before = rendered(client)
    ocr(client, headers={"X-Tenant": "b"})
    assert rendered(client) == before + 2
    assert len(doc_keys(redis_client)) == 2


def test_no_store_and_no_cache(pdf_client, redis_client):
    ocr(pdf_client, headers={"Cache-Control": "no-store"})
    assert doc_keys(redis_client) == []
    ocr(pdf_client)
    before = rendered(pdf_client)
    ocr(pdf_client, headers={"Cache-Control": "no-cache"})
    assert rendered(pdf_client) == before + 2


def test_purging_the_pdf_md5_removes_its_page_list(make_app, redis_client):
    client = make_app(pdf_render_scale=1.0, admin_token="t" * 16).test_client()
    ocr(client)
    assert doc_keys(redis_client)
    resp = client.post(
        "/admin/purge",
        json={"md5": digest_image(PDF).md5},
        headers={"Authorization": "Bearer " + "t" * 16},
    )
    assert resp.status_code == 200 and doc_keys(redis_client) == []
