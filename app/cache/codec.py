"""The stored value: a versioned, compressed and optionally encrypted envelope.

Layout: ``b"OCR1"`` + one codec byte + payload. What is written (envelope version 2):
- ``c``: a fixed binary header - version byte (2), the input's SHA-256 (32 raw bytes),
  creation time and TTL (uint32 each), the id of the zstd dictionary (uint32, 0 for none),
  the engine fingerprint (1 length byte + ASCII) - then a magicless zstd frame of the
  compact canonical result (``compact``), compressed with that shipped dictionary
  (``dictionaries``). The header is checked before anything is decompressed, so an entry
  of another image or engine costs no decompression or JSON work.
- ``b``: a side value bound like an entry (the same header, then raw bytes; e.g. the
  similarity tier's reference picture): read only by ``decode_blob``, never as a result.
- ``e``: AES-GCM (the ``cryptography`` package): 1 byte key-id length, the key id, a 12-byte
  nonce, then the ciphertext of the inner value, authenticated with the Redis key as
  associated data (an entry cannot be moved to another key).

Still read (envelope version 1, written before): ``j`` plain JSON and ``z`` zstd JSON
holding ``{"v": 1, "sha256", "fp", "created", "ttl", "result"}``, so entries already in Redis
stay hits after an upgrade. An unknown dictionary id, version or codec byte is a miss.

Anything that does not decode, or whose SHA-256 or fingerprint differs from the request's,
is a miss (``None``), never an error. With encryption keys configured, only entries that
authenticate under one of them are accepted: a plaintext or forged entry (from anyone with
write access to Redis but not the key) is a miss too. JSON only: nothing read from Redis is
ever unpickled or evaluated.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import orjson
import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from app.cache import compact, dictionaries
from app.vocabulary import OcrResult

MAGIC = b"OCR1"
ENVELOPE_VERSION = 2
_LEGACY_VERSION = 1
_PLAIN, _ZSTD, _COMPACT, _SEALED, _BLOB = b"j", b"z", b"c", b"e", b"b"
_NONCE = 12
_HEADER = struct.Struct(">B32sIIIB")  # version, sha256, created, ttl, dictionary id, fp length
_ZSTD_LEVEL = 19  # writes happen on misses only (after an engine call of ~1 s): spend on size
_MAX_RESULT = 64 << 20
_FORMAT = zstandard.FORMAT_ZSTD1_MAGICLESS  # the envelope says what follows: 4 bytes saved


@dataclass(frozen=True)
class Entry:
    result: OcrResult
    expires_at: float  # epoch seconds
    created: float = 0.0  # epoch seconds; the cold tier (L3) keeps entries by their age


class Codec:
    def __init__(
        self, keys: tuple[tuple[str, bytes], ...] = (), dictionary: int | None = None
    ) -> None:
        """``keys``: (key id, AES key) pairs; the first encrypts, all decrypt (rotation).
        ``dictionary``: the id of the shipped zstd dictionary to write with (default: the
        newest; 0: none); entries written with any shipped dictionary are read. Every entry
        is compressed (with a dictionary, even a one-line result shrinks)."""
        self._ciphers = {kid: AESGCM(key) for kid, key in keys}
        # Small pointers are authenticated, not sealed: a MAC key derived from each key.
        self._macs = [hashlib.sha256(b"ocr-cache pointer\0" + key).digest() for _, key in keys]
        self._primary = keys[0][0] if keys else None
        self._keys_by_id = dict(keys)
        self._dict_id = dictionaries.current_id() if dictionary is None else dictionary
        self._local = threading.local()  # zstd contexts are not thread-safe: one per thread

    def tag(self, *parts: bytes) -> bytes:
        """16 bytes authenticating ``parts`` with the primary key (none without keys)."""
        if not self._macs:
            return b""
        return hmac.new(self._macs[0], b"\0".join(parts), hashlib.sha256).digest()[:16]

    def verify_tag(self, tag: bytes, *parts: bytes) -> bool:
        """``tag`` is ``parts``' under one of the keys (any key: rotation); without keys,
        there is no tag to check."""
        if not self._macs:
            return tag == b""
        message = b"\0".join(parts)
        return any(
            hmac.compare_digest(tag, hmac.new(mac, message, hashlib.sha256).digest()[:16])
            for mac in self._macs
        )

    @property
    def writer(self) -> str:
        """Which key seals new entries: "" without encryption, else a short digest of the
        primary key id and key (not the key; distinct keys under one id differ)."""
        if self._primary is None:
            return ""
        material = self._primary.encode() + b"\0" + self._keys_by_id[self._primary]
        return hashlib.sha256(material).hexdigest()[:12]

    def encode(
        self, result: OcrResult | dict[str, Any], sha256: str, fingerprint: str, ttl: int, key: str
    ) -> bytes:
        if isinstance(result, dict):
            result = OcrResult.from_dict(result)
        params = zstandard.ZstdCompressionParameters.from_level(
            _ZSTD_LEVEL, format=_FORMAT, write_dict_id=False, write_checksum=False
        )
        compressor = zstandard.ZstdCompressor(
            dict_data=dictionaries.get(self._dict_id), compression_params=params
        )
        body = compressor.compress(orjson.dumps(compact.pack(result)))
        return self._seal(_COMPACT + _bind(sha256, fingerprint, ttl, self._dict_id) + body, key)

    def encode_blob(self, data: bytes, sha256: str, fingerprint: str, ttl: int, key: str) -> bytes:
        """An opaque side value (e.g. the similarity tier's reference picture) bound like an
        entry to one input, one engine and one key, and sealed the same way; never a result."""
        return self._seal(_BLOB + _bind(sha256, fingerprint, ttl, 0) + data, key)

    def decode_blob(
        self, value: bytes | None, sha256: str, fingerprint: str, key: str
    ) -> bytes | None:
        """The data of an ``encode_blob`` value for exactly this input and engine, or None."""
        if not value or len(value) < 5 or value[:4] != MAGIC:
            return None
        inner = self._open(value[4:], key)
        if inner is None or inner[:1] != _BLOB or len(inner) < 1 + _HEADER.size:
            return None
        bound = _unbind(inner, sha256, fingerprint)
        return None if bound is None else bound[3]

    def _seal(self, inner: bytes, key: str) -> bytes:
        """``MAGIC`` + the inner value, AES-GCM sealed (bound to ``key``) when keys are set."""
        if self._primary is None:
            return MAGIC + inner
        kid = self._primary.encode()
        nonce = os.urandom(_NONCE)
        sealed = self._ciphers[self._primary].encrypt(nonce, inner, key.encode())
        return MAGIC + _SEALED + bytes([len(kid)]) + kid + nonce + sealed

    def decode(self, value: bytes | None, sha256: str, fingerprint: str, key: str) -> Entry | None:
        """The cached entry, or ``None`` for anything that is not a valid entry for this input."""
        if not value or len(value) < 5 or value[:4] != MAGIC:
            return None
        inner = self._open(value[4:], key)
        if inner is None:
            return None
        codec = inner[:1]
        try:
            if codec == _COMPACT:
                return self._decode_compact(inner, sha256, fingerprint)
            if codec in (_PLAIN, _ZSTD):
                return _decode_legacy(codec, inner[1:], sha256, fingerprint)
        except (zstandard.ZstdError, ValueError, KeyError, TypeError, struct.error):
            return None
        return None

    def _decode_compact(self, inner: bytes, sha256: str, fingerprint: str) -> Entry | None:
        bound = _unbind(inner, sha256, fingerprint)
        if bound is None:
            return None
        created, ttl, dict_id, frame = bound
        decompressor = self._decompressor(dict_id)
        if decompressor is None:
            return None  # a dictionary this version does not ship: a miss
        body = decompressor.decompress(frame, max_output_size=_MAX_RESULT)
        return Entry(compact.unpack(orjson.loads(body)), created + ttl, created)

    def _decompressor(self, dict_id: int) -> zstandard.ZstdDecompressor | None:
        cache: dict[int, zstandard.ZstdDecompressor] | None = getattr(self._local, "d", None)
        if cache is None:
            cache = self._local.d = {}
        found = cache.get(dict_id)
        if found is None:
            data = dictionaries.get(dict_id)
            if dict_id and data is None:
                return None
            found = cache[dict_id] = zstandard.ZstdDecompressor(dict_data=data, format=_FORMAT)
        return found

    def _open(self, body: bytes, key: str) -> bytes | None:
        """The inner value: decrypted when sealed; refused when it should be."""
        if body[:1] != _SEALED:
            return None if self._primary is not None else body
        if len(body) < 2:
            return None
        size = body[1]
        kid = body[2 : 2 + size].decode("ascii", "replace")
        nonce, sealed = body[2 + size : 2 + size + _NONCE], body[2 + size + _NONCE :]
        cipher = self._ciphers.get(kid)
        if cipher is None or len(nonce) != _NONCE:
            return None
        try:
            return cipher.decrypt(nonce, sealed, key.encode())
        except InvalidTag:
            return None


def _bind(sha256: str, fingerprint: str, ttl: int, dict_id: int) -> bytes:
    """The binary header (``_HEADER`` + the fingerprint) that binds a value to one input and
    one engine; written after the codec byte."""
    fp = fingerprint.encode("ascii")
    created = int(time.time())
    return (
        _HEADER.pack(ENVELOPE_VERSION, bytes.fromhex(sha256), created, ttl, dict_id, len(fp)) + fp
    )


def _unbind(inner: bytes, sha256: str, fingerprint: str) -> tuple[int, int, int, bytes] | None:
    """(created, ttl, dictionary id, payload) of an inner value whose header (after the codec
    byte) names this version, input and engine; None otherwise."""
    version, digest, created, ttl, dict_id, fp_size = _HEADER.unpack_from(inner, 1)
    start = 1 + _HEADER.size
    if (
        version != ENVELOPE_VERSION
        or digest.hex() != sha256
        or inner[start : start + fp_size] != fingerprint.encode("ascii")
    ):
        return None
    return created, ttl, dict_id, inner[start + fp_size :]


def _decode_legacy(codec: bytes, payload: bytes, sha256: str, fingerprint: str) -> Entry | None:
    """An envelope version 1 entry (JSON, optionally zstd without a dictionary)."""
    if codec == _ZSTD:
        payload = zstandard.ZstdDecompressor().decompress(payload, max_output_size=_MAX_RESULT)
    envelope = orjson.loads(payload)
    if (
        not isinstance(envelope, dict)
        or envelope.get("v") != _LEGACY_VERSION
        or envelope.get("sha256") != sha256
        or envelope.get("fp") != fingerprint
        or not isinstance(envelope.get("result"), dict)
        or not isinstance(envelope.get("created"), int)
        or not isinstance(envelope.get("ttl"), int)
    ):
        return None
    created = envelope["created"]
    return Entry(OcrResult.from_dict(envelope["result"]), created + envelope["ttl"], created)


def plaintext(value: bytes) -> bytes:
    """The stored JSON of an unencrypted entry (any version), for tests and inspection."""
    inner = value[4:]
    codec = inner[:1]
    if codec == _PLAIN:
        return inner[1:]
    if codec == _ZSTD:
        return zstandard.ZstdDecompressor().decompress(inner[1:])
    if codec == _COMPACT:
        dict_id, fp_size = _HEADER.unpack_from(inner, 1)[4:]
        frame = inner[1 + _HEADER.size + fp_size :]
        decompressor = zstandard.ZstdDecompressor(
            dict_data=dictionaries.get(dict_id), format=_FORMAT
        )
        return decompressor.decompress(frame, max_output_size=_MAX_RESULT)
    raise ValueError("not an unencrypted entry")
