"""PaddleX / PaddleOCR 3.x basic serving: POST /ocr, GET /health."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
import uuid

import pytest
from PIL import Image, ImageChops, ImageStat

from tests.conftest import PHOTOTEST, WORD_CH, WORD_EN
from tests.helpers import entry_keys, stored_keys

pytestmark = pytest.mark.integration


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def ocr(client, **body):  # type: ignore[no-untyped-def]
    return client.post("/ocr", data=json.dumps(body))


def test_envelope_and_pruned_result(client):
    resp = ocr(client, file=b64(PHOTOTEST.read_bytes()), fileType=1, visualize=False)
    assert resp.status_code == 200 and resp.headers["X-Cache"] == "MISS"
    body = resp.get_json()
    assert list(body) == ["logId", "result", "errorCode", "errorMsg"]  # upstream's order
    assert (body["errorCode"], body["errorMsg"]) == (0, "Success")
    uuid.UUID(body["logId"])
    assert body["result"]["dataInfo"] == {"width": 640, "height": 480, "type": "image"}
    (item,) = body["result"]["ocrResults"]
    assert list(item) == ["prunedResult"]  # null fields omitted
    pruned = item["prunedResult"]
    for key in ("rec_texts", "rec_scores", "rec_polys", "rec_boxes", "dt_polys",
                "text_det_params", "text_rec_score_thresh", "model_settings"):  # fmt: skip
        assert key in pruned
    assert pruned["rec_texts"][0].startswith("This is a lot of 12 point text")
    assert len(pruned["rec_texts"]) == len(pruned["rec_polys"]) == len(pruned["rec_boxes"])
    x1, y1, x2, y2 = pruned["rec_boxes"][0]
    xs, ys = zip(*pruned["rec_polys"][0], strict=True)
    assert (x1, y1, x2, y2) == (min(xs), min(ys), max(xs), max(ys))
    assert pruned["text_det_params"]["limit_side_len"] == 960
    assert pruned["model_settings"] == {"use_doc_preprocessor": False,
                                        "use_textline_orientation": False}  # fmt: skip


def test_fresh_log_id_even_on_hits_and_shared_entry(client):
    data = b64(WORD_EN.read_bytes())
    first, second = ocr(client, file=data, fileType=1), ocr(client, file=data, fileType=1)
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("MISS", "HIT")
    assert second.headers["X-Cache-Tier"] in ("l1", "l2")
    assert first.get_json()["logId"] != second.get_json()["logId"]
    assert first.get_json()["result"] == second.get_json()["result"]
    # /v1/ocr with the default options reads the same entry.
    assert client.post("/v1/ocr", json={"image": data}).headers["X-Cache"] == "HIT"
    assert ocr(client, file=data, fileType=1, logId="abc").get_json()["logId"] == "abc"


def test_output_changing_options_are_part_of_the_key(client):
    data = b64(PHOTOTEST.read_bytes())
    assert ocr(client, file=data, fileType=1).headers["X-Cache"] == "MISS"
    # Spelling out the defaults is the same request.
    same = ocr(client, file=data, fileType=1, textDetLimitSideLen=960, textDetLimitType="max",
               useTextlineOrientation=False)  # fmt: skip
    assert same.headers["X-Cache"] == "HIT"
    other = ocr(client, file=data, fileType=1, textDetLimitSideLen=320)
    assert other.headers["X-Cache"] == "MISS"
    assert (
        other.get_json()["result"]["ocrResults"][0]["prunedResult"]["text_det_params"][
            "limit_side_len"
        ]
        == 320
    )
    oriented = ocr(client, file=data, fileType=1, useTextlineOrientation=True)
    assert oriented.headers["X-Cache"] == "MISS"
    # The recognition threshold only filters: same entry, fewer lines.
    strict = ocr(client, file=data, fileType=1, textRecScoreThresh=0.999)
    assert strict.headers["X-Cache"] == "HIT"
    pruned = strict.get_json()["result"]["ocrResults"][0]["prunedResult"]
    assert pruned["text_rec_score_thresh"] == 0.999
    assert len(pruned["rec_texts"]) < len(pruned["dt_polys"])
    assert all(score >= 0.999 for score in pruned["rec_scores"])


def test_visualize_by_default_rendered_from_the_cached_result(client, redis_client):
    data = b64(PHOTOTEST.read_bytes())
    assert list(ocr(client, file=data, fileType=1, visualize=False).get_json()["result"]
                ["ocrResults"][0]) == ["prunedResult"]  # fmt: skip
    resp = ocr(client, file=data, fileType=1)  # visualize defaults to true, as upstream
    assert resp.headers["X-Cache"] == "HIT"
    item = resp.get_json()["result"]["ocrResults"][0]
    assert list(item) == ["prunedResult", "ocrImage", "inputImage"]
    pictures = {k: Image.open(io.BytesIO(base64.b64decode(item[k]))) for k in list(item)[1:]}
    assert {p.format for p in pictures.values()} == {"JPEG"}
    assert pictures["inputImage"].size == (640, 480)
    shown = pictures["ocrImage"].convert("RGB")
    assert shown.size == (1280, 480)  # page with boxes, and the text panel beside it
    page, panel = shown.crop((0, 0, 640, 480)), shown.convert("L").crop((640, 0, 1280, 480))
    original = pictures["inputImage"].convert("RGB")
    tinted = ImageChops.difference(page, original).crop((40, 95, 570, 115))
    assert max(ImageStat.Stat(tinted).mean) > 20  # the first line's box is filled in colour
    assert max(ImageStat.Stat(ImageChops.difference(page, original).crop((0, 0, 640, 80))).mean) < 5
    assert panel.crop((0, 0, 640, 80)).getextrema()[0] > 200  # blank above the text
    assert panel.crop((36, 91, 579, 119)).getextrema()[0] < 100  # text written in the box
    (key,) = entry_keys(redis_client)
    assert len(redis_client.get(key)) < 4000  # no image stored


def test_visualize_can_be_off_service_wide(make_app):
    client = make_app(paddlex_visualize=False).test_client()
    data = b64(WORD_EN.read_bytes())
    assert list(ocr(client, file=data, fileType=1).get_json()["result"]["ocrResults"][0]) == [
        "prunedResult"
    ]
    asked = ocr(client, file=data, fileType=1, visualize=True).get_json()
    assert "ocrImage" in asked["result"]["ocrResults"][0]


def test_word_boxes_cached_under_their_own_parameters(client):
    data = b64(PHOTOTEST.read_bytes())
    plain = ocr(client, file=data, fileType=1, visualize=False)
    words = ocr(client, file=data, fileType=1, visualize=False, returnWordBox=True)
    assert (plain.headers["X-Cache"], words.headers["X-Cache"]) == ("MISS", "MISS")
    again = ocr(client, file=data, fileType=1, visualize=False, returnWordBox=True)
    assert again.headers["X-Cache"] == "HIT"
    pruned = words.get_json()["result"]["ocrResults"][0]["prunedResult"]
    assert pruned["return_word_box"] is True
    assert len(pruned["text_word"]) == len(pruned["text_word_boxes"]) == len(pruned["rec_texts"])
    assert pruned["text_word"][0][:3] == ["This", " ", "is"]
    x1, y1, x2, y2 = pruned["text_word_boxes"][0][0]
    line = pruned["rec_boxes"][0]
    assert line[0] <= x1 < x2 <= line[2] and line[1] <= y1 < y2 <= line[3]
    assert "text_word" not in plain.get_json()["result"]["ocrResults"][0]["prunedResult"]


def _pdf(*paths) -> bytes:  # type: ignore[no-untyped-def]
    pages = [Image.open(p).convert("RGB") for p in paths]
    buf = io.BytesIO()
    pages[0].save(buf, "PDF", resolution=72, save_all=True, append_images=pages[1:])
    return buf.getvalue()


def test_pdf_pages_with_a_page_limit(make_app):
    client = make_app(pdf_max_pages=2, pdf_render_scale=1.0).test_client()
    pdf = b64(_pdf(PHOTOTEST, WORD_EN, WORD_CH))
    resp = ocr(client, file=pdf, fileType=0)
    assert resp.status_code == 200, resp.get_json()
    result = resp.get_json()["result"]
    assert result["dataInfo"] == {
        "numPages": 2,
        "pages": [{"width": 640, "height": 480}, {"width": 114, "height": 34}],
        "type": "pdf",
    }
    texts = result["ocrResults"][0]["prunedResult"]["rec_texts"]
    assert texts[0].startswith("This is a lot of 12 point text")
    assert ocr(client, file=pdf, fileType=0).headers["X-Cache"] == "HIT"


@pytest.mark.parametrize(
    "body,message",
    [
        ({"file": "x" * 8}, "File type cannot be determined"),
        ({"fileType": 1}, "file"),
        ({"file": 5, "fileType": 1}, "file"),
        ({"file": "%%%", "fileType": 1}, "Invalid input file"),
        ({"file": b64(b"not an image"), "fileType": 1}, "Invalid input file"),
        ({"file": b64(b"not a pdf"), "fileType": 0}, "Invalid input file"),
        ({"file": "AAAA", "fileType": 2}, "fileType"),
        ({"file": "AAAA", "fileType": 1, "textDetLimitSideLen": 10**9}, "textDetLimitSideLen"),
        ({"file": "AAAA", "fileType": 1, "textDetLimitSideLen": "big"}, "textDetLimitSideLen"),
        ({"file": "AAAA", "fileType": 1, "textDetThresh": 7}, "textDetThresh"),
        ({"file": "AAAA", "fileType": 1, "textDetLimitType": "avg"}, "textDetLimitType"),
        ({"file": "AAAA", "fileType": 1, "useDocUnwarping": True}, "not available"),
        ({"file": "AAAA", "fileType": 1, "useDocOrientationClassify": True}, "not available"),
        ({"file": "AAAA", "fileType": 1, "visualize": "maybe"}, "visualize"),
        ({"file": "http://127.0.0.1:1/a.png"}, "URL input is disabled"),
    ],
)
def test_validation_errors_are_422(client, redis_client, body, message):
    resp = ocr(client, **body)
    assert resp.status_code == 422
    data = resp.get_json()
    assert data["errorCode"] == 422 and message in data["errorMsg"], data
    assert set(data) == {"logId", "errorCode", "errorMsg"}
    assert stored_keys(redis_client) == []


def test_not_json_is_422_with_the_error_list(client):
    resp = client.post("/ocr", data=b"{")
    assert resp.status_code == 422
    assert json.loads(resp.get_json()["errorMsg"]) == [
        {"type": "json_invalid", "loc": "body[1]", "msg": "JSON decode error"}
    ]


@pytest.mark.parametrize("method,path", [("GET", "/ocr"), ("POST", "/health")])
def test_wrong_method_on_paddlex_routes_uses_the_envelope(client, method, path):
    resp = client.open(path, method=method)
    assert resp.status_code == 405
    body = resp.get_json()
    assert (body["errorCode"], body["errorMsg"]) == (405, "Method Not Allowed")
    assert list(body) == ["logId", "errorCode", "errorMsg"]


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/redirect.png":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/")
            self.end_headers()
            return
        body = WORD_EN.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
        pass


def test_url_input_only_for_allowed_hosts_and_no_redirects(make_app):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    host = f"127.0.0.1:{server.server_port}"
    try:
        allowed = make_app(url_input_allowed_hosts=host).test_client()
        resp = ocr(allowed, file=f"http://{host}/word.png")
        assert resp.status_code == 200
        assert resp.get_json()["result"]["ocrResults"][0]["prunedResult"]["rec_texts"]
        redirect = ocr(allowed, file=f"http://{host}/redirect.png")
        assert redirect.status_code == 422 and "HTTP 302" in redirect.get_json()["errorMsg"]
        other = make_app(url_input_allowed_hosts="example.org").test_client()
        denied = ocr(other, file=f"http://{host}/word.png")
        assert denied.status_code == 422 and "not allowed" in denied.get_json()["errorMsg"]
    finally:
        server.shutdown()


def test_health(client):
    body = client.get("/health").get_json()
    assert (body["errorCode"], body["errorMsg"]) == (0, "Healthy") and body["logId"]
