import hashlib
import json
import struct
import time

import numpy as np
import orjson
import pytest
import zstandard

from app.cache import compact, dictionaries
from app.cache.codec import ENVELOPE_VERSION, MAGIC, Codec, plaintext
from app.cache.keys import KEY_SCHEMA, build_key, digest_image
from app.vocabulary import OcrLine, OcrResult

pytestmark = pytest.mark.unit


def _f32(x: float) -> float:
    return float(np.float32(x))


RESULT = OcrResult(
    10,
    5,
    (
        OcrLine("é<&>", _f32(0.912345678), ((0, 0), (9, 0), (9, 4), (0, 4)), 0),
        OcrLine(
            "two words",
            _f32(0.5),
            ((1, 1), (8, 1), (8, 3), (1, 3)),
            -1,
            (("two", (1, 1, 4, 3)), ("words", (5, 1, 8, 3))),
        ),
    ),
)
TEXT_RESULT = OcrResult(800, 600, (), '{"name": "Ada"}')
SHA = hashlib.sha256(b"image").hexdigest()
OTHER_SHA = hashlib.sha256(b"other image").hexdigest()
KEY = "ocr:v1:fp:ocr-x:{abc}"
KEYS = (("k2", b"\x01" * 32), ("k1", b"\x02" * 16))


def v1_value(result: OcrResult, sha256: str, fp: str, ttl: int = 60, zstd: bool = True) -> bytes:
    """An entry exactly as envelope version 1 wrote it (before the compact format)."""
    body = orjson.dumps({"v": 1, "sha256": sha256, "fp": fp, "created": int(time.time()),
                         "ttl": ttl, "result": result.to_dict()})  # fmt: skip
    if zstd:
        return MAGIC + b"z" + zstandard.ZstdCompressor(level=3).compress(body)
    return MAGIC + b"j" + body


def test_round_trip_is_exact():
    for result in (RESULT, TEXT_RESULT, OcrResult(1, 1)):
        value = Codec().encode(result, SHA, "fp", 60, KEY)
        assert value[:5] == b"OCR1c" and value[5] == ENVELOPE_VERSION
        entry = Codec().decode(value, SHA, "fp", KEY)
        assert entry.result == result and 55 < entry.expires_at - time.time() <= 60


def test_scores_keep_their_float32_value_and_print_short():
    """The engines' scores are float32 values: stored as their shortest float32 decimal,
    they read back as the very same double (what every protocol prints)."""
    rng = np.random.default_rng(7)
    scores = [float(s) for s in rng.random(500, dtype=np.float32)]
    lines = tuple(OcrLine("x", s, ((0, 0), (1, 0), (1, 1), (0, 1))) for s in scores)
    result = OcrResult(2, 2, lines)
    stored = plaintext(Codec().encode(result, SHA, "fp", 60, KEY))
    assert (
        Codec().decode(Codec().encode(result, SHA, "fp", 60, KEY), SHA, "fp", KEY).result == result
    )
    # 0.9123457 rather than 0.9123456478118896: the float32's own digits, no more.
    assert max(len(str(row[1])) for row in orjson.loads(stored)[2]) <= 12


def test_scores_that_are_not_float32_values_are_kept_as_they_are():
    """A remote Paddle Serving engine's scores are parsed from text (e.g. 0.9987): kept."""
    line = OcrLine("x", 0.9987, ((0, 0), (1, 0), (1, 1), (0, 1)))
    result = OcrResult(2, 2, (line, RESULT.lines[0]))
    value = Codec().encode(result, SHA, "fp", 60, KEY)
    assert Codec().decode(value, SHA, "fp", KEY).result == result
    assert orjson.loads(plaintext(value))[4] == 0


def test_dictionary_is_shipped_and_named_in_the_header():
    dict_id = dictionaries.current_id()
    assert dict_id and dictionaries.get(dict_id) is not None
    value = Codec().encode(RESULT, SHA, "fp", 60, KEY)
    assert struct.unpack_from(">I", value, 5 + 1 + 32 + 8)[0] == dict_id
    # Without a dictionary (id 0) entries are still readable.
    plain = Codec(dictionary=0).encode(RESULT, SHA, "fp", 60, KEY)
    assert Codec().decode(plain, SHA, "fp", KEY).result == RESULT


