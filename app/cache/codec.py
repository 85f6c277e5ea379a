"""The stored value: a versioned, compressed JSON envelope.

Layout: ``b"OCR1"`` + one codec byte (``j`` plain JSON, ``z`` zstd-compressed JSON) + payload.
The JSON holds the schema version, the input's SHA-256, the engine fingerprint, the creation
time, the TTL it was written with (so a reader knows when it expires) and the canonical
result. Anything that does not decode, or whose SHA-256 or fingerprint
differs from the request's, is reported as ``None`` (a miss), never as an error. JSON only:
nothing read from Redis is ever unpickled or evaluated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson
import zstandard

MAGIC = b"OCR1"
ENVELOPE_VERSION = 1
_PLAIN, _ZSTD = b"j", b"z"
# zstd contexts are not thread-safe; they are cheap, so make one per call.
_ZSTD_LEVEL = 3


@dataclass(frozen=True)
class Entry:
    result: dict[str, Any]
    expires_at: float  # epoch seconds


def encode(
    result: dict[str, Any], sha256: str, fingerprint: str, compress_min_bytes: int, ttl: int
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
    if len(body) >= compress_min_bytes:
        return MAGIC + _ZSTD + zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(body)
    return MAGIC + _PLAIN + body


def decode(value: bytes | None, sha256: str, fingerprint: str) -> Entry | None:
    """The cached entry, or ``None`` for anything that is not a valid entry for this input."""
    if not value or len(value) < 5 or value[:4] != MAGIC:
        return None
    codec, payload = value[4:5], value[5:]
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
    return Entry(envelope["result"], envelope["created"] + envelope["ttl"])
