"""What the official examples do, step by step, against the service over real HTTP and gRPC
(written here from their documented steps; host and port are the only changes):

- PaddleOCR 3.x docs, serving ``/ocr`` Python client: post ``{"file", "fileType": 1}`` with
  ``requests``, print each ``prunedResult`` and write each ``ocrImage`` (base64 JPEG) to a file.
- PaddleOCR ``deploy/pdserving`` HTTP client: post ``{"key": ["image"], "value": [b64]}`` as
  a JSON string without a Content-Type, then turn ``value[0]`` into Python objects with
  ``eval`` (here the ``eval``-compatible ``ast.literal_eval``) and print text, score and box.
- The pdserving RPC client: Paddle Serving's own ``PipelineClient`` (tests/stock_client.py).
"""

from __future__ import annotations

import ast
import base64
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from PIL import Image
from werkzeug.serving import make_server

from tests.conftest import CORPUS, PHOTOTEST, run_stock_client

pytestmark = pytest.mark.integration

IMAGES = [PHOTOTEST, CORPUS / "paddleocr_doc_11.jpg", CORPUS / "paddleocr_word_ch_4.jpg"]


@pytest.fixture()
def live_url(make_app) -> Iterator[str]:  # type: ignore[no-untyped-def]
    server = make_server("127.0.0.1", 0, make_app(), threaded=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join(timeout=10)


@pytest.mark.parametrize("image_path", IMAGES, ids=lambda p: p.name)
def test_docs_ocr_client_writes_the_ocr_image(live_url, tmp_path: Path, image_path: Path):
    file_data = base64.b64encode(image_path.read_bytes()).decode("ascii")
    response = requests.post(f"{live_url}/ocr", json={"file": file_data, "fileType": 1})
    assert response.status_code == 200
    result = response.json()["result"]
    for i, res in enumerate(result["ocrResults"]):
        print(res["prunedResult"])
        ocr_img_path = tmp_path / f"ocr_{i}.jpg"
        with open(ocr_img_path, "wb") as f:
            f.write(base64.b64decode(res["ocrImage"]))
        with Image.open(ocr_img_path) as written:
            page = Image.open(image_path)
            assert written.format == "JPEG"
            assert written.size == (2 * page.width, page.height)
    assert len(result["ocrResults"]) == 1


@pytest.mark.parametrize("image_path", IMAGES, ids=lambda p: p.name)
def test_pdserving_http_client_parses_value(live_url, image_path: Path):
    image = base64.b64encode(image_path.read_bytes()).decode("utf8")
    data = {"key": ["image"], "value": [image]}
    r = requests.post(url=f"{live_url}/ocr/prediction", data=json.dumps(data))
    result = r.json()
    assert result["err_no"] == 0, result
    ocr_result = ast.literal_eval(result["value"][0])
    for item in ocr_result:
        print(item[0][0], item[0][1], item[1])
        text, score = item[0]
        assert isinstance(text, str) and 0.5 <= score <= 1.0
        assert len(item[1]) == 4 and all(len(point) == 2 for point in item[1])
    if image_path == PHOTOTEST:
        assert ocr_result[0][0][0].startswith("This is a lot of 12 point text")


def test_pdserving_http_client_with_an_extra_feed_key(live_url):
    image = base64.b64encode(PHOTOTEST.read_bytes()).decode("utf8")
    data = {"key": ["image", "request_id"], "value": [image, "req-42"]}
    result = requests.post(url=f"{live_url}/ocr/prediction", data=json.dumps(data)).json()
    assert result["err_no"] == 0 and result["key"] == ["result"], result
    assert ast.literal_eval(result["value"][0])


def test_pdserving_rpc_client(grpc_front, stock_client_dir):
    _, endpoint = grpc_front()
    (answer,) = run_stock_client(stock_client_dir, endpoint, PHOTOTEST, "sync")
    assert answer["err_no"] == 0 and answer["key"] == ["result"], answer
    ocr_result = ast.literal_eval(answer["value"][0])
    assert ocr_result[0][0][0].startswith("This is a lot of 12 point text")
