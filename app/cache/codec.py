"""The stored value: a versioned, compressed and optionally encrypted JSON envelope.

Layout: ``b"OCR1"`` + one codec byte + payload:
- ``j``: plain JSON; ``z``: zstd-compressed JSON;
- ``e``: AES-GCM (the ``cryptography`` package): 1 byte key-id length, the key id, a 12-byte
  nonce, then the ciphertext of the inner ``j``/``z`` value, authenticated with the Redis
  key as associated data (an entry cannot be moved to another key).

The JSON holds the schema version, the input's SHA-256, the engine fingerprint, the creation
time, the TTL it was written with (so a reader knows when it expires) and the canonical
result. Anything that does not decode, or whose SHA-256 or fingerprint differs from the
request's, is a miss (``None``), never an error. With encryption keys configured, only
entries that authenticate under one of them are accepted: a plaintext or forged entry (from
anyone with write access to Redis but not the key) is a miss too. JSON only: nothing read
from Redis is ever unpickled or evaluated.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import orjson
import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"OCR1"
ENVELOPE_VERSION = 1
_PLAIN, _ZSTD, _SEALED = b"j", b"z", b"e"
_NONCE = 12
_ZSTD_LEVEL = 3  # zstd contexts are not thread-safe; they are cheap, so one per call


@dataclass(frozen=True)
class Entry:
    result: dict[str, Any]
    expires_at: float  # epoch seconds
    created: float = 0.0  # epoch seconds; the cold tier (L3) keeps entries by their age


class Codec:
    def __init__(self, compress_min_bytes: int, keys: tuple[tuple[str, bytes], ...] = ()) -> None:
        """``keys``: (key id, AES key) pairs; the first encrypts, all decrypt (rotation)."""
        self._compress_min_bytes = compress_min_bytes
        self._ciphers = {kid: AESGCM(key) for kid, key in keys}
        self._primary = keys[0][0] if keys else None

    def encode(
        self, result: dict[str, Any], sha256: str, fingerprint: str, ttl: int, key: str
    ) -> bytes:
        body = orjson.dumps(
            {
                "v": ENVELOPE_VERSION,
                "sha256": sha256,
                "fp": fingerprint,
                "created": int(time.time()),
                "ttl": ttl,
                "result": result,
            }
        )
        if len(body) >= self._compress_min_bytes:
            inner = _ZSTD + zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(body)
        else:
            inner = _PLAIN + body
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
        codec, payload = inner[:1], inner[1:]
        try:
            if codec == _ZSTD:
                payload = zstandard.ZstdDecompressor().decompress(payload, max_output_size=64 << 20)
            elif codec != _PLAIN:
                return None
            envelope = orjson.loads(payload)
        except (zstandard.ZstdError, ValueError):
            return None
        if (
            not isinstance(envelope, dict)
            or envelope.get("v") != ENVELOPE_VERSION
            or envelope.get("sha256") != sha256
            or envelope.get("fp") != fingerprint
            or not isinstance(envelope.get("result"), dict)
            or not isinstance(envelope.get("created"), int)
            or not isinstance(envelope.get("ttl"), int)
        ):
            return None
        created = envelope["created"]
        return Entry(envelope["result"], created + envelope["ttl"], created)

    def _open(self, body: bytes, key: str) -> bytes | None:
        """The inner ``j``/``z`` value: decrypted when sealed; refused when it should be."""
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
