"""``OcrCache.get_or_compute``: the one front door from a canonical request to a result.

L1 (in-process LRU) -> L2 (Redis, one MGET per request) -> single-flight -> engine ->
encode -> SET EX ttl. Single-flight has two layers: threads of one process share one
computation per key (``SingleFlight``), and processes and replicas elect one computer per
key with a Redis lease (SET NX PX, random token, renewed while computing, released by its
owner only); the others wait for its pub/sub notification, bounded, then compute themselves.
Every protocol adapter calls this, so an image first seen over one protocol is a hit over
all of them.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

from app import metrics
from app.cache.codec import Codec
from app.cache.engine_runner import EngineBusy, EngineRunner
from app.cache.keys import (
    ImageDigest,
    build_key,
    digest_image,
    done_channel,
    lease_key,
    purge_channel,
)
from app.cache.l1 import L1Cache
from app.cache.notify import Notifier
from app.cache.singleflight import SingleFlight
from app.cache.store import RedisStore
from app.config import Settings
from app.engines.base import Engine, OcrRequest
from app.imaging import DecodedImage
from app.vocabulary import (
    CacheControls,
    CacheStatus,
    EngineError,
    EngineTimeout,
    OcrParams,
    OcrResult,
    Outcome,
)

log = logging.getLogger(__name__)


# Lease calls that may fail in a row (timeouts on a loaded host) before this process
# computes without the cross-process election.
_LEASE_ATTEMPTS = 3


@dataclass
class _Job:
    """One image of a request on its way through the tiers."""

    data: bytes
    params: OcrParams
    digest: ImageDigest
    task: str
    controls: CacheControls
    key: str = ""  # the L2 key, set once L1 has missed (it needs the MD5)


Decoder = Callable[[bytes], DecodedImage]


class OcrCache:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        store: RedisStore | None,
        decode: Decoder,
        wait_for_engine: Callable[[], None] = lambda: None,
        on_engine_outcome: Callable[[bool], None] = lambda ok: None,
    ) -> None:
        self._settings = settings
        self._engine = engine
        self._store = store if settings.cache_enabled else None
        self._decode = decode
        self._wait_for_engine = wait_for_engine
        self._on_engine_outcome = on_engine_outcome
        self._codec = Codec(settings.cache_compress_min_bytes, settings.cache_encryption_keys)
        # Engine calls run here so a request can stop waiting after OCR_TIMEOUT_SECONDS, in
        # a bounded queue whose abandoned calls are dropped. HTTP and gRPC threads both call
        # in; a remote engine serves them concurrently, an in-process one says how many.
        callers = settings.engine_callers()
        self._engine_runner = EngineRunner(
            getattr(engine, "max_concurrency", None) or callers,
            settings.engine_queue_max or settings.web_threads,
            settings.ocr_timeout_seconds,
        )
        self._flights: SingleFlight[Outcome] = SingleFlight()
        self._l1 = L1Cache(
            settings.cache_l1_bytes if settings.cache_enabled else 0,
            settings.cache_l1_max_age_seconds,
        )
        self._notifier = (
            Notifier(self._store, settings.cache_key_prefix, on_purge=self._l1.clear)
            if self._store is not None
            else None
        )

    @property
    def store(self) -> RedisStore | None:
        return self._store

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def l1(self) -> L1Cache:
        return self._l1

    def _task(self, params: OcrParams) -> str:
        """The task segment: the task and the digest of its effective parameters, so equal
        parameters share entries however a protocol spelled them."""
        return f"{params.task}-{params.digest()}"

    def prefix(self, namespace: str = "") -> str:
        """``{CACHE_KEY_PREFIX}`` or, for a tenant, ``{CACHE_KEY_PREFIX}.{tenant}``."""
        base = self._settings.cache_key_prefix
        return f"{base}.{namespace}" if namespace else base

    def key_for(self, digest: ImageDigest, params: OcrParams, namespace: str = "") -> str:
        return build_key(
            self.prefix(namespace), self._engine.fingerprint, self._task(params), digest
        )

    def peek(self, image_bytes: bytes, params: OcrParams, namespace: str = "") -> OcrResult | None:
        """The stored result for exactly these params, or None: never computes, never writes
        (lets a caller answer from a related entry, e.g. extraction field subsets)."""
        if self._store is None:
            return None
        job = _Job(
            image_bytes, params, digest_image(image_bytes), self._task(params),
            CacheControls(namespace=namespace),
        )  # fmt: skip
        hit = self._l1.get(self._l1_key(job))
        if hit is not None:
            return hit
        job.key = self.key_for(job.digest, params, namespace)
        return self._reread(job)

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
        """Results in request order; all L2 lookups share one Redis round trip (MGET)."""
        params = params or self._engine.default_params
        self._engine.check_params(params)  # UnsupportedParams: a client error
        if self._store is None or controls.bypass:
            for _ in images:
                metrics.CACHE_REQUESTS.labels(result="bypass").inc()
            return [Outcome(self._compute(data, params), CacheStatus.BYPASS) for data in images]

        task = self._task(params)
        jobs = [_Job(data, params, digest_image(data), task, controls) for data in images]
        outcomes: list[Outcome | None] = [None] * len(images)
        if not controls.no_cache:
            for i, job in enumerate(jobs):
                hit = self._l1.get(self._l1_key(job))
                if hit is not None:
                    metrics.CACHE_REQUESTS.labels(result="hit").inc()
                    metrics.CACHE_TIER_HITS.labels(tier="l1").inc()
                    outcomes[i] = Outcome(hit, CacheStatus.HIT)
        pending = [i for i, outcome in enumerate(outcomes) if outcome is None]
        for i in pending:
            jobs[i].key = self.key_for(jobs[i].digest, params, controls.namespace)
        ok, values = True, [None] * len(pending)
        if pending and not controls.no_cache:
            ok, values = self._store.get_many([jobs[i].key for i in pending])
        for i, value in zip(pending, values, strict=True):
            job = jobs[i]
            hit = self._read(value, job)
            if hit is not None:
                metrics.CACHE_REQUESTS.labels(result="hit").inc()
                metrics.CACHE_TIER_HITS.labels(tier="l2").inc()
                outcomes[i] = Outcome(hit, CacheStatus.HIT)
                continue
            # Keyed on the full identity: two images with one MD5 share a Redis key (whose
            # entry the SHA-256 check guards), never a computation.
            flight = f"{job.key}#{job.digest.sha256}"
            outcome, shared = self._flights.do(flight, partial(self._miss, job, ok))
            if shared:
                outcome = Outcome(outcome.result, CacheStatus.COALESCED)
            label = "error" if not ok else outcome.status.value.lower()
            metrics.CACHE_REQUESTS.labels(result=label).inc()
            outcomes[i] = outcome
        return outcomes  # type: ignore[return-value]

    def _l1_key(self, job: _Job) -> tuple[str, ...]:
        namespace = job.controls.namespace
        return (self.prefix(namespace), self._engine.fingerprint, job.task, job.digest.sha256)

    def _read(self, value: bytes | None, job: _Job) -> OcrResult | None:
        """Decode an L2 value (a miss if unusable) and keep it in L1 until it expires."""
        if value is None:
            return None
        digest = job.digest
        entry = self._codec.decode(value, digest.sha256, self._engine.fingerprint, job.key)
        if entry is None:
            log.info("cache entry for %s is unusable; treating as a miss", digest.md5)
            return None
        try:
            result = OcrResult.from_dict(entry.result)
        except (KeyError, TypeError, ValueError):
            return None
        self._l1.put(self._l1_key(job), result, entry.expires_at - time.time())
        return result

    def _reread(self, job: _Job) -> OcrResult | None:
        assert self._store is not None
        return self._read(self._store.get_many([job.key])[1][0], job)

    def _miss(self, job: _Job, redis_ok: bool) -> Outcome:
        """One thread of this process computes ``job.key``; across processes, the lease
        decides."""
        assert self._store is not None
        controls = job.controls
        if redis_ok and not controls.no_cache:
            # Another computation may have finished between our read and our turn.
            hit = self._reread(job)
            if hit is not None:
                return Outcome(hit, CacheStatus.HIT)
        image = self._decode(job.data)  # InvalidImage: a client error, before any lease
        if controls.no_cache:
            return self._compute_and_store(job, image)
        # Even after a failed read: one slow answer (a loaded host) is not Redis being down,
        # and an open circuit makes the lease calls below fail fast anyway.
        deadline = time.monotonic() + self._settings.singleflight_wait_seconds
        lease = lease_key(job.key)
        channel = done_channel(self._settings.cache_key_prefix, job.key)  # one channel space
        failures = 0
        while True:
            token = secrets.token_hex(16)
            acquired = self._store.acquire_lease(lease, token, self._settings.singleflight_lease_ms)
            if acquired is None:
                failures += 1
                if failures >= _LEASE_ATTEMPTS or self._store.breaker_state == "open":
                    # Redis is unreachable: single-flight is in-process only now.
                    return self._compute_and_store(job, image)
                continue
            if acquired:
                return self._compute_as_owner(job, image, lease, token, channel)
            waited = self._wait_for_owner(job, lease, channel, deadline)
            if waited is not None:
                return Outcome(waited, CacheStatus.COALESCED)
            if time.monotonic() >= deadline:
                log.warning("waited %.0fs for another computation of %s; computing here",
                            self._settings.singleflight_wait_seconds, job.digest.md5)  # fmt: skip
                return self._compute_and_store(job, image)
            # The owner failed or died (its lease is gone or expiring): try to take over.

    def _wait_for_owner(
        self, job: _Job, lease: str, channel: str, deadline: float
    ) -> OcrResult | None:
        """Block on the owner's notification (not a poll); None if no result came."""
        assert self._notifier is not None and self._store is not None
        event = self._notifier.register(channel)
        try:
            hit = self._reread(job)
            if hit is not None:
                return hit
            if self._store.exists(lease) is False:
                return None  # released without a result (owner failed): take over now
            # At most one lease period per round: a crashed owner's lease expires by then.
            timeout = min(deadline - time.monotonic(), self._settings.singleflight_lease_ms / 1000)
            event.wait(max(0.0, timeout))
            return self._reread(job)
        finally:
            self._notifier.unregister(channel, event)

    def _compute_as_owner(
        self, job: _Job, image: DecodedImage, lease: str, token: str, channel: str
    ) -> Outcome:
        assert self._store is not None
        outcome = "error"
        try:
            with self._renewing(lease, token):
                # The previous owner may have stored the result just before we took over.
                hit = self._reread(job)
                if hit is not None:
                    outcome = "ok"
                    return Outcome(hit, CacheStatus.HIT)
                result = self._compute_and_store(job, image)
                outcome = "ok"
                return result
        finally:
            self._store.release_lease(lease, token)
            self._store.publish(channel, outcome)

    @contextmanager
    def _renewing(self, lease: str, token: str) -> Iterator[None]:
        """Keep the lease alive while computing: renew every third of its period."""
        assert self._store is not None
        store, ttl_ms = self._store, self._settings.singleflight_lease_ms
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(ttl_ms / 3000):
                # A renewal Redis did not answer is retried at the next tick: only a lease
                # that is provably someone else's now ends the renewals.
                if store.renew_lease(lease, token, ttl_ms) is False:
                    log.warning("lost the single-flight lease %s", lease)
                    return

        thread = threading.Thread(target=renew, name="lease-renew", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _compute_and_store(self, job: _Job, image: DecodedImage) -> Outcome:
        assert self._store is not None
        result = self._run_engine(image, job.data, job.params)
        if not job.controls.no_store:
            ttl = job.controls.ttl or self._ttl()
            fingerprint = self._engine.fingerprint
            entry = self._codec.encode(
                result.to_dict(), job.digest.sha256, fingerprint, ttl, job.key
            )
            # Waiters elsewhere read this entry when notified: one retry covers a slow answer.
            if not self._store.set(job.key, entry, ttl) and self._store.breaker_state == "closed":
                self._store.set(job.key, entry, ttl)
            self._l1.put(self._l1_key(job), result, ttl)
        return Outcome(result, CacheStatus.MISS)

    def _ttl(self) -> int:
        ttl = self._settings.cache_ttl_seconds
        jitter = int(ttl * self._settings.cache_ttl_jitter)
        return max(1, ttl - random.randint(0, jitter)) if jitter else ttl

    def _compute(self, data: bytes, params: OcrParams) -> OcrResult:
        return self._run_engine(self._decode(data), data, params)

    def _run_engine(self, image: DecodedImage, data: bytes, params: OcrParams) -> OcrResult:
        self._wait_for_engine()
        start = time.perf_counter()
        kind = self._engine.kind
        try:
            result = self._engine_runner.run(
                self._engine.recognize, OcrRequest(data, image, params)
            )
        except EngineBusy:
            metrics.ENGINE_CALLS.labels(engine=kind, outcome="busy").inc()
            raise  # load, not an engine failure: readiness is unchanged
        except EngineTimeout:
            metrics.ENGINE_CALLS.labels(engine=kind, outcome="timeout").inc()
            self._on_engine_outcome(False)
            raise
        except EngineError:
            metrics.ENGINE_CALLS.labels(engine=kind, outcome="error").inc()
            self._on_engine_outcome(False)
            raise
        self._on_engine_outcome(True)
        metrics.ENGINE_CALLS.labels(engine=kind, outcome="ok").inc()
        metrics.ENGINE_SECONDS.labels(engine=kind).observe(time.perf_counter() - start)
        return result

    def purge(self, namespace: str | None = None, md5: str | None = None) -> int:
        """Delete a namespace's entries, or one image's entries in a namespace, without
        blocking Redis (SCAN + UNLINK in batches); every process drops its L1."""
        assert self._store is not None
        prefix = self.prefix(namespace or "")
        pattern = f"{prefix}:*{{{md5}}}*" if md5 else f"{prefix}:*"
        removed = self._store.scan_unlink(pattern)
        self._l1.clear()
        self._store.publish(purge_channel(self._settings.cache_key_prefix), prefix)
        return removed
