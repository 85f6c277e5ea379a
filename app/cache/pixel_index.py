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
from app.cache.keys import KeySpace
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


class PixelIndex:
    """Pixel digest -> ``"{entry key} {sha256 of its bytes}"`` (a codec blob bound to the
    digest and its key, sealed like the entries), expiring with the entry."""

    def __init__(self, store: RedisStore, keys: KeySpace, codec: Codec) -> None:
        self._store = store
        self._keys = keys
        self._codec = codec

    def find(self, digest: str, task: str, namespace: str) -> tuple[OcrResult, Entry] | None:
        """The verified entry these pixels point at, or None (two reads; any doubt is a
        miss)."""
        key = self._keys.pixel(digest, task, namespace)
        ok, (value,) = self._store.get_many([key])
        if not ok or value is None:
            return None
        # Bound to these pixels and this key, and sealed with the entries (CACHE_ENCRYPTION_KEYS):
        # a pointer forged by a Redis writer without the key is a miss.
        pointer = self._codec.decode_blob(value, digest, self._keys.fingerprint, key)
        if pointer is None:
            return None
        return read_entry(
            self._store, self._codec, self._keys, pointer, self._keys.entry_scope(task, namespace)
        )

    def record(
        self, digest: str, task: str, namespace: str, entry_key: str, sha256: str, ttl: int
    ) -> None:
        key = self._keys.pixel(digest, task, namespace)
        pointer = f"{entry_key} {sha256}".encode()
        self._store.set(
            key, self._codec.encode_blob(pointer, digest, self._keys.fingerprint, ttl, key), ttl
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
                probe.key, probe.digest.sha256, max(1, int(ttl)),
            )  # fmt: skip
        return True