def test_an_unknown_dictionary_is_a_miss():
    value = bytearray(Codec().encode(RESULT, SHA, "fp", 60, KEY))
    struct.pack_into(">I", value, 5 + 1 + 32 + 8, 0xDEADBEEF)
    assert Codec().decode(bytes(value), SHA, "fp", KEY) is None


def test_entries_of_the_previous_format_are_still_hits():
    for zstd in (True, False):
        old = v1_value(RESULT, SHA, "fp", zstd=zstd)
        entry = Codec().decode(old, SHA, "fp", KEY)
        assert entry is not None and entry.result == RESULT
        assert Codec().decode(old, OTHER_SHA, "fp", KEY) is None
        assert Codec().decode(old, SHA, "other-fp", KEY) is None


def test_compact_entries_are_smaller_than_the_previous_format():
    lines = tuple(
        OcrLine(
            f"line {i} of a receipt",
            _f32(0.9 + i / 1000),
            ((i, i), (i + 90, i), (i + 90, i + 9), (i, i + 9)),
        )
        for i in range(60)
    )
    big = OcrResult(1000, 800, lines)
    assert len(Codec().encode(big, SHA, "fp", 60, KEY)) < 0.7 * len(v1_value(big, SHA, "fp"))
    assert len(Codec().encode(big, SHA, "fp", 60, KEY)) < len(json.dumps(big.to_dict())) / 5


def test_unusable_values_are_misses():
    codec = Codec()
    good = codec.encode(RESULT, SHA, "fp", 60, KEY)
    header_end = 5 + struct.calcsize(">B32sIIIB") + 2
    forged = [
        [10, 5, [["t", 0.5, [0, 0, 1, 0, 1, 1, 0, "1"], 0]], None, 1],  # a string coordinate
        [10, 5, [["t", 0.5, [0, 0, 1, 0, 1, 1, 0], 0]], None, 1],  # 7 coordinates
        [10, 5, [[1, 0.5, [0, 0, 1, 0, 1, 1, 0, 1], 0]], None, 1],  # text not a string
        [10, 5, [["t", "0.5", [0, 0, 1, 0, 1, 1, 0, 1], 0]], None, 1],  # score not a number
        [10, 5, [["t", 0.5, [0, 0, 1, 0, 1, 1, 0, 1], 0, [["w", 0, 0, 1]]]], None, 1],  # word box
        [10, 5, [], 7, 1],  # text not a string
        [10, 5, [], None, 2],  # unknown score mode
        [10, 5, [], None],  # four fields
        {"width": 10},  # not the compact shape
    ]
    zc = zstandard.ZstdCompressor(
        dict_data=dictionaries.get(dictionaries.current_id()),
        compression_params=zstandard.ZstdCompressionParameters.from_level(
            3, format=zstandard.FORMAT_ZSTD1_MAGICLESS, write_dict_id=False
        ),
    )
    values = [
        None,
        b"",
        b"garbage",
        good[:-7],  # truncated
        good[:header_end] + b"\x00" * 20,  # corrupt payload
        good[:20],  # truncated header
        b"OCR1x" + good[5:],  # unknown codec
        good[:5] + bytes([99]) + good[6:],  # unknown envelope version
        v1_value(RESULT, SHA, "fp", zstd=False)[:-1],  # truncated JSON (old format)
        b"OCR1j" + json.dumps({"v": 99, "sha256": SHA, "fp": "fp", "result": {}}).encode(),
        b"OCR1z" + zstandard.ZstdCompressor().compress(b"[1, 2]"),  # not an envelope
    ]
    values += [good[:header_end] + zc.compress(orjson.dumps(f)) for f in forged]
    for value in values:
        assert codec.decode(value, SHA, "fp", KEY) is None, value
    assert codec.decode(good, OTHER_SHA, "fp", KEY) is None  # another image (MD5 collision)
    assert codec.decode(good, SHA, "other-fp", KEY) is None  # another engine
    assert codec.decode(good, SHA, "fp2", KEY) is None  # a fingerprint of another length


