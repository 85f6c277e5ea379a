"""Line reuse, the store's side (``CACHE_LINES``): the readings of text-line crops in Redis,
for the engine's ``ReusingRecognizer`` (``app/engines/paddle_lines.py``) through the
``LineStore`` interface it defines (``app/engines/lines.py``); wired in ``assembly.py``.

Each reading is one short value under ``KeySpace.line`` (per tenant namespace, engine
fingerprint and recognition context), sealed like an entry's side value
(``Codec.encode_blob``: bound to the crop's SHA-256, the engine fingerprint and the key,
AES-GCM with ``CACHE_ENCRYPTION_KEYS``), with its own TTL (``CACHE_LINES_TTL_SECONDS``) under
the same ``maxmemory`` policy as everything else. A value that does not open for exactly
that crop, engine and key is a miss; Redis failing is a miss (the store never raises).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from app import metrics
from app.cache.codec import Codec
from app.cache.keys import KeySpace
from app.cache.store import RedisStore
from app.engines.lines import LineId


class RedisLineStore:
    def __init__(
        self, redis: RedisStore, keys: KeySpace, codec: Codec, ttl: Callable[[], int]
    ) -> None:
        self._redis, self._keys, self._codec, self._ttl = redis, keys, codec, ttl
        self._reused = metrics.LINES.labels(outcome="reused")
        self._recognized = metrics.LINES.labels(outcome="recognized")

    def fetch(self, namespace: str, lines: Sequence[LineId]) -> list[bytes | None]:
        if not lines:
            return []
        names = [self._keys.line(line.context, line.digest, namespace) for line in lines]
        _, values = self._redis.get_many(names)
        fp = self._keys.fingerprint
        return [
            self._codec.decode_blob(value, line.digest, fp, name)
            for line, name, value in zip(lines, names, values, strict=True)
        ]

    def keep(self, namespace: str, lines: Sequence[tuple[LineId, bytes]]) -> None:
        if not lines:
            return
        fp, ttl = self._keys.fingerprint, self._ttl()
        items = []
        for line, reading in lines:
            name = self._keys.line(line.context, line.digest, namespace)
            items.append((name, self._codec.encode_blob(reading, line.digest, fp, ttl, name)))

        def write(client: Any) -> Any:
            pipe = client.pipeline(transaction=False)
            for name, value in items:
                pipe.set(name, value, ex=ttl)
            return pipe.execute()

        self._redis.run("set", write)

    def count(self, reused: int, recognized: int) -> None:
        self._reused.inc(reused)
        self._recognized.inc(recognized)
