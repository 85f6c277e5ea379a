"""The pixel tier: an exact-bytes miss whose decoded pixels were seen before is a hit.

The key of an entry is the MD5 of the uploaded bytes, so a PNG re-saved by another tool, a
file whose metadata an app stripped, or a lossless format change (PNG, BMP, TIFF, lossless
WEBP) misses L1 and L2 although the engine would see the very same input. After such a miss
the image is decoded anyway: the SHA-256 of its canonical pixels (``decode_image``'s output:
EXIF orientation applied, converted to 8-bit RGB, with its dimensions) keys a small index
that points at the entry that answered those pixels (its key and the SHA-256 of its bytes,
so the codec verifies the entry as an L2 read does). The pointer must lie in this engine's
fingerprint, task parameters and namespace, or it is ignored.

Exact only for engines that recognize the decoded pixels (``reads_decoded_pixels``, the
in-process PaddleOCR engine). Remote engines are sent the original bytes, which their own
decoder may turn into other pixels (16-bit PNGs, CMYK JPEGs...): for them the tier is off.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence

from app.cache.codec import Codec, Entry
from app.cache.keys import ImageDigest, KeySpace, known_digest
from app.cache.scripts import PIXEL_RECORD
from app.cache.store import RedisStore
from app.cache.tier import ENGINE, Probe, Tier
from app.imaging import DecodedImage
from app.vocabulary import OcrResult

log = logging.getLogger(__name__)


def pixel_digest(image: DecodedImage) -> str:
    """SHA-256 over the dimensions, the mode and the raw RGB bytes: what the engine sees."""
    pixels = image.pixels
    h = hashlib.sha256(f"{image.width}x{image.height}:RGB8:".encode())
    h.update((pixels if pixels.flags.c_contiguous else pixels.copy()).data.cast("B"))
    return h.hexdigest()


# Pointers live in hashes, per engine, task and namespace: a Redis key of its own costs
# about 180 bytes beside a pointer's 48, a field in a small hash (listpack) under 100 in all.
# 65,536 buckets of at most 128 fields hold 8 million pointers a scope; a small cache pays
# about one key per pointer, as before, until the buckets fill.
BUCKET_HEX = 4
BUCKET_FIELDS = 128  # Redis's default hash-max-listpack-entries: kept compact
_EVICT = 16  # fields dropped at random when a bucket is full (its entries may be long gone)
# A pointer is recorded by app/cache/scripts/pixel_record.lua.


class PixelIndex:
    """Pixel digest -> the MD5 and SHA-256 of the bytes whose entry answered those pixels:
    48 raw bytes in a field of a bucket hash, plus a 16-byte MAC with the entries' keys when
    ``CACHE_ENCRYPTION_KEYS`` is set (a pointer forged by a Redis writer without the key is a
    miss). The entry it names is read and verified as an L2 read is."""

    def __init__(
        self, store: RedisStore, keys: KeySpace, codec: Codec, bucket_hex: int = BUCKET_HEX
    ) -> None:
        self._store = store
        self._keys = keys
        self._codec = codec
        self._bucket_hex = bucket_hex

    def _place(self, digest: str, task: str, namespace: str) -> tuple[str, bytes]:
        """The bucket (the digest's first hex digits) and the field (the next 128 bits)."""
        n = self._bucket_hex
        key = self._keys.pixel_bucket(digest[:n], task, namespace)
        return key, bytes.fromhex(digest[n : n + 32])

    def find(self, digest: str, task: str, namespace: str) -> tuple[OcrResult, Entry] | None:
        """The verified entry these pixels point at, or None (two reads; any doubt is a
        miss)."""
        key, field = self._place(digest, task, namespace)
        ok, value = self._store.run("get", lambda c: c.hget(key, field))
        if not ok or not value or len(value) < 48:
            return None
        payload, tag = value[:48], value[48:]
        if not self._codec.verify_tag(tag, key.encode(), field, digest.encode(), payload):
            return None
        entry_digest = known_digest(payload[:16].hex(), payload[16:].hex())
        entry_key = self._keys.entry(entry_digest, task, namespace)
        return read_entry(
            self._store, self._codec, self._keys, f"{entry_key} {entry_digest.sha256}".encode(),
            self._keys.entry_scope(task, namespace),
        )  # fmt: skip

    def record(self, digest: str, task: str, namespace: str, entry: ImageDigest, ttl: int) -> None:
        key, field = self._place(digest, task, namespace)
        payload = bytes.fromhex(entry.md5) + bytes.fromhex(entry.sha256)
        value = payload + self._codec.tag(key.encode(), field, digest.encode(), payload)
        self._store.run(
            "set",
            lambda c: PIXEL_RECORD(c, [key], [field, value, ttl * 1000, BUCKET_FIELDS, _EVICT]),
        )


def read_entry(
    store: RedisStore, codec: Codec, keys: KeySpace, pointer: bytes, scope: str
) -> tuple[OcrResult, Entry] | None:
    """Follow ``"{entry key} {sha256}"`` to a verified result, or None."""
    try:
        entry_key, sha256 = pointer.decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        return None
    if not entry_key.startswith(scope) or len(sha256) != 64:
        return None  # another engine, task or namespace: never served here
    ok, (value,) = store.get_many([entry_key])
    if not ok or value is None:
        return None
    entry = codec.decode(value, sha256, keys.fingerprint, entry_key)
    if entry is None:
        return None
    try:
        return entry.result, entry
    except (KeyError, TypeError, ValueError):
        log.info("pixel tier: entry %s is unusable", entry_key)
        return None


class PixelTier(Tier):
    """The pixel index in the chain: after the exact tiers, for engines that read the decoded
    pixels; it indexes every computed result."""

    name = "pixel"

    def __init__(self, index: PixelIndex, clock: Callable[[], float] = time.time) -> None:
        self._index = index
        self._clock = clock

    def lookup(self, probes: Sequence[Probe]) -> None:
        for probe in probes:
            digest = pixel_digest(probe.image)
            found = self._index.find(digest, probe.task, probe.controls.namespace)
            if found is not None:
                result, entry = found
                probe.answer(result, self.name, entry.expires_at - self._clock())

    def record(self, probe: Probe, result: OcrResult, ttl: float, source: str) -> bool:
        if source == ENGINE:
            self._index.record(
                pixel_digest(probe.image), probe.task, probe.controls.namespace,
                probe.digest, max(1, int(ttl)),
            )  # fmt: skip
        return True
