"""Bad input over every protocol: a client error in the protocol's own form (REST 4xx JSON,
pipeline ``err_no`` with HTTP 200, PaddleX 422 envelope, gRPC ``err_no``), never a 5xx, a crash
or a cache entry, and the service stays ready. ``test_summary`` prints the cases per class."""

from __future__ import annotations

import base64
import io
import json
import struct
import time
import zlib
from collections import defaultdict
from typing import Any

import grpc
import pytest
from PIL import Image, PngImagePlugin

from app.imaging import ImageTooLarge, InvalidImage, decode_image
from app.protocols.pipeline_stubs import METHOD, pb2, pb2_grpc
from tests.conftest import WORD_CH, WORD_EN
from tests.helpers import entry_keys, stored_keys

pytestmark = pytest.mark.integration

# (protocol, input class) -> outcomes seen, e.g. {"400 invalid_image": 3}
TALLY: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --- crafted inputs ---------------------------------------------------------------------------


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` (8-bit RGB) over a few real rows."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = b"".join(b"\x00" + b"\xff" * 3 * max(1, min(width, 64)) for _ in range(4))
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(rows, 9))
        + _chunk(b"IEND", b"")
    )


def saved(fmt: str, mode: str = "RGB", size: tuple[int, int] = (40, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, "white").save(buf, fmt)
    return buf.getvalue()


def psd(width: int = 8, height: int = 4) -> bytes:
    """A minimal uncompressed RGB Photoshop file (Pillow reads PSD but cannot write it)."""
    header = struct.pack(">4sH6xHIIHH", b"8BPS", 1, 3, height, width, 8, 3)
    return header + b"\x00" * 12 + b"\x00\x00" + b"\x80" * (3 * width * height)


def pdf_page(mediabox: bytes) -> bytes:
    """A one-page PDF with the given MediaBox."""
    objs = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [" + mediabox + b"] >>",
    ]
    out, offsets = b"%PDF-1.4\n", []
    for i, obj in enumerate(objs):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % (i + 1) + obj + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 4\n0000000000 65535 f \n" + b"".join(b"%010d 00000 n \n" % o for o in offsets)
    return out + b"trailer\n<< /Size 4 /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % xref


BOMB = png_declaring(30000, 30000)  # 900 Mpx: Pillow's own limit refuses it when opening
BIG = png_declaring(10000, 10000)  # 100 Mpx: over MAX_IMAGE_PIXELS (60 Mpx), our own check
ONE_PIXEL = saved("PNG", size=(1, 1))
WORD_JPEG = WORD_CH.read_bytes()
WORD_PNG = WORD_EN.read_bytes()

# Formats Pillow would open (or try to) without the allow-list in app/imaging.py.
UNSUPPORTED: dict[str, bytes] = {
    "EPS": saved("EPS"),  # would run Ghostscript on load
    "PSD": psd(),
    "ICO": saved("ICO"),
    "PDF": saved("PDF"),
    "SVG": b'<svg xmlns="http://www.w3.org/2000/svg" width="40" height="20"/>',
    "TGA": saved("TGA"),
    "PCX": saved("PCX"),
    "SGI": saved("SGI"),
    "JPEG2000": saved("JPEG2000"),
    "QOI": saved("QOI"),
    "DIB": saved("DIB"),
    "XBM": saved("XBM", mode="1"),
}

# Image-level classes shared by every protocol: class -> list of (label, bytes).
BAD_IMAGES: dict[str, list[tuple[str, bytes]]] = {
    "non-image bytes": [
        ("text", b"plain text, not an image"),
        ("json", b'{"image": "x"}'),
        ("zeros", b"\x00" * 64),
    ],
    "truncated image": [
        ("jpeg half", WORD_JPEG[: len(WORD_JPEG) // 2]),
        ("jpeg header only", WORD_JPEG[:200]),
        ("png half", WORD_PNG[: len(WORD_PNG) // 2]),
        ("png signature only", WORD_PNG[:8]),
    ],
    "zero-size image": [
        ("png width 0", png_declaring(0, 10)),
        ("png height 0", png_declaring(10, 0)),
        ("png 0x0", png_declaring(0, 0)),
    ],
    "unsupported format": list(UNSUPPORTED.items()),
    "decompression bomb": [("png 30000x30000", BOMB), ("png 10000x10000", BIG)],
}
BAD_IMAGE_CASES = [
    pytest.param(cls, label, data, id=f"{cls}: {label}")
    for cls, items in BAD_IMAGES.items()
    for label, data in items
]


PROTOCOL = {"/v1/ocr": "REST /v1/ocr", "/ocr/prediction": "pipeline HTTP", "/ocr": "PaddleX /ocr"}


def record(protocol: str, cls: str, outcome: str) -> None:
    TALLY[(protocol, cls)][outcome] += 1


@pytest.fixture()
def client(make_app: Any) -> Any:
    return make_app().test_client()  # make_app waits until ready


def assert_ready_and_nothing_cached(client: Any, redis_client: Any) -> None:
    """Still ready after the bad input, and no entry (nor lease) was written for it."""
    assert client.get("/readyz").status_code == 200
    assert stored_keys(redis_client) == []


# --- the decoder itself -----------------------------------------------------------------------


def test_crafted_inputs_are_what_they_claim() -> None:
    assert len(BOMB) < 300 and struct.unpack(">II", BOMB[16:24]) == (30000, 30000)
    for name, data in UNSUPPORTED.items():
        if name in ("PDF", "SVG"):
            continue  # Pillow has no reader for these at all
        # Without the allow-list, Pillow would have picked its plugin for these bytes.
        assert Image.open(io.BytesIO(data)).format == name


def test_bomb_is_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoding(self: Any) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", no_decoding)
    for data, limit in ((BOMB, 60_000_000), (BIG, 60_000_000), (png_declaring(100, 100), 9_999)):
        started = time.perf_counter()
        with pytest.raises(ImageTooLarge, match="pixel"):
            decode_image(data, limit)
        assert time.perf_counter() - started < 0.5


def test_unsupported_formats_are_refused_by_name() -> None:
    for data in UNSUPPORTED.values():
        with pytest.raises(InvalidImage, match="accepted formats: JPEG, PNG"):
            decode_image(data, 60_000_000)


# --- REST /v1/ocr -----------------------------------------------------------------------------

REST_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("empty body", {"data": b""}, "invalid_json"),
    ("empty body", {"data": b"", "content_type": "application/json"}, "invalid_json"),
    ("empty body", {"data": b"", "content_type": "multipart/form-data"}, "missing_field"),
    ("invalid JSON", {"data": b"{not json"}, "invalid_json"),
    ("invalid JSON", {"data": b'{"image": "AAAA"'}, "invalid_json"),
    ("invalid JSON", {"data": b"\xff\xfe\x00"}, "invalid_json"),
    ("invalid JSON", {"data": b'{"image": "AAAA", "min_score": NaN}'}, "invalid_json"),
    ("invalid JSON", {"data": b'{"image": "AAAA", "min_score": 1e400}'}, "invalid_json"),
    ("wrong types", {"json": {"image": 42}}, "invalid_base64"),
    ("wrong types", {"json": {"image": ["AAAA"]}}, "invalid_base64"),
    ("wrong types", {"json": {"image": None}}, "invalid_base64"),
    ("wrong types", {"json": {"image": {"b64": "AAAA"}}}, "invalid_base64"),
    ("wrong types", {"json": [b64(WORD_PNG)]}, "missing_field"),
    ("wrong types", {"json": "image"}, "missing_field"),
    ("wrong types", {"json": {"image": b64(WORD_PNG), "min_score": "high"}}, "invalid_field"),
    ("wrong types", {"json": {"image": b64(WORD_PNG), "min_score": True}}, "invalid_field"),
    ("wrong types", {"json": {"image": b64(WORD_PNG), "min_score": [0.5]}}, "invalid_field"),
    ("missing fields", {"json": {}}, "missing_field"),
    ("missing fields", {"json": {"picture": b64(WORD_PNG)}}, "missing_field"),
    (
        "missing fields",
        {"data": {"min_score": "0.5"}, "content_type": "multipart/form-data"},
        "missing_field",
    ),
    ("missing fields", {"data": {"file": (b"", "a.png")}}, "empty_image"),
    ("invalid base64", {"json": {"image": "%%%not base64%%%"}}, "invalid_base64"),
    ("invalid base64", {"json": {"image": "AAA"}}, "invalid_base64"),
    ("invalid base64", {"json": {"image": "data:image/png,AAAA"}}, "invalid_base64"),
    ("invalid base64", {"json": {"image": "data:image/png;base64,@@"}}, "invalid_base64"),
    ("invalid base64", {"json": {"image": "ÄÖÜ="}}, "invalid_base64"),
    ("invalid base64", {"json": {"image": ""}}, "empty_image"),
    ("absurd options", {"json": {"image": b64(WORD_PNG), "min_score": -1}}, "invalid_field"),
    ("absurd options", {"json": {"image": b64(WORD_PNG), "min_score": 2}}, "invalid_field"),
    ("absurd options", {"json": {"image": b64(WORD_PNG), "min_score": 1e308}}, "invalid_field"),
    ("absurd options", {"json": {"image": b64(WORD_PNG), "min_score": -1e308}}, "invalid_field"),
    ("absurd options", {"json": {"image": b64(WORD_PNG), "min_score": 2**64 - 1}}, "invalid_field"),
] + [
    (
        "absurd options",
        {"data": {"file": (WORD_PNG, "a.png"), "min_score": text}},
        "invalid_field",
    )
    for text in ("nan", "inf", "-inf", "1e400", "", "0x1", "½")
]


@pytest.mark.parametrize("cls,kwargs,code", REST_REQUESTS)
def test_rest_bad_requests(client, redis_client, cls: str, kwargs: dict[str, Any], code: str):
    if isinstance(kwargs.get("data"), dict):  # multipart: a fresh stream for each file
        data = {
            k: (io.BytesIO(v[0]), v[1]) if isinstance(v, tuple) else v
            for k, v in kwargs["data"].items()
        }
        kwargs = {**kwargs, "data": data}
    resp = client.post("/v1/ocr", **kwargs)
    record("REST /v1/ocr", cls, f"{resp.status_code} {resp.get_json()['error']['code']}")
    assert resp.status_code == 400, resp.data
    body = resp.get_json()
    assert body["error"]["code"] == code and body["error"]["message"]
    assert "X-Cache" not in resp.headers
    assert_ready_and_nothing_cached(client, redis_client)


@pytest.mark.parametrize("cls,label,data", BAD_IMAGE_CASES)
def test_rest_bad_images(client, redis_client, cls: str, label: str, data: bytes):
    started = time.perf_counter()
    as_json = client.post("/v1/ocr", json={"image": b64(data)})
    as_file = client.post(
        "/v1/ocr", data={"file": (io.BytesIO(data), "x")}, content_type="multipart/form-data"
    )
    for resp in (as_json, as_file):
        record("REST /v1/ocr", cls, f"{resp.status_code} {resp.get_json()['error']['code']}")
        assert resp.status_code == 400, (label, resp.data)
        assert resp.get_json()["error"]["code"] == "invalid_image"
    if cls == "decompression bomb":
        assert "pixel" in as_json.get_json()["error"]["message"]
        assert time.perf_counter() - started < 2.0
    if cls == "unsupported format":
        assert "accepted formats" in as_json.get_json()["error"]["message"]
    assert_ready_and_nothing_cached(client, redis_client)


# --- Paddle Serving pipeline over HTTP --------------------------------------------------------

PIPELINE_REQUESTS: list[tuple[str, bytes, int]] = [
    ("empty body", b"", 5000),  # the gateway decodes it as an empty request
    ("wrong types", b'{"key": "image", "value": "AAAA"}', 7000),
    ("wrong types", b'{"key": ["image"], "value": [42]}', 7000),
    ("wrong types", b'{"key": [1], "value": ["AAAA"]}', 7000),
    ("wrong types", b'{"key": ["image"], "value": ["AAAA"], "logid": "x"}', 7000),
    ("wrong types", b'{"key": ["image"], "value": ["AAAA"], "logid": [1]}', 7000),
    ("wrong types", b'{"tensors": "image"}', 7000),
    ("wrong types", b'{"tensors": [{"name": "image", "elem_type": 13, "str_data": ["x"]}]}', 7000),
    ("wrong types", b'{"tensors": [{"name": "image", "elem_type": 1, "str_data": ["x"]}]}', 7000),
    ("wrong types", b'{"tensors": [{"name": "image", "elem_type": 12, "str_data": "x"}]}', 10000),
    ("wrong types", b'{"tensors": [{"name": "image", "elem_type": 12, "str_data": [1]}]}', 7000),
    ("missing fields", b"{}", 5000),
    ("missing fields", b'{"key": [], "value": []}', 5000),
    ("missing fields", b'{"key": ["image", "x"], "value": ["AAAA"]}', 8000),
    ("missing fields", b'{"key": ["pipeline.profile"], "value": ["1"]}', 5000),
    ("invalid base64", b'{"key": ["image"], "value": ["@@@@"]}', 10000),
    ("invalid base64", b'{"key": ["image"], "value": ["AAA"]}', 10000),
    ("invalid base64", b'{"key": ["image"], "value": [""]}', 10000),
    ("invalid base64", '{"key": ["image"], "value": ["ÄÖÜ="]}'.encode(), 10000),
]


def pipeline_post(client: Any, body: bytes, path: str = "/ocr/prediction") -> dict[str, Any]:
    resp = client.post(path, data=body)  # no Content-Type, as official clients send
    assert resp.status_code == 200 and "X-Cache" not in resp.headers
    parsed = json.loads(resp.data)
    assert list(parsed) == ["err_no", "err_msg", "key", "value", "tensors"]
    assert parsed["value"] == [] and parsed["err_msg"]
    return parsed


@pytest.mark.parametrize("cls,body,err_no", PIPELINE_REQUESTS)
def test_pipeline_bad_requests(client, redis_client, cls: str, body: bytes, err_no: int):
    parsed = pipeline_post(client, body)
    record("pipeline HTTP", cls, f"200 err_no {parsed['err_no']}")
    assert parsed["err_no"] == err_no, parsed
    assert_ready_and_nothing_cached(client, redis_client)


@pytest.mark.parametrize(
    "body", [b"{oops", b'{"key": ["image"], "value": [NaN]}', b"[1, 2]", b'"image"']
)
def test_pipeline_undecodable_bodies_answered_as_the_gateway_does(client, redis_client, body):
    resp = client.post("/ocr/prediction", data=body)
    assert resp.status_code == 400 and "X-Cache" not in resp.headers
    parsed = json.loads(resp.data)
    assert list(parsed) == ["error", "code", "message", "details"] and parsed["code"] == 3
    record("pipeline HTTP", "invalid JSON", "400 (gateway)")
    assert_ready_and_nothing_cached(client, redis_client)


@pytest.mark.parametrize("cls,label,data", BAD_IMAGE_CASES)
def test_pipeline_bad_images(client, redis_client, cls: str, label: str, data: bytes):
    kv = json.dumps({"key": ["image"], "value": [b64(data)], "logid": 9}).encode()
    tensor = {"name": "image", "elem_type": 12, "str_data": [b64(data)]}
    for body in (kv, json.dumps({"tensors": [tensor]}).encode()):
        parsed = pipeline_post(client, body)
        record("pipeline HTTP", cls, f"200 err_no {parsed['err_no']}")
        assert parsed["err_no"] == 10000, (label, parsed)
    assert_ready_and_nothing_cached(client, redis_client)


def test_pipeline_too_many_images_and_wrong_service(make_app, redis_client):
    client = make_app(max_images_per_request=2).test_client()
    for n in (3, 50):
        body = json.dumps({"key": [f"k{i}" for i in range(n)], "value": [b64(WORD_PNG)] * n})
        parsed = pipeline_post(client, body.encode())
        record("pipeline HTTP", "too many images", f"200 err_no {parsed['err_no']}")
        assert parsed["err_no"] == 5000 and "over the limit of 2" in parsed["err_msg"]
    parsed = pipeline_post(client, b'{"key": ["image"], "value": ["AAAA"]}', "/nope/prediction")
    record("pipeline HTTP", "wrong service name", f"200 err_no {parsed['err_no']}")
    assert parsed["err_no"] == 3002
    assert_ready_and_nothing_cached(client, redis_client)


# --- PaddleX /ocr -----------------------------------------------------------------------------

IMG = b64(WORD_PNG)
PADDLEX_REQUESTS: list[tuple[str, bytes | dict[str, Any]]] = [
    ("empty body", b""),
    ("invalid JSON", b"{oops"),
    ("invalid JSON", b"[1, 2]"),
    ("invalid JSON", b'"file"'),
    ("invalid JSON", b'{"file": "' + IMG.encode() + b'", "fileType": 1, "textDetThresh": NaN}'),
    (
        "invalid JSON",
        b'{"file": "' + IMG.encode() + b'", "fileType": 1, "textDetThresh": Infinity}',
    ),
    ("invalid JSON", b'{"file": "' + IMG.encode() + b'", "fileType": 1, "textDetThresh": 1e400}'),
    ("wrong types", {"file": 5, "fileType": 1}),
    ("wrong types", {"file": [IMG], "fileType": 1}),
    ("wrong types", {"file": IMG, "fileType": "1"}),
    # Upstream's lax types accept 1.0 or true for fileType 1, "yes" for true, "0.3" for 0.3
    # (tests/test_parity.py); these are what its validation refuses too.
    ("wrong types", {"file": IMG, "fileType": 1, "visualize": "maybe"}),
    ("wrong types", {"file": IMG, "fileType": 1, "logId": 5}),
    ("wrong types", {"file": IMG, "fileType": 1, "textDetLimitSideLen": "big"}),
    ("wrong types", {"file": IMG, "fileType": 1, "textDetLimitType": 5}),
    ("missing fields", {}),
    ("missing fields", {"fileType": 1}),
    ("missing fields", {"file": IMG}),  # base64 without fileType
    ("invalid base64", {"file": "%%%", "fileType": 1}),
    ("invalid base64", {"file": "AAA", "fileType": 1}),
    ("invalid base64", {"file": "", "fileType": 1}),
    ("invalid base64", {"file": "http://example.com/a.png", "fileType": 1}),  # URL input is off
    ("absurd options", {"file": IMG, "fileType": 2}),
    ("absurd options", {"file": IMG, "fileType": -1}),
] + [
    ("absurd options", {"file": IMG, "fileType": 1, name: value})
    for name, values in {
        "textDetLimitSideLen": [-1, 0, 15, 4097, 10**9, 2**64 - 1, -(2**63)],
        "textDetLimitType": ["avg", "", "MAX"],
        "textDetThresh": [-0.1, 1.5, 1e308, -1e308],
        "textDetBoxThresh": [-1, 2, 1e308],
        "textDetUnclipRatio": [0, -1, 10.5, 1e308],
        "textRecScoreThresh": [-0.01, 1.01, 1e308, 2**64 - 1],
        "useDocOrientationClassify": [True],
        "useDocUnwarping": [True],
    }.items()
    for value in values
]


def paddlex_post(client: Any, body: bytes | dict[str, Any]) -> dict[str, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = client.post("/ocr", data=raw)
    assert resp.status_code == 422, resp.data
    parsed = resp.get_json()
    assert list(parsed) == ["logId", "errorCode", "errorMsg"] and parsed["errorCode"] == 422
    assert parsed["errorMsg"] and "X-Cache" not in resp.headers
    return parsed


@pytest.mark.parametrize("cls,body", PADDLEX_REQUESTS)
def test_paddlex_bad_requests(client, redis_client, cls: str, body: bytes | dict[str, Any]):
    paddlex_post(client, body)
    record("PaddleX /ocr", cls, "422")
    assert_ready_and_nothing_cached(client, redis_client)


@pytest.mark.parametrize("cls,label,data", BAD_IMAGE_CASES)
def test_paddlex_bad_images(client, redis_client, cls: str, label: str, data: bytes):
    parsed = paddlex_post(client, {"file": b64(data), "fileType": 1, "logId": "bad-image"})
    assert parsed["logId"] == "bad-image"
    record("PaddleX /ocr", cls, "422")
    if label != "PDF":  # the same bytes announced as a PDF are not a readable PDF either
        paddlex_post(client, {"file": b64(data), "fileType": 0})
        record("PaddleX /ocr", cls, "422")
    assert_ready_and_nothing_cached(client, redis_client)


def test_paddlex_pdf_page_over_the_pixel_limit(client, redis_client):
    parsed = paddlex_post(client, {"file": b64(pdf_page(b"0 0 100000 100000")), "fileType": 0})
    assert "pixels" in parsed["errorMsg"]
    record("PaddleX /ocr", "decompression bomb", "422")
    assert_ready_and_nothing_cached(client, redis_client)


# --- bodies over MAX_REQUEST_BYTES ------------------------------------------------------------


class Unreadable(io.RawIOBase):
    """A request body that fails the test if anything reads it."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        raise AssertionError("the body was read")


class Endless(io.RawIOBase):
    """A streamed (chunked) body that never ends; counts what was read."""

    def __init__(self, byte: bytes = b"A") -> None:
        self.read_bytes = 0
        self.byte = byte

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        buffer[:] = self.byte * len(buffer)
        self.read_bytes += len(buffer)
        return len(buffer)


LIMIT = 4096
# What granian hands a chunked request: no length, a stream the server terminates.
CHUNKED = {"HTTP_TRANSFER_ENCODING": "chunked", "wsgi.input_terminated": True}
OVERSIZE_TARGETS = [
    ("/v1/ocr", "application/json"),
    ("/v1/ocr", "multipart/form-data; boundary=x"),
    ("/ocr/prediction", None),
    ("/ocr", "application/json"),
]


def _check_413(path: str, resp: Any) -> None:
    assert resp.status_code == 413, resp.data
    body = resp.get_json()
    if path == "/ocr":
        assert body["errorCode"] == 413 and str(LIMIT) in body["errorMsg"]
    else:
        assert body["error"]["code"] == "too_large"


@pytest.mark.parametrize("path,content_type", OVERSIZE_TARGETS)
def test_declared_oversize_body_is_413_unread(make_app, redis_client, path, content_type):
    client = make_app(max_request_bytes=LIMIT).test_client()
    for length in (LIMIT + 1, 1 << 40):
        environ = {"wsgi.input": Unreadable(), "CONTENT_LENGTH": str(length)}
        resp = client.post(path, content_type=content_type, environ_overrides=environ)
        _check_413(path, resp)
        record(PROTOCOL[path], "body over the limit (Content-Length)", "413")
    assert_ready_and_nothing_cached(client, redis_client)


@pytest.mark.parametrize("path,content_type", OVERSIZE_TARGETS)
def test_streamed_oversize_body_is_413_after_at_most_the_limit(
    make_app, redis_client, path, content_type
):
    client = make_app(max_request_bytes=LIMIT).test_client()
    stream = Endless(b"-" if content_type and "multipart" in content_type else b"A")
    environ = {"wsgi.input": stream, **CHUNKED}
    resp = client.post(path, content_type=content_type, environ_overrides=environ)
    _check_413(path, resp)
    assert stream.read_bytes <= LIMIT + 64 * 1024  # never the whole (endless) body
    record(PROTOCOL[path], "body over the limit (chunked)", "413")
    assert_ready_and_nothing_cached(client, redis_client)


def test_streamed_body_under_the_limit_is_read(make_app, redis_client):
    client = make_app(max_request_bytes=LIMIT).test_client()
    body = json.dumps({"image": b64(b"not an image")}).encode()
    environ = {"wsgi.input": io.BytesIO(body), **CHUNKED}
    resp = client.post("/v1/ocr", content_type="application/json", environ_overrides=environ)
    assert resp.status_code == 400 and resp.get_json()["error"]["code"] == "invalid_image"


def test_too_many_multipart_parts_is_413(client, redis_client):
    fields = "".join(
        f'--x\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\nv\r\n' for i in range(1100)
    )
    body = (fields + "--x--\r\n").encode()
    resp = client.post("/v1/ocr", data=body, content_type="multipart/form-data; boundary=x")
    record("REST /v1/ocr", "body over the limit (form parts)", str(resp.status_code))
    assert resp.status_code == 413
    assert_ready_and_nothing_cached(client, redis_client)


def test_wrong_method_is_405_with_allow(client, redis_client):
    for path in ("/v1/ocr", "/ocr"):
        resp = client.get(path)
        record(PROTOCOL[path], "wrong method", "405")
        assert resp.status_code == 405 and "POST" in resp.headers["Allow"]
        body = resp.get_json()
        if path == "/ocr":  # PaddleX's envelope, as upstream answers on its routes
            assert (body["errorCode"], body["errorMsg"]) == (405, "Method Not Allowed")
        else:
            assert body["error"]["code"] == "method_not_allowed"
    assert_ready_and_nothing_cached(client, redis_client)


# --- a valid 1x1 image is not an error ---------------------------------------------------------


def test_one_pixel_image_is_a_valid_empty_result(client, redis_client):
    resp = client.post("/v1/ocr", json={"image": b64(ONE_PIXEL)})
    assert resp.status_code == 200, resp.data
    body = resp.get_json()
    assert (body["width"], body["height"], body["lines"]) == (1, 1, [])
    parsed = json.loads(
        client.post(
            "/ocr/prediction", data=json.dumps({"key": ["image"], "value": [b64(ONE_PIXEL)]})
        ).data
    )
    assert (parsed["err_no"], parsed["value"]) == (0, ["[]"])
    px = client.post("/ocr", json={"file": b64(ONE_PIXEL), "fileType": 1}).get_json()
    assert px["errorCode"] == 0 and px["result"]["dataInfo"]["width"] == 1
    assert px["result"]["ocrResults"][0]["prunedResult"]["rec_texts"] == []
    for protocol in ("REST /v1/ocr", "pipeline HTTP", "PaddleX /ocr"):
        record(protocol, "1x1 image (valid)", "200 / err_no 0, no lines")
    assert client.get("/readyz").status_code == 200
    assert len(entry_keys(redis_client)) == 1  # a result, cached once for all protocols


# --- gRPC PipelineService ---------------------------------------------------------------------


def _grpc_cases() -> list[tuple[str, pb2.Request, int]]:
    img = b64(WORD_PNG)
    cases: list[tuple[str, Any, int]] = [
        ("empty body", pb2.Request(), 5000),
        ("missing fields", pb2.Request(key=["image", "x"], value=[img]), 8000),
        ("missing fields", pb2.Request(key=["pipeline.profile"], value=["1"]), 5000),
        (
            "wrong types",
            pb2.Request(tensors=[pb2.Tensor(name="image", elem_type=13, byte_data=b"\x80\x04")]),
            7000,
        ),
        (
            "wrong types",
            pb2.Request(tensors=[pb2.Tensor(name="image", elem_type=1, int64_data=[1])]),
            7000,
        ),
        ("invalid base64", pb2.Request(key=["image"], value=["@@@@"]), 10000),
        ("invalid base64", pb2.Request(key=["image"], value=["AAA"]), 10000),
        ("invalid base64", pb2.Request(key=["image"], value=[""]), 10000),
        ("wrong service name", pb2.Request(key=["image"], value=[img], name="det"), 3002),
    ]
    for param in BAD_IMAGE_CASES:
        cls, _, data = param.values
        cases.append((cls, pb2.Request(key=["image"], value=[b64(data)], logid=3), 10000))
    return cases


def _raw_grpc_cases() -> list[tuple[str, bytes, int]]:
    """Bytes that are not a valid pipeline Request message."""
    return [
        ("invalid protobuf", b"\xff\xff\xff\xff", 8000),
        ("invalid protobuf", b"\x0a\x05ima", 8000),  # truncated string field
        ("invalid protobuf", b"\x0a\x02\xff\xfe", 8000),  # key is not UTF-8
        ("invalid protobuf", b"\x12\x03\xc3\x28\x41", 8000),  # value is not UTF-8
        ("invalid protobuf", b"\x1a\x03\x08\x01", 8000),  # a tensor cut short
    ]


def test_grpc_bad_input_is_err_no_never_internal(grpc_front, redis_client):
    app, endpoint = grpc_front(max_images_per_request=2)
    channel = grpc.insecure_channel(endpoint)
    stub = pb2_grpc.PipelineServiceStub(channel)
    raw = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
    try:
        too_many = pb2.Request(key=["a", "b", "c"], value=[b64(WORD_PNG)] * 3)
        for cls, request, err_no in [*_grpc_cases(), ("too many images", too_many, 5000)]:
            reply = stub.inference(request, timeout=30)
            record("gRPC", cls, f"OK err_no {reply.err_no}")
            assert reply.err_no == err_no and reply.err_msg and not reply.value, (cls, reply)
        for cls, data, err_no in _raw_grpc_cases():
            reply = pb2.Response.FromString(raw(data, timeout=30))
            record("gRPC", cls, f"OK err_no {reply.err_no}")
            assert reply.err_no == err_no and "unpack" in reply.err_msg
    except grpc.RpcError as exc:  # INTERNAL / UNKNOWN would mean an unhandled exception
        pytest.fail(f"gRPC status {exc.code()}: {exc.details()}")
    finally:
        channel.close()
    assert_ready_and_nothing_cached(app.test_client(), redis_client)


def test_grpc_message_over_the_limit_is_resource_exhausted(grpc_front, redis_client):
    app, endpoint = grpc_front(grpc_max_message_bytes=1 << 20)
    with grpc.insecure_channel(endpoint) as channel:
        stub = pb2_grpc.PipelineServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.inference(pb2.Request(key=["image"], value=["A" * (2 << 20)]), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    record("gRPC", "body over the limit (message size)", "RESOURCE_EXHAUSTED")
    assert_ready_and_nothing_cached(app.test_client(), redis_client)


# --- summary ----------------------------------------------------------------------------------


def test_summary() -> None:
    """Print cases per (protocol, class) and their outcomes (visible with ``-s``)."""
    if not TALLY:
        pytest.skip("run with the tests above to count their cases")
    total = 0
    for (protocol, cls), outcomes in sorted(TALLY.items()):
        n = sum(outcomes.values())
        total += n
        seen = ", ".join(f"{k} x{v}" for k, v in sorted(outcomes.items()))
        print(f"bad input: {protocol:24s} {cls:40s} {n:4d}  {seen}")
    print(f"bad input: {total} cases, none answered 5xx / INTERNAL / UNKNOWN")
    for outcomes in TALLY.values():
        assert not any(k.startswith("5") for k in outcomes)
