"""Property tests over the request parsers and the image decoder (hypothesis).

Whatever the input, each parser either returns a well-formed request or raises its protocol's
client error (``BadRequest``, ``PipelineError``, ``GatewayError``, ``InvalidImage``/
``ImageTooLarge``), never anything else: anything else would be a 5xx. Runs are deterministic
(``derandomize``, no example database) and bounded; ``test_examples_were_run`` reports how many
examples each property saw. ``make test`` runs 300 (400 for images) per property; ``make
test-fast``, the loop run on every edit, a third of that (``FUZZ_PARSER_SCALE``).
"""

from __future__ import annotations

import base64
import io
import math
import os
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from flask import Request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from werkzeug.test import EnvironBuilder

from app.imaging import DecodedImage, InvalidImage, decode_image
from app.protocols import paddlex, pipeline, pipeline_http, rest
from app.protocols.b64 import decode_base64
from app.protocols.errors import BadRequest
from app.protocols.pipeline import PipelineError, PipelineRequest, Tensor
from app.vocabulary import OcrParams
from tests.conftest import SHORT, WORD_CH, WORD_EN

pytestmark = pytest.mark.unit

SCALE = float(os.environ.get("FUZZ_PARSER_SCALE", "1"))
MAX_EXAMPLES = int(300 * SCALE)
MAX_IMAGE_EXAMPLES = int(400 * SCALE)
FUZZ = settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FUZZ_IMAGES = settings(FUZZ, max_examples=MAX_IMAGE_EXAMPLES)
MAX_PIXELS = 4_000_000  # mutated headers may declare anything; keep refusals cheap

RUN: Counter[str] = Counter()  # examples run per property

# --- strategies -----------------------------------------------------------------------------

# What a JSON body can hold (orjson refuses ints outside 64 bits, NaN and Infinity).
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=24)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
edge_numbers = st.sampled_from(
    [
        0,
        1,
        -1,
        0.0,
        1.0,
        -0.0,
        1e-300,
        1e300,
        -1e300,
        2**63 - 1,
        2**64 - 1,
        -(2**63),
        0.5,
        15,
        16,
        4096,
        4097,
        10,
        10.000001,
        1.0000001,
        True,
        False,
    ]
)
SMALL_IMAGES = [WORD_EN.read_bytes(), SHORT.read_bytes()]
base64_texts = (
    st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode())
    | st.sampled_from([base64.b64encode(d).decode() for d in SMALL_IMAGES])
    | st.text(
        alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=\n -_",
        max_size=40,
    )
    | st.binary(max_size=32).map(lambda b: "data:image/png;base64," + base64.b64encode(b).decode())
    | st.text(max_size=24)
)


