"""Line reuse, the store's side (``CACHE_LINES``): the readings of text-line crops in Redis,
for the engine's ``ReusingRecognizer`` (``app/engines/paddle_lines.py``) through the
``LineStore`` interface it defines (``app/engines/lines.py``); wired in ``assembly.py``.

Each reading is one short value under ``KeySpace.line`` (per tenant namespace, engine
fingerprint, line schema and recognition context), sealed like an entry's side value
(``Codec.encode_blob``, AES-GCM with ``CACHE_ENCRYPTION_KEYS``) and bound to the SHA-256 of
its own key name, so to its crop, context, schema and namespace even unsealed: a value
copied to another line's, context's or tenant's key is a miss. Its own TTL
(``CACHE_LINES_TTL_SECONDS``, or the request's ``X-Cache-TTL`` if shorter) under the same
``maxmemory`` policy as everything else. Reads and writes go in chunks of ``CHUNK`` keys
(one ``MGET`` or pipeline each), so one page never holds Redis long; a Redis that fails
answers misses and drops the writes (``RedisStore`` never raises), at the cost of its
timeouts on that page's engine call.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from app import metrics
from app.cache.codec import Codec
from app.cache.keys import KeySpace
from app.cache.store import RedisStore
from app.engines.lines import LINE_FORMAT, LineId

CHUNK = 128  # keys per MGET or SET pipeline


class RedisLineStore:
    def __init__(
        self,
        redis: RedisStore,
        keys: KeySpace,
        codec: Codec,
        ttl: Callable[[], int],
        schema: str = "",
    ) -> None:
        """``schema``: what besides the engine fingerprint shapes a reading after the crop's
        digest (the engine's ``line_schema``: e.g. the OpenCV that resizes the crops)."""
        self._redis, self._keys, self._codec, self._ttl = redis, keys, codec, ttl
        self._schema = f"{LINE_FORMAT}:{schema or '-'}"
        self._reused = metrics.LINES.labels(outcome="reused")
        self._recognized = metrics.LINES.labels(outcome="recognized")

    def name(self, namespace: str, line: LineId) -> str:
        """The Redis key of ``line``'s reading in ``namespace``."""
        return self._keys.line(self._schema, line.context, line.digest, namespace)

    def fetch(self, namespace: str, lines: Sequence[LineId]) -> list[bytes | None]:
        names = [self.name(namespace, line) for line in lines]
        values: list[bytes | None] = []
        for start in range(0, len(names), CHUNK):
            values += self._redis.get_many(names[start : start + CHUNK])[1]
        fp = self._keys.fingerprint
        return [
            self._codec.decode_blob(value, _bound(name), fp, name)
            for name, value in zip(names, values, strict=True)
        ]

    def keep(
        self, namespace: str, lines: Sequence[tuple[LineId, bytes]], ttl: int | None = None
    ) -> None:
        if not lines:
            return
        fp, seconds = self._keys.fingerprint, self._ttl()
        if ttl is not None:
            seconds = max(1, min(seconds, ttl))
        items = []
        for line, reading in lines:
            name = self.name(namespace, line)
            items.append((name, self._codec.encode_blob(reading, _bound(name), fp, seconds, name)))
        for start in range(0, len(items), CHUNK):
            chunk = items[start : start + CHUNK]

            def write(client: Any, chunk: list[tuple[str, bytes]] = chunk) -> Any:
                pipe = client.pipeline(transaction=False)
                for name, value in chunk:
                    pipe.set(name, value, ex=seconds)
                return pipe.execute()

            self._redis.run("set", write)

    def count(self, reused: int, recognized: int) -> None:
        self._reused.inc(reused)
        self._recognized.inc(recognized)

    def fault(self, what: str) -> None:
        metrics.LINE_FAULTS.labels(what=what).inc()


def _bound(name: str) -> str:
    """What a line's value is bound to (the codec's "input" digest): its own key name."""
    return hashlib.sha256(name.encode()).hexdigest()
