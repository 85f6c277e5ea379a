"""``OcrCache.get_or_compute``: the one front door from a canonical request to a result.

fingerprint -> key -> Redis (L2) -> single-flight -> engine -> encode -> SET EX ttl.
Every protocol adapter calls this, so an image first seen over one protocol is a hit over
all of them.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import partial

from app import metrics
from app.cache import codec
from app.cache.keys import ImageDigest, build_key, digest_image
from app.cache.singleflight import SingleFlight
from app.cache.store import RedisStore
from app.config import Settings
from app.engines.base import Engine, EngineError, OcrParams, OcrRequest, OcrResult
from app.imaging import DecodedImage

log = logging.getLogger(__name__)


class CacheStatus(StrEnum):
    HIT = "HIT"
    MISS = "MISS"
    COALESCED = "COALESCED"
    BYPASS = "BYPASS"


@dataclass(frozen=True)
class CacheControls:
    """Per-request controls (from ``Cache-Control`` or the protocol)."""

    bypass: bool = False  # neither read nor write (e.g. pipeline.profile)
    no_cache: bool = False  # do not read; recompute and refresh
    no_store: bool = False  # do not write


@dataclass(frozen=True)
class Outcome:
    result: OcrResult
    status: CacheStatus


Decoder = Callable[[bytes], DecodedImage]


class OcrCache:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        store: RedisStore | None,
        decode: Decoder,
        wait_for_engine: Callable[[], None] = lambda: None,
    ) -> None:
        self._settings = settings
        self._engine = engine
        self._store = store if settings.cache_enabled else None
        self._decode = decode
        self._wait_for_engine = wait_for_engine
        self._flights: SingleFlight[Outcome] = SingleFlight()

    @property
    def store(self) -> RedisStore | None:
        return self._store

    @property
    def engine(self) -> Engine:
        return self._engine

    def key_for(self, digest: ImageDigest, params: OcrParams) -> str:
        """The task segment names the task and the digest of its effective parameters, so
        equal parameters share entries however a protocol spelled them."""
        task = f"{params.task}-{params.digest()}"
        return build_key(self._settings.cache_key_prefix, self._engine.fingerprint, task, digest)

    def peek(self, image_bytes: bytes, params: OcrParams) -> OcrResult | None:
        """The stored result for exactly these params, or None: never computes, never writes
        (lets a caller answer from a related entry, e.g. extraction field subsets)."""
        if self._store is None:
            return None
        digest = digest_image(image_bytes)
        _, (value,) = self._store.get_many([self.key_for(digest, params)])
        return self._decode_entry(value, digest)

    def get_or_compute(
        self,
        image_bytes: bytes,
        params: OcrParams | None = None,
        controls: CacheControls = CacheControls(),
    ) -> Outcome:
        return self.get_or_compute_many([image_bytes], params, controls)[0]

    def get_or_compute_many(
        self,
        images: Sequence[bytes],
        params: OcrParams | None = None,
        controls: CacheControls = CacheControls(),
    ) -> list[Outcome]:
        """Results in request order; all lookups share one Redis round trip (MGET)."""
        params = params or self._engine.default_params
        self._engine.check_params(params)  # UnsupportedParams: a client error
        if self._store is None or controls.bypass:
            for _ in images:
                metrics.CACHE_REQUESTS.labels(result="bypass").inc()
            return [Outcome(self._compute(data, params), CacheStatus.BYPASS) for data in images]

        digests = [digest_image(data) for data in images]
        keys = [self.key_for(d, params) for d in digests]
        if controls.no_cache:
            ok, values = True, [None] * len(keys)
        else:
            ok, values = self._store.get_many(keys)
        outcomes = []
        for data, digest, key, value in zip(images, digests, keys, values, strict=True):
            hit = self._decode_entry(value, digest)
            if hit is not None:
                metrics.CACHE_REQUESTS.labels(result="hit").inc()
                outcomes.append(Outcome(hit, CacheStatus.HIT))
                continue
            miss = partial(self._miss, data, params, digest, key, controls, recheck=ok)
            outcome, shared = self._flights.do(key, miss)
            if shared:
                outcome = Outcome(outcome.result, CacheStatus.COALESCED)
            label = "error" if not ok else outcome.status.value.lower()
            metrics.CACHE_REQUESTS.labels(result=label).inc()
            outcomes.append(outcome)
        return outcomes

    def _decode_entry(self, value: bytes | None, digest: ImageDigest) -> OcrResult | None:
        if value is None:
            return None
        data = codec.decode(value, digest.sha256, self._engine.fingerprint)
        if data is None:
            log.info("cache entry for %s is unusable; treating as a miss", digest.md5)
            return None
        try:
            return OcrResult.from_dict(data)
        except (KeyError, TypeError, ValueError):
            return None

    def _miss(
        self,
        data: bytes,
        params: OcrParams,
        digest: ImageDigest,
        key: str,
        controls: CacheControls,
        recheck: bool,
    ) -> Outcome:
        assert self._store is not None
        if recheck and not controls.no_cache:
            # Another computation may have finished between our read and our turn.
            _, (value,) = self._store.get_many([key])
            hit = self._decode_entry(value, digest)
            if hit is not None:
                return Outcome(hit, CacheStatus.HIT)
        result = self._compute(data, params)
        if not controls.no_store:
            entry = codec.encode(
                result.to_dict(),
                digest.sha256,
                self._engine.fingerprint,
                self._settings.cache_compress_min_bytes,
            )
            self._store.set(key, entry, self._ttl())
        return Outcome(result, CacheStatus.MISS)

    def _ttl(self) -> int:
        ttl = self._settings.cache_ttl_seconds
        jitter = int(ttl * self._settings.cache_ttl_jitter)
        return max(1, ttl - random.randint(0, jitter)) if jitter else ttl

    def _compute(self, data: bytes, params: OcrParams) -> OcrResult:
        image = self._decode(data)  # InvalidImage propagates: a client error, never cached
        self._wait_for_engine()
        start = time.perf_counter()
        kind = self._engine.kind
        try:
            result = self._engine.recognize(OcrRequest(data, image, params))
        except EngineError:
            metrics.ENGINE_CALLS.labels(engine=kind, outcome="error").inc()
            raise
        metrics.ENGINE_CALLS.labels(engine=kind, outcome="ok").inc()
        metrics.ENGINE_SECONDS.labels(engine=kind).observe(time.perf_counter() - start)
        return result