def field_values(*valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Plausible values for a field, edge numbers, and anything JSON can hold."""
    return st.one_of(*valid, edge_numbers, json_values)


def count(name: str) -> None:
    RUN[name] += 1


def flask_request(**kwargs: Any) -> Request:
    return Request(EnvironBuilder(method="POST", path="/v1/ocr", **kwargs).get_environ())


# --- REST /v1/ocr -----------------------------------------------------------------------------

rest_bodies = (
    st.fixed_dictionaries(
        {},
        optional={
            "image": field_values(base64_texts),
            "min_score": field_values(st.floats(0, 1), st.text(max_size=8)),
        },
    )
    | json_values
)


def check_rest(parse: Callable[[], rest.RestRequest]) -> None:
    try:
        parsed = parse()
    except BadRequest as exc:
        assert exc.code and str(exc)
        return
    data, min_score = parsed.data, parsed.min_score
    assert isinstance(data, bytes) and data
    assert isinstance(min_score, float) and 0.0 <= min_score <= 1.0


@FUZZ
@given(body=rest_bodies, content_type=st.sampled_from(["application/json", "text/plain", None]))
def test_rest_json_bodies(body: Any, content_type: str | None) -> None:
    count("rest.parse (JSON)")
    req = flask_request(data=orjson.dumps(body), content_type=content_type)
    check_rest(lambda: rest.parse(req, 0.5))


@FUZZ
@given(body=st.binary(max_size=256))
def test_rest_raw_bodies(body: bytes) -> None:
    count("rest.parse (raw bytes)")
    req = flask_request(data=body, content_type="application/json")
    check_rest(lambda: rest.parse(req, 0.5))


score_texts = st.sampled_from(
    ["nan", "NaN", "inf", "-inf", "1e400", "-0", "0x1", "", " 0.5 ", "1_0"]
)


@FUZZ
@given(
    file=st.none() | st.binary(max_size=64) | st.sampled_from(SMALL_IMAGES),
    min_score=st.none() | score_texts | st.text(max_size=10) | st.floats().map(str),
    extra=st.dictionaries(st.text(min_size=1, max_size=6), st.text(max_size=6), max_size=2),
)
def test_rest_multipart_bodies(
    file: bytes | None, min_score: str | None, extra: dict[str, str]
) -> None:
    count("rest.parse (multipart)")
    data: dict[str, Any] = dict(extra)
    if file is not None:
        data["file"] = (io.BytesIO(file), "upload.bin")
    if min_score is not None:
        data["min_score"] = min_score
    req = flask_request(data=data, content_type="multipart/form-data")
    check_rest(lambda: rest.parse(req, 0.5))


# --- PaddleX /ocr ---------------------------------------------------------------------------

paddlex_bodies = (
    st.fixed_dictionaries(
        {},
        optional={
            "file": field_values(base64_texts, st.just("http://example.com/a.png")),
            "fileType": field_values(st.sampled_from([0, 1, 2, None])),
            "useDocOrientationClassify": field_values(st.booleans()),
            "useDocUnwarping": field_values(st.booleans()),
            "useTextlineOrientation": field_values(st.booleans()),
            "textDetLimitSideLen": field_values(st.integers(0, 10_000)),
            "textDetLimitType": field_values(st.sampled_from(["min", "max", "avg", ""])),
            "textDetThresh": field_values(st.floats(-1, 2)),
            "textDetBoxThresh": field_values(st.floats(-1, 2)),
            "textDetUnclipRatio": field_values(st.floats(-1, 11)),
            "textRecScoreThresh": field_values(st.floats(-1, 2)),
            "returnWordBox": field_values(st.booleans()),
            "visualize": field_values(st.booleans()),
            "logId": field_values(st.text(max_size=200)),
        },
    )
    | json_values
)


def check_paddlex(body: bytes) -> None:
    try:
        req = paddlex.parse(body, OcrParams(), 0.0)
    except BadRequest as exc:
        assert str(exc)
        return
    assert isinstance(req.file, str) and req.file_type in (None, 0, 1)
    p = req.params
    assert isinstance(p.det_limit_side_len, int) and 16 <= p.det_limit_side_len <= 4096
    assert p.det_limit_type in ("min", "max")
    assert 0.0 <= p.det_thresh <= 1.0 and 0.0 <= p.det_box_thresh <= 1.0
    assert 0.0 < p.det_unclip_ratio <= 10.0 and isinstance(p.textline_orientation, bool)
    assert 0.0 <= req.rec_score_thresh <= 1.0 and math.isfinite(req.rec_score_thresh)
    assert req.visualize in (None, True, False) and isinstance(req.log_id, str)
    assert len(req.log_id) <= 128


@FUZZ
@given(body=paddlex_bodies)
def test_paddlex_json_bodies(body: Any) -> None:
    count("paddlex.parse (JSON)")
    check_paddlex(orjson.dumps(body))


@FUZZ
@given(
    body=st.binary(max_size=256)
    | st.sampled_from(
        [
            b"NaN",
            b"Infinity",
            b"1e400",
            b'{"file": "A", "textDetThresh": 1e400}',
            b'{"file": "A", "textDetThresh": NaN}',
            b"\xef\xbb\xbf{}",
            b"",
            b"{",
        ]
    )
)
def test_paddlex_raw_bodies(body: bytes) -> None:
    count("paddlex.parse (raw bytes)")
    check_paddlex(body)


# --- Paddle Serving pipeline (HTTP parse and the shared build_request) ------------------------

text_lists = st.lists(
    st.sampled_from(["image", "pipeline.profile", "x", ""]) | st.text(max_size=6), max_size=4
)
tensor_objects = st.fixed_dictionaries(
    {},
    optional={
        "name": field_values(st.sampled_from(["image", "img2"])),
        "elem_type": field_values(st.sampled_from([12, 13, 0, 1])),
        "str_data": field_values(st.lists(base64_texts, max_size=3)),
    },
)
pipeline_bodies = (
    st.fixed_dictionaries(
        {},
        optional={
            "key": field_values(text_lists),
            "value": field_values(st.lists(base64_texts, max_size=4)),
            "tensors": field_values(st.lists(tensor_objects, max_size=3)),
            "logid": field_values(st.integers(-(2**63), 2**64 - 1)),
            "clientip": field_values(st.text(max_size=80)),
        },
    )
    | json_values
)


def check_pipeline(parse: Callable[[], PipelineRequest]) -> None:
    try:
        req = parse()
    except PipelineError as exc:
        assert exc.err_no in (
            pipeline.INPUT_PARAMS_ERROR,
            pipeline.TYPE_ERROR,
            pipeline.PACKING_ERROR,
        )
        assert str(exc)
        return
    except pipeline_http.GatewayError as exc:  # HTTP 400 in the gateway's form
        assert str(exc)
        return
    assert req.images and all(isinstance(k, str) and isinstance(v, str) for k, v in req.images)
    assert isinstance(req.logid, int) and isinstance(req.clientip, str)
    assert len(req.clientip) <= 64


@FUZZ
@given(body=pipeline_bodies)
def test_pipeline_http_json_bodies(body: Any) -> None:
    count("pipeline_http.parse (JSON)")
    check_pipeline(lambda: pipeline_http.parse(orjson.dumps(body)))


@FUZZ
@given(body=st.binary(max_size=256))
def test_pipeline_http_raw_bodies(body: bytes) -> None:
    count("pipeline_http.parse (raw bytes)")
    check_pipeline(lambda: pipeline_http.parse(body))


# Anything a caller (HTTP JSON or gRPC protobuf) could hand build_request, and more.
python_values = st.recursive(
    scalars | st.floats() | st.binary(max_size=8) | st.integers(),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner),
    max_leaves=8,
)
tensors = st.builds(
    Tensor,
    name=st.sampled_from(["image", ""]) | python_values,
    elem_type=st.sampled_from([12, 13, 0]) | python_values,
    str_data=st.lists(base64_texts, max_size=3) | python_values,
)


@FUZZ
@given(
    keys=text_lists | python_values,
    values=st.lists(base64_texts, max_size=4) | python_values,
    tensor_list=st.lists(tensors, max_size=3),
    logid=st.integers() | st.sampled_from([math.inf, -math.inf, math.nan]) | python_values,
    clientip=st.text(max_size=80) | python_values,
)
def test_pipeline_build_request(
    keys: Any, values: Any, tensor_list: list[Tensor], logid: Any, clientip: Any
) -> None:
    count("pipeline.build_request")
    check_pipeline(lambda: pipeline.build_request(keys, values, tensor_list, logid, clientip))


# --- base64 ---------------------------------------------------------------------------------


@FUZZ
@given(text=base64_texts | python_values, strict=st.booleans())
def test_decode_base64(text: Any, strict: bool) -> None:
    count("b64.decode_base64")
    try:
        data = decode_base64(text, strict=strict)
    except BadRequest as exc:
        assert exc.code in ("invalid_base64", "empty_image")
        return
    assert isinstance(data, bytes) and data


@FUZZ
@given(data=st.binary(min_size=1, max_size=128), wrap=st.booleans())
def test_decode_base64_round_trips(data: bytes, wrap: bool) -> None:
    count("b64.decode_base64 (round trip)")
    text = (base64.encodebytes(data) if wrap else base64.b64encode(data)).decode()
    assert decode_base64(text) == data
    assert decode_base64(text, strict=False) == data


# --- image decoding -------------------------------------------------------------------------


def _variants() -> list[bytes]:
    """Real images from the corpus, and the same word re-encoded in every accepted format."""
    source = Image.open(WORD_EN)
    out = [WORD_EN.read_bytes(), WORD_CH.read_bytes(), SHORT.read_bytes()]
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: exercises exif_transpose
    encodings: list[tuple[str, dict[str, Any]]] = [
        ("JPEG", {"exif": exif}),
        ("BMP", {}),
        ("TIFF", {"compression": "tiff_lzw"}),
        ("GIF", {}),
        ("WEBP", {}),
        ("PPM", {}),
        ("PNG", {"exif": exif}),
    ]
    for fmt, extra in encodings:
        buf = io.BytesIO()
        source.save(buf, fmt, **extra)
        out.append(buf.getvalue())
    return out


VARIANTS = _variants()


@st.composite
def mutated_images(draw: st.DrawFn) -> bytes:
    """A real image with a few bytes overwritten, a slice inserted, and/or truncated."""
    data = bytearray(draw(st.sampled_from(VARIANTS)))
    for _ in range(draw(st.integers(0, 6))):
        # Headers live at the start: bias positions there.
        pos = draw(st.integers(0, min(len(data) - 1, 64)) | st.integers(0, len(data) - 1))
        data[pos] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        pos = draw(st.integers(0, len(data)))
        data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


def check_decode(data: bytes) -> None:
    try:
        image = decode_image(data, MAX_PIXELS)
    except InvalidImage as exc:
        assert str(exc)
        return
    assert isinstance(image, DecodedImage)
    assert image.pixels.shape == (image.height, image.width, 3)
    assert 1 <= image.width * image.height <= MAX_PIXELS


@FUZZ_IMAGES
@given(data=st.binary(max_size=512))
def test_decode_image_random_bytes(data: bytes) -> None:
    count("imaging.decode_image (random bytes)")
    check_decode(data)


@FUZZ_IMAGES
@given(data=mutated_images())
def test_decode_image_mutated_real_images(data: bytes) -> None:
    count("imaging.decode_image (mutated images)")
    check_decode(data)


@FUZZ
@given(
    magic=st.sampled_from(
        [
            b"\x89PNG\r\n\x1a\n",
            b"\xff\xd8\xff",
            b"GIF89a",
            b"BM",
            b"II*\x00",
            b"MM\x00*",
            b"RIFF\x00\x00\x00\x00WEBPVP8 ",
            b"P6\n",
            b"%!PS-Adobe-3.0 EPSF-3.0\n",
            b"8BPS",
            b"\x00\x00\x01\x00",
            b"%PDF-1.4\n",
            b"<svg",
            b"\x00\x00\x00\x0cjP  ",
        ]
    ),
    tail=st.binary(max_size=128),
)
def test_decode_image_format_magic_with_garbage(magic: bytes, tail: bytes) -> None:
    count("imaging.decode_image (format magic + garbage)")
    check_decode(magic + tail)


def test_examples_were_run() -> None:
    """Every property ran a real number of examples (hypothesis can end a property early
    when its strategy cannot generate, and would pass it); counts visible with ``-s``."""
    ran = dict(RUN)
    if not ran:
        pytest.skip("run with the property tests above to count their examples")
    for name, n in sorted(ran.items()):
        print(f"hypothesis examples: {n:5d}  {name}")
    print(f"hypothesis examples: {sum(ran.values()):5d}  total")
    source = Path(__file__).read_text()
    declared = set(re.findall(r'^    count\("([^"]+)"\)', source, re.M))
    assert set(ran) == declared, declared ^ set(ran)  # -k selected all of them, or none
    assert min(ran.values()) >= min(MAX_EXAMPLES, MAX_IMAGE_EXAMPLES) // 2, ran
