import json
import time

import zstandard

from app.cache import codec
from app.cache.keys import KEY_SCHEMA, build_key, digest_image

RESULT = {"width": 10, "height": 5, "lines": [{"text": "é<&>", "score": 0.5, "box": [[0, 0]] * 4}]}


def test_round_trip_plain_and_compressed():
    for threshold in (0, 1 << 20):
        value = codec.encode(RESULT, "s" * 64, "fp", threshold, 60)
        assert value[:5] == (b"OCR1z" if threshold == 0 else b"OCR1j")
        entry = codec.decode(value, "s" * 64, "fp")
        assert entry.result == RESULT and 55 < entry.expires_at - time.time() <= 60


def test_compression_shrinks_large_results():
    big = {**RESULT, "lines": RESULT["lines"] * 200}
    assert len(codec.encode(big, "s", "fp", 0, 60)) < len(json.dumps(big)) / 5


def test_unusable_values_are_misses():
    good = codec.encode(RESULT, "sha", "fp", 0, 60)
    plain = codec.encode(RESULT, "sha", "fp", 1 << 20, 60)
    foreign = b"OCR1j" + json.dumps({"v": 99, "sha256": "sha", "fp": "fp", "result": {}}).encode()
    for value in (
        None,
        b"",
        b"garbage",
        good[:-7],  # truncated
        good[:5] + b"\x00" * 20,  # corrupt payload
        b"OCR1x" + good[5:],  # unknown codec
        plain[:-1],  # truncated JSON
        foreign,  # another schema
        b"OCR1z" + zstandard.ZstdCompressor().compress(b"[1, 2]"),  # not an envelope
    ):
        assert codec.decode(value, "sha", "fp") is None
    assert codec.decode(good, "other-sha", "fp") is None  # another image (e.g. MD5 collision)
    assert codec.decode(good, "sha", "other-fp") is None  # another engine


def test_key_layout():
    digest = digest_image(b"abc")
    assert digest.md5 == "900150983cd24fb0d6963f7d28e17f72"
    key = build_key("ocr", "f" * 16, "ocr", digest)
    assert key == f"ocr:{KEY_SCHEMA}:{'f' * 16}:ocr:{{{digest.md5}}}"  # hash tag on the MD5
