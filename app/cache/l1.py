"""L1: an in-process, bytes-bounded LRU of decoded results in front of Redis.

A hot image then costs no Redis round trip, no decompression and no JSON parsing. Entries
are keyed by (engine fingerprint, task, SHA-256 of the image), so an L1 hit needs no MD5 and
cannot be another image's result. Each entry expires with its Redis TTL, and at the latest
after ``max_age`` seconds, which bounds how long a purge elsewhere can go unnoticed here.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from app.cache.keys import KeySpace
from app.cache.tier import Probe, Tier
from app.vocabulary import OcrResult

# Rough per-object overheads of the decoded result (dataclasses, tuples, ints, floats).
_RESULT_OVERHEAD = 400
_LINE_OVERHEAD = 420


def result_size(result: OcrResult) -> int:
    """Approximate memory of a decoded result, in bytes (a bound, not an exact count)."""
    text = sum(len(line.text.encode()) for line in result.lines) + len(
        (getattr(result, "text", None) or "").encode()
    )
    return _RESULT_OVERHEAD + _LINE_OVERHEAD * len(result.lines) + text


class L1Cache:
    def __init__(
        self,
        max_bytes: int,
        max_age_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._max_bytes = max_bytes
        self._max_age = max_age_seconds
        self._entries: OrderedDict[tuple[str, ...], tuple[OcrResult, float, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._max_bytes > 0

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[str, ...]) -> OcrResult | None:
        if not self._max_bytes:
            return None
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            result, expires, size = entry
            if expires <= self._clock():
                del self._entries[key]
                self._bytes -= size
                return None
            self._entries.move_to_end(key)
            return result

    def put(self, key: tuple[str, ...], result: OcrResult, ttl_seconds: float) -> None:
        if not self._max_bytes or ttl_seconds <= 0:
            return
        size = result_size(result)
        if size > self._max_bytes:
            return
        expires = self._clock() + min(ttl_seconds, self._max_age)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[2]
            self._entries[key] = (result, expires, size)
            self._bytes += size
            while self._bytes > self._max_bytes:
                _, (_, _, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


class L1Tier(Tier):
    """The L1 cache as a tier: keyed by the SHA-256 (no MD5 on a hit). It keeps what an exact
    tier found (L2, L3, the pixel tier's entry for the same pixels) or the engine computed,
    never a similar image's answer."""

    name = "l1"

    def __init__(self, cache: L1Cache, keys: KeySpace) -> None:
        self.cache = cache
        self._keys = keys

    def _key(self, probe: Probe) -> tuple[str, ...]:
        return self._keys.l1(probe.digest, probe.task, probe.controls.namespace)

    def lookup(self, probes: Sequence[Probe]) -> None:
        if not self.cache.enabled:
            return
        for probe in probes:
            hit = self.cache.get(self._key(probe))
            if hit is not None:
                probe.answer(hit, self.name, 0.0)

    def record(self, probe: Probe, result: OcrResult, ttl: float, source: str) -> bool:
        if source != "similar":
            self.cache.put(self._key(probe), result, ttl)
        return True

    def purge(self, namespace: str, md5: str | None) -> int:
        self.cache.clear()  # keyed by SHA-256: the whole of it (other processes: notified)
        return 0
