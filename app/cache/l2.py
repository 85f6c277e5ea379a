"""L2: the entries in Redis, the tier every process and replica shares.

One MGET for all the probes of a request; each value is decoded and checked by the codec
(the image's SHA-256, the engine fingerprint, the key it was sealed for): anything else is
a miss. A computed result (or one recalled from L3) is written with its TTL; a write Redis
did not take is retried once, since waiters elsewhere read it when notified.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from app.cache.codec import Codec
from app.cache.keys import KeySpace
from app.cache.purging import PurgeUnconfirmed
from app.cache.store import Store
from app.cache.tier import ENGINE, Probe, Tier
from app.vocabulary import OcrResult

log = logging.getLogger("app.cache.region")  # the name its log lines have always carried


class L2Tier(Tier):
    name = "l2"
    shared = True

    def __init__(
        self,
        store: Store,
        keys: KeySpace,
        codec: Codec,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._keys = keys
        self._codec = codec
        self._clock = clock

    def lookup(self, probes: Sequence[Probe]) -> None:
        ok, values = self._store.get_many([probe.entry_key(self._keys) for probe in probes])
        for probe, value in zip(probes, values, strict=True):
            probe.redis_failed = not ok
            if value is None:
                continue
            entry = self._codec.decode(
                value, probe.digest.sha256, self._keys.fingerprint, probe.key
            )
            if entry is None:
                log.info("cache entry for %s is unusable; treating as a miss", probe.digest.md5)
                continue
            probe.answer(entry.result, self.name, entry.expires_at - self._clock())

    def record(self, probe: Probe, result: OcrResult, ttl: float, source: str) -> bool:
        if source not in (ENGINE, "l3"):  # L1, pixel, similar hits came from an entry
            return True
        seconds = max(1, int(ttl))
        value = sealed(probe, result, seconds, self._codec, self._keys)
        stored = self._store.set(probe.key, value, seconds)
        if not stored and self._store.breaker_state == "closed":
            stored = self._store.set(probe.key, value, seconds)
        return stored

    def purge(self, namespace: str, md5: str | None) -> int:
        """Every key of the namespace (or of the image): entries, pixel pointers, similarity
        bands, page lists, field sets. Never blocks Redis (SCAN + UNLINK in batches).
        ``PurgeUnconfirmed``: not known complete on every replica (``purging.py``)."""
        pattern = self._keys.purge_pattern(namespace, md5)
        purged = self._store.scan_unlink(pattern, self._keys.purge_sync())
        if purged.unconfirmed:
            raise PurgeUnconfirmed(purged.removed, purged.unconfirmed)
        return purged.removed


def sealed(probe: Probe, result: OcrResult, ttl: int, codec: Codec, keys: KeySpace) -> bytes:
    """The entry of ``result`` under the probe's key, encoded once for every tier that keeps
    it (L2 stores it, L3 archives the same envelope)."""
    if probe.sealed is None or probe.sealed[0] != ttl:
        key = probe.entry_key(keys)
        value = codec.encode(result, probe.digest.sha256, keys.fingerprint, ttl, key)
        probe.sealed = (ttl, value)
    return probe.sealed[1]
