import json
import time

import zstandard

from app.cache.codec import Codec
from app.cache.keys import KEY_SCHEMA, build_key, digest_image

RESULT = {"width": 10, "height": 5, "lines": [{"text": "é<&>", "score": 0.5, "box": [[0, 0]] * 4}]}


KEY = "ocr:v1:fp:ocr-x:{abc}"
KEYS = (("k2", b"\x01" * 32), ("k1", b"\x02" * 16))


def test_round_trip_plain_and_compressed():
    for threshold in (0, 1 << 20):
        value = Codec(threshold).encode(RESULT, "s" * 64, "fp", 60, KEY)
        assert value[:5] == (b"OCR1z" if threshold == 0 else b"OCR1j")
        entry = Codec(threshold).decode(value, "s" * 64, "fp", KEY)
        assert entry.result == RESULT and 55 < entry.expires_at - time.time() <= 60


def test_compression_shrinks_large_results():
    big = {**RESULT, "lines": RESULT["lines"] * 200}
    assert len(Codec(0).encode(big, "s", "fp", 60, KEY)) < len(json.dumps(big)) / 5


def test_unusable_values_are_misses():
    codec = Codec(0)
    good = codec.encode(RESULT, "sha", "fp", 60, KEY)
    plain = Codec(1 << 20).encode(RESULT, "sha", "fp", 60, KEY)
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
        assert codec.decode(value, "sha", "fp", KEY) is None
    assert codec.decode(good, "other-sha", "fp", KEY) is None  # another image (MD5 collision)
    assert codec.decode(good, "sha", "other-fp", KEY) is None  # another engine


def test_encrypted_values_are_unreadable_without_the_key():
    sealed = Codec(0, KEYS).encode(RESULT, "sha", "fp", 60, KEY)
    assert sealed[:5] == b"OCR1e" and b"rec" not in sealed and "é".encode() not in sealed
    assert Codec(0, KEYS).decode(sealed, "sha", "fp", KEY).result == RESULT
    assert Codec(0).decode(sealed, "sha", "fp", KEY) is None  # no key: a miss
    wrong = (("k2", b"\x03" * 32),)
    assert Codec(0, wrong).decode(sealed, "sha", "fp", KEY) is None  # wrong key: a miss
    assert Codec(0, KEYS).decode(sealed, "sha", "fp", "ocr:other-key") is None  # moved entry
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    assert Codec(0, KEYS).decode(tampered, "sha", "fp", KEY) is None


def test_keys_rotate_without_a_flush():
    old = Codec(0, (("k1", b"\x02" * 16),)).encode(RESULT, "sha", "fp", 60, KEY)
    rotated = Codec(0, KEYS)  # k2 now encrypts, k1 still decrypts
    assert rotated.decode(old, "sha", "fp", KEY).result == RESULT
    assert rotated.encode(RESULT, "sha", "fp", 60, KEY)[5:8] == b"\x02k2"


def test_plaintext_is_refused_once_encryption_is_on():
    """Whoever can write to Redis but lacks the key cannot plant a result."""
    forged = Codec(0).encode({**RESULT, "lines": []}, "sha", "fp", 60, KEY)
    assert Codec(0, KEYS).decode(forged, "sha", "fp", KEY) is None


def test_key_layout():
    digest = digest_image(b"abc")
    assert digest.md5 == "900150983cd24fb0d6963f7d28e17f72"
    key = build_key("ocr", "f" * 16, "ocr", digest)
    assert key == f"ocr:{KEY_SCHEMA}:{'f' * 16}:ocr:{{{digest.md5}}}"  # hash tag on the MD5
