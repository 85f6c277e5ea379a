"""Decoding is bounded in time and memory, and any decoder failure is a client error
(issue 11 §3), over every protocol. Inputs are generated here (``tests/hostile_images.py``)
and by the mutation fuzzer (``tests/image_fuzz.py``)."""

from __future__ import annotations

import base64
import io
from typing import Any

import grpc
import pytest
from PIL import Image, ImageFile, ImageOps

from app import imaging
from app.imaging import ImageTooLarge, InvalidImage, decode_image
from app.protocols.pipeline_stubs import pb2, pb2_grpc
from tests.helpers import b64, stored_keys
from tests.hostile_images import jpeg_with_scans, png_declaring
from tests.image_fuzz import FOUND, case

pytestmark = pytest.mark.unit

LIMIT = 60_000_000  # the default MAX_IMAGE_PIXELS

# Refused from the header or the marker walk, before any pixel is decoded.
TOO_COSTLY: dict[str, bytes] = {
    "PNG 1x60,000,000 (within the pixel limit)": png_declaring(1, 60_000_000),
    "PNG 60,000,000x1": png_declaring(60_000_000, 1),
    "PNG 20,001x2,000 (a side over the cap)": png_declaring(20_001, 2_000),
    "PNG 1x201 (aspect ratio over 200:1)": png_declaring(1, 201),
    "PNG 30,000x150": png_declaring(30_000, 150),
    "JPEG with 10,000 scans (3000x3000, 628 KB)": jpeg_with_scans(10_000, (3000, 3000)),
    "JPEG with 101 scans": jpeg_with_scans(imaging.MAX_JPEG_SCANS + 1),
}
# What Pillow raised on these was not OSError/ValueError: they escaped as 500 before.
DECODER_FAILURES: dict[str, bytes] = {label: case(2, index)[1] for label, index in FOUND.items()}
HOSTILE = {**TOO_COSTLY, **DECODER_FAILURES}


def test_generated_inputs_are_what_they_claim() -> None:
    assert Image.open(io.BytesIO(TOO_COSTLY["PNG 1x60,000,000 (within the pixel limit)"])).size == (
        1,
        60_000_000,
    )
    assert len(png_declaring(1, 60_000_000)) < 200
    scans = jpeg_with_scans(10_000, (3000, 3000))
    assert scans.count(b"\xff\xda") == 10_000 and len(scans) < 700_000
    assert Image.open(io.BytesIO(scans)).size == (3000, 3000)
    for label, data in DECODER_FAILURES.items():
        with pytest.raises(Exception) as raised:  # noqa: PT011 - exactly what we check
            img = Image.open(io.BytesIO(data))
            img.load()
            ImageOps.exif_transpose(img)
        assert not isinstance(raised.value, OSError | ValueError), (label, raised.value)


@pytest.mark.parametrize("label", list(TOO_COSTLY))
def test_too_costly_is_refused_before_decoding(label: str, monkeypatch: pytest.MonkeyPatch):
    def no_decoding(self: Any) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(ImageTooLarge):
        decode_image(TOO_COSTLY[label], LIMIT)


@pytest.mark.parametrize("label", list(DECODER_FAILURES))
def test_decoder_failures_are_invalid_images(label: str) -> None:
    with pytest.raises(InvalidImage, match="not a decodable image"):
        decode_image(DECODER_FAILURES[label], LIMIT)


@pytest.mark.parametrize(
    "size", [(1, 200), (200, 1), (20_000, 100), (100, 20_000), (1, 1)], ids=str
)
def test_sizes_at_the_caps_are_decoded(size: tuple[int, int]) -> None:
    image = decode_image(png_declaring(*size, rows=size[1]), LIMIT)
    assert (image.width, image.height) == size and image.pixels.shape == (size[1], size[0], 3)


def test_ordinary_progressive_jpeg_is_decoded() -> None:
    buf = io.BytesIO()
    Image.radial_gradient("L").convert("RGB").save(buf, "JPEG", progressive=True)
    assert decode_image(buf.getvalue(), LIMIT).width == 256


def test_pdf_page_of_extreme_aspect_is_refused_before_rendering() -> None:
    from app.pdf import render_pages
    from tests.test_bad_input import pdf_page

    with pytest.raises(ImageTooLarge, match="aspect ratio"):
        render_pages(pdf_page(b"0 0 1 5000"), 1, 2.0, LIMIT)


@pytest.mark.integration
def test_hostile_images_over_every_protocol(grpc_front, redis_client) -> None:
    """Each input over REST (JSON and multipart), pipeline HTTP, PaddleX and gRPC: the
    protocol's own client error, nothing cached, still ready."""
    app, endpoint = grpc_front()
    client = app.test_client()
    stub = pb2_grpc.PipelineServiceStub(grpc.insecure_channel(endpoint))
    for label, data in HOSTILE.items():
        rest = client.post("/v1/ocr", json={"image": b64(data)})
        assert rest.status_code == 400, (label, rest.get_json())
        assert rest.get_json()["error"]["code"] == "invalid_image"
        form = client.post(
            "/v1/ocr", data={"file": (io.BytesIO(data), "x")}, content_type="multipart/form-data"
        )
        assert form.status_code == 400, (label, form.get_json())
        pipeline = client.post("/ocr/prediction", json={"key": ["image"], "value": [b64(data)]})
        assert pipeline.status_code == 200 and pipeline.get_json()["err_no"] == 10000, label
        paddlex = client.post("/ocr", json={"file": b64(data), "fileType": 1})
        assert paddlex.status_code == 422 and paddlex.get_json()["errorCode"] == 422, label
        request = pb2.Request(key=["image"], value=[base64.b64encode(data).decode()])
        reply = stub.inference(request, timeout=60)
        assert reply.err_no == 10000, (label, reply.err_msg)
    assert stored_keys(redis_client) == []
    assert client.get("/readyz").status_code == 200