def test_encrypted_values_are_unreadable_without_the_key():
    sealed = Codec(KEYS).encode(RESULT, SHA, "fp", 60, KEY)
    # The line's whole text: its first two bytes alone turn up in the random ciphertext about
    # one run in 400.
    assert sealed[:5] == b"OCR1e" and "é<&>".encode() not in sealed
    assert Codec(KEYS).decode(sealed, SHA, "fp", KEY).result == RESULT
    assert Codec().decode(sealed, SHA, "fp", KEY) is None  # no key: a miss
    wrong = (("k2", b"\x03" * 32),)
    assert Codec(wrong).decode(sealed, SHA, "fp", KEY) is None  # wrong key: a miss
    assert Codec(KEYS).decode(sealed, SHA, "fp", "ocr:other-key") is None  # moved entry
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    assert Codec(KEYS).decode(tampered, SHA, "fp", KEY) is None
    # With keys configured, a plaintext entry (new or old format) is a miss.
    assert Codec(KEYS).decode(Codec().encode(RESULT, SHA, "fp", 60, KEY), SHA, "fp", KEY) is None
    assert Codec(KEYS).decode(v1_value(RESULT, SHA, "fp"), SHA, "fp", KEY) is None


def test_encrypted_entries_of_the_previous_format_are_still_hits():
    import os

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    inner = v1_value(RESULT, SHA, "fp")[4:]
    nonce = os.urandom(12)
    sealed = (
        MAGIC
        + b"e"
        + bytes([2])
        + b"k1"
        + nonce
        + AESGCM(KEYS[1][1]).encrypt(nonce, inner, KEY.encode())
    )
    assert Codec(KEYS).decode(sealed, SHA, "fp", KEY).result == RESULT


def test_encoding_accepts_the_canonical_dict():
    value = Codec().encode(RESULT.to_dict(), SHA, "fp", 60, KEY)
    assert Codec().decode(value, SHA, "fp", KEY).result == RESULT


def test_compact_unpack_refuses_non_lists():
    for bad in (None, {}, [1, 2, 3], [1, 2, {}, None, 1], [1.5, 2, [], None, 1]):
        with pytest.raises(ValueError):
            compact.unpack(bad)


def test_keys_rotate_without_a_flush():
    old = Codec((("k1", b"\x02" * 16),)).encode(RESULT, SHA, "fp", 60, KEY)
    rotated = Codec(KEYS)  # k2 now encrypts, k1 still decrypts
    assert rotated.decode(old, SHA, "fp", KEY).result == RESULT
    assert rotated.encode(RESULT, SHA, "fp", 60, KEY)[5:8] == b"\x02k2"


def test_key_layout():
    digest = digest_image(b"abc")
    assert digest.md5 == "900150983cd24fb0d6963f7d28e17f72"
    key = build_key("ocr", "f" * 16, "ocr", digest)
    assert key == f"ocr:{KEY_SCHEMA}:{'f' * 16}:ocr:{{{digest.md5}}}"  # hash tag on the MD5


@pytest.mark.parametrize("keys", [(), KEYS])
def test_side_blobs_are_bound_like_entries_and_never_read_as_results(keys):
    codec = Codec(keys=keys)
    blob = codec.encode_blob(b"\x89PNG picture", SHA, "fp", 60, KEY)
    assert codec.decode_blob(blob, SHA, "fp", KEY) == b"\x89PNG picture"
    assert codec.decode_blob(blob, OTHER_SHA, "fp", KEY) is None  # another image
    assert codec.decode_blob(blob, SHA, "other-fp", KEY) is None  # another engine
    assert codec.decode(blob, SHA, "fp", KEY) is None  # a blob is never a result
    entry = codec.encode(RESULT, SHA, "fp", 60, KEY)
    assert codec.decode_blob(entry, SHA, "fp", KEY) is None  # nor a result a blob
    if keys:
        assert codec.decode_blob(blob, SHA, "fp", KEY + "x") is None  # moved to another key
        assert Codec().decode_blob(blob, SHA, "fp", KEY) is None  # sealed: unreadable
        assert (
            codec.decode_blob(Codec().encode_blob(b"x", SHA, "fp", 60, KEY), SHA, "fp", KEY) is None
        )
