"""``OcrCache.get_or_compute``: the one front door from a canonical request to a result.

Tiers in, one creator out: L1 (in-process LRU) -> L2 (Redis, one MGET per request) ->
single-flight -> engine -> encode -> SET EX ttl. Single-flight has two layers: threads of one
process share one computation per key (``SingleFlight``), and processes and replicas elect one
computer per key (``election.Election``, the Redis lease). The names it uses are the
``keys.KeySpace``'s; caching off is a ``store.NullStore``. Every protocol adapter calls this,
so an image first seen over one protocol is a hit over all of them.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from app import metrics
from app.cache.codec import Codec
from app.cache.dispatch import Dispatcher
from app.cache.dispatch import Job as DispatchJob
from app.cache.documents import Documents
from app.cache.election import Election
from app.cache.engine_runner import EngineBusy, EngineRunner
from app.cache.keys import ImageDigest, KeySpace, digest_image
from app.cache.l1 import L1Cache
from app.cache.l3 import ColdTier
from app.cache.near_dup import NearDuplicates
from app.cache.notify import Notifier
from app.cache.options import CacheOptions
from app.cache.singleflight import SingleFlight
from app.cache.store import NullStore, RedisStore, Store
from app.engines.base import Engine, OcrRequest
from app.imaging import DecodedImage
from app.vocabulary import (
    TENANT_NAME,
    CacheControls,
    CacheStatus,
    ClientError,
    EngineError,
    EngineTimeout,
    OcrParams,
    OcrResult,
    Outcome,
)

log = logging.getLogger(__name__)


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
        options: CacheOptions,
        engine: Engine,
        store: Store | None,
        decode: Decoder,
        wait_for_engine: Callable[[], None] = lambda: None,
        on_engine_outcome: Callable[[bool], None] = lambda ok: None,
    ) -> None:
        self._options = options
        self._engine = engine
        self._store: Store = store if store is not None and options.cache_enabled else NullStore()
        self._keys = KeySpace(options.cache_key_prefix, engine.fingerprint)
        self._decode = decode
        self._wait_for_engine = wait_for_engine
        self._engine_failing = False  # the last engine call failed (dispatch feeders slow down)

        def record_outcome(ok: bool) -> None:
            self._engine_failing = not ok
            on_engine_outcome(ok)

        self._on_engine_outcome = record_outcome
        self._codec = Codec(options.cache_compress_min_bytes, options.cache_encryption_keys)
        # Engine calls run here so a request can stop waiting after OCR_TIMEOUT_SECONDS, in
        # a bounded queue whose abandoned calls are dropped. HTTP and gRPC threads both call
        # in; a remote engine serves them concurrently, an in-process one says how many.
        slots = getattr(engine, "max_concurrency", None) or options.engine_callers
        self._engine_runner = EngineRunner(
            slots, options.engine_queue_size, options.ocr_timeout_seconds
        )
        self._flights: SingleFlight[Outcome] = SingleFlight()
        self._l1 = L1Cache(
            options.cache_l1_bytes if options.cache_enabled else 0,
            options.cache_l1_max_age_seconds,
        )
        # Bound once: a labels() lookup per hit is measurable on the L2 hit path.
        self._l2_hit_counters = (
            metrics.CACHE_REQUESTS.labels(result="hit"),
            metrics.CACHE_TIER_HITS.labels(tier="l2"),
        )
        # L3: object storage below Redis (CACHE_L3_URL), only where there is a Redis tier.
        self._l3 = ColdTier.from_options(options.l3, self._codec) if self._store.enabled else None
        # Near-duplicate tiers (pixel, similar) after an exact miss (app/cache/near_dup.py).
        self._near = NearDuplicates(options, engine, self._store, self._keys, self._codec, self._l1)
        # Documents (PDFs): their page lists, so a repeated one is not rendered again.
        self._documents = Documents(self._store, self._keys, self._codec)
        self._election: Election | None = None
        if isinstance(self._store, RedisStore):
            notifier = Notifier(self._store, self._keys, on_purge=self._l1.clear)
            self._election = Election(
                self._store,
                notifier,
                options.singleflight_lease_ms,
                options.singleflight_wait_seconds,
            )
        # Global miss dispatch: this process's misses go to one queue for every engine, and
        # its engine takes the next job from it whenever it is free (``dispatch.py``).
        self._dispatcher: Dispatcher | None = None
        if self._election is not None and options.dispatch_enabled:
            self._dispatcher = Dispatcher(
                self._store,  # type: ignore[arg-type]
                self._keys,
                notifier,
                slots=slots,
                per_engine_max=options.dispatch_queue_max or options.engine_queue_size,
                claim_ms=options.dispatch_claim_ms,
                max_deliveries=options.dispatch_max_deliveries,
                batch_max=options.engine_batch_max,
                poll_seconds=max(0.5, options.singleflight_lease_ms / 5000),
                mean_seconds=lambda: self._engine_runner.mean_seconds,
                writer=self._codec.writer,
            )
            self._dispatcher.start(
                self._wait_for_engine, self._serve_jobs, healthy=lambda: not self._engine_failing
            )

    def dispatch_ready(self, timeout: float) -> bool:
        """True once this process's engine takes jobs from the global queue (at once when
        dispatch is off): until then its misses are computed here."""
        return self._dispatcher is None or self._dispatcher.reported.wait(timeout)

    def close(self) -> None:
        """Stop taking jobs from the global queue (jobs being computed finish)."""
        if self._dispatcher is not None:
            self._dispatcher.stop()

    @property
    def store(self) -> Store:
        """The Redis tier, or a ``NullStore`` (``store.enabled`` is False) when caching is off."""
        return self._store

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def l1(self) -> L1Cache:
        return self._l1

    @property
    def keys(self) -> KeySpace:
        return self._keys

    @property
    def l3(self) -> ColdTier | None:
        """The cold tier (object storage), or None when ``CACHE_L3_URL`` is unset."""
        return self._l3

    def prefix(self, namespace: str = "") -> str:
        """``{CACHE_KEY_PREFIX}`` or, for a tenant, ``{CACHE_KEY_PREFIX}.{tenant}``."""
        return self._keys.prefix(namespace)

    def key_for(self, digest: ImageDigest, params: OcrParams, namespace: str = "") -> str:
        return self._keys.entry(digest, self._keys.task(params), namespace)

    def peek(self, image_bytes: bytes, params: OcrParams, namespace: str = "") -> OcrResult | None:
        """The stored result for exactly these params, or None: never computes, never writes
        (lets a caller answer from a related entry, e.g. extraction field subsets)."""
        if not self._store.enabled:
            return None
        job = _Job(
            image_bytes, params, digest_image(image_bytes), self._keys.task(params),
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
        if not self._store.enabled or controls.bypass:
            for _ in images:
                metrics.CACHE_REQUESTS.labels(result="bypass").inc()
            return [Outcome(self._compute(data, params), CacheStatus.BYPASS) for data in images]

        task = self._keys.task(params)
        jobs = [_Job(data, params, digest_image(data), task, controls) for data in images]
        ok, outcomes = self._lookup(jobs, controls)
        self._count_hits(outcomes)
        for i, outcome in enumerate(outcomes):
            if outcome is not None:
                continue
            job = jobs[i]
            # Keyed on the full identity: two images with one MD5 share a Redis key (whose
            # entry the SHA-256 check guards), never a computation.
            # A request that refuses the similarity tier never shares a similar answer.
            flight = f"{job.key}#{job.digest.sha256}#{int(job.controls.similar)}"
            outcome, shared = self._flights.do(flight, partial(self._miss, job, ok))
            if shared:
                outcome = Outcome(
                    outcome.result, CacheStatus.COALESCED, outcome.tier, outcome.details
                )
            label = "error" if not ok else outcome.status.value.lower()
            metrics.CACHE_REQUESTS.labels(result=label).inc()
            outcomes[i] = outcome
        return outcomes  # type: ignore[return-value]

    def get_or_compute_document(
        self,
        document: bytes,
        spec: str,
        render: Callable[[], list[bytes]],
        params: OcrParams | None = None,
        controls: CacheControls = CacheControls(),
        need_pages: bool = False,
    ) -> tuple[list[bytes] | None, list[Outcome]]:
        """A document's outcomes, one per page: from its page list (``documents``) when
        every page is a hit, without rendering (pages: None); else ``render()``'s pages
        through ``get_or_compute_many``, and the page list recorded. ``spec`` names the
        renderer; ``need_pages``: the caller needs the pictures (they are rendered)."""
        params = params or self._engine.default_params
        usable = self._store.enabled and not controls.bypass
        digest = digest_image(document)
        if usable and not controls.no_cache and not need_pages:
            self._engine.check_params(params)
            pages = self._documents.lookup(digest, spec, controls.namespace)
            if pages is not None:
                task = self._keys.task(params)
                jobs = [_Job(b"", params, page, task, controls) for page in pages]
                _, found = self._lookup(jobs, controls)
                if all(outcome is not None for outcome in found):
                    self._count_hits(found)
                    return None, found  # type: ignore[return-value]
        images = render()
        outcomes = self.get_or_compute_many(images, params, controls)
        if usable and not controls.no_store:
            ttl = controls.ttl or self._ttl()
            pages = [digest_image(image) for image in images]
            self._documents.record(digest, spec, controls.namespace, pages, ttl)
        return images, outcomes

    def _lookup(
        self, jobs: list[_Job], controls: CacheControls
    ) -> tuple[bool, list[Outcome | None]]:
        """L1, then L2 for the rest in one MGET: each job's hit, or None (counts nothing).
        ``ok``: Redis answered."""
        outcomes: list[Outcome | None] = [None] * len(jobs)
        if not controls.no_cache:
            for i, job in enumerate(jobs):
                hit = self._l1.get(self._l1_key(job))
                if hit is not None:
                    outcomes[i] = Outcome(hit, CacheStatus.HIT, "l1")
        pending = [i for i, outcome in enumerate(outcomes) if outcome is None]
        for i in pending:
            jobs[i].key = self.key_for(jobs[i].digest, jobs[i].params, controls.namespace)
        ok, values = True, [None] * len(pending)
        if pending and not controls.no_cache:
            ok, values = self._store.get_many([jobs[i].key for i in pending])
        for i, value in zip(pending, values, strict=True):
            hit = self._read(value, jobs[i])
            if hit is not None:
                outcomes[i] = Outcome(hit, CacheStatus.HIT, "l2")
        return ok, outcomes

    def _count_hits(self, outcomes: list[Outcome | None]) -> None:
        for outcome in outcomes:
            if outcome is None:
                continue
            if outcome.tier == "l2":
                self._l2_hit_counters[0].inc()
                self._l2_hit_counters[1].inc()
            else:
                metrics.CACHE_REQUESTS.labels(result="hit").inc()
                metrics.CACHE_TIER_HITS.labels(tier=outcome.tier).inc()

    def _l1_key(self, job: _Job) -> tuple[str, ...]:
        return self._keys.l1(job.digest, job.task, job.controls.namespace)

    def _read(self, value: bytes | None, job: _Job) -> OcrResult | None:
        """Decode an L2 value (a miss if unusable) and keep it in L1 until it expires."""
        if value is None:
            return None
        digest = job.digest
        entry = self._codec.decode(value, digest.sha256, self._engine.fingerprint, job.key)
        if entry is None:
            log.info("cache entry for %s is unusable; treating as a miss", digest.md5)
            return None
        result = entry.result
        if self._l1.enabled:
            self._l1.put(self._l1_key(job), result, entry.expires_at - time.time())
        return result

    def _reread(self, job: _Job) -> OcrResult | None:
        return self._read(self._store.get_many([job.key])[1][0], job)

    def _miss(self, job: _Job, redis_ok: bool) -> Outcome:
        """One thread of this process computes ``job.key``; across processes, the election
        decides."""
        controls = job.controls
        if redis_ok and not controls.no_cache:
            # Another computation may have finished between our read and our turn.
            hit = self._reread(job)
            if hit is not None:
                return Outcome(hit, CacheStatus.HIT, "l2")
        if self._l3 is not None and not controls.no_cache:
            recalled = self._recall(job)  # one GET per image per process (single-flight)
            if recalled is not None:
                return recalled
        image = self._decode(job.data)  # InvalidImage: a client error, before any lease
        if redis_ok and not controls.no_cache:
            near = self._near.lookup(image, job.task, controls, self._l1_key(job))
            if near is not None:
                return near
        compute = partial(self._compute_and_store, job, image)
        if controls.no_cache or self._election is None:
            return compute()
        # The owner hands its miss to whichever engine is free first; an entry that is not to
        # be stored (no-store) has nothing to hand back through Redis: computed here.
        dispatch = None
        if self._dispatcher is not None and not controls.no_store:
            dispatch = partial(self._dispatch, job, compute)
        return self._election.run(
            self._keys.lease(job.key),
            self._keys.done(job.key),
            partial(self._reread, job),
            compute,
            label=job.digest.md5,
            dispatch=dispatch,
        )

    def _dispatch(self, job: _Job, compute: Callable[[], Outcome], token: str) -> Outcome:
        """As the lease's owner: queue the job for any engine and wait for its entry."""
        assert self._dispatcher is not None
        queued = DispatchJob(
            key=job.key, sha256=job.digest.sha256, token=token, params=job.params,
            namespace=job.controls.namespace, ttl=job.controls.ttl or self._ttl(),
            deadline=time.time() + self._options.ocr_timeout_seconds, data=job.data,
            archive=not job.controls.ttl,
        )  # fmt: skip
        error_key = self._keys.job_error(job.key, token)

        def read() -> tuple[bool, OcrResult | None, str | None]:
            ok, (entry, error) = self._store.get_many([job.key, error_key])
            return ok, self._read(entry, job), error.decode() if error else None

        result = self._dispatcher.request(queued, read, self._options.ocr_timeout_seconds)
        return compute() if result is None else Outcome(result, CacheStatus.MISS)

    def _serve_jobs(self, jobs: Sequence[DispatchJob]) -> None:
        """A feeder's jobs (this process's engine is free): compute, store, notify; a failed
        job gets an error marker instead (never an entry)."""
        assert self._dispatcher is not None
        groups: dict[OcrParams, list[tuple[DispatchJob, DecodedImage]]] = {}
        for queued in jobs:
            if not self._is_genuine(queued):
                # Only a writer to Redis could queue this (a key that is not the one its image,
                # params and tenant name): refused, so no entry can be stored under it.
                log.warning("dispatch: job %s does not match its key; refused", queued.id)
                self._dispatcher.fail(queued, "error:a queued job that does not match its key")
                metrics.DISPATCH_JOBS.labels(outcome="failed").inc()
                continue
            try:
                groups.setdefault(queued.params, []).append((queued, self._decode(queued.data)))
            except ClientError as exc:  # cannot happen for a job its requester decoded
                self._dispatcher.fail(queued, f"error:{exc}")
        for params, members in groups.items():
            answered: set[str] = set()
            try:
                self._serve_group(params, members, answered)
            except Exception as exc:  # a bug: the requesters hear of it now, not at their timeout
                log.exception("dispatch: serving %d jobs failed", len(members))
                self._engine_failing = True  # this feeder slows down (readiness unchanged)
                for queued, _ in members:
                    if queued.id not in answered:
                        self._dispatcher.fail(queued, f"bug:{exc.__class__.__name__}")
                        metrics.DISPATCH_JOBS.labels(outcome="failed").inc()

    def _is_genuine(self, queued: DispatchJob) -> bool:
        """A job's key is what its own bytes, params and tenant make (and its SHA-256 theirs)."""
        if queued.namespace and not TENANT_NAME.fullmatch(queued.namespace):
            return False
        try:
            self._engine.check_params(queued.params)
        except ClientError:
            return False
        digest = digest_image(queued.data)
        return digest.sha256 == queued.sha256 and queued.key == self.key_for(
            digest, queued.params, queued.namespace
        )

    def _serve_group(
        self,
        params: OcrParams,
        members: list[tuple[DispatchJob, DecodedImage]],
        answered: set[str],
    ) -> None:
        """One engine call for jobs of the same params; each job's id joins ``answered``."""
        assert self._dispatcher is not None
        requests = [OcrRequest(q.data, image, params) for q, image in members]
        # The requester's deadline bounds the call, not this process's own timeout.
        left = min(q.deadline for q, _ in members) - time.time()
        answers = self._run_engine_many(requests, left)
        for (queued, image), answer in zip(members, answers, strict=True):
            self._answer_job(queued, image, answer)
            answered.add(queued.id)

    def _answer_job(
        self, queued: DispatchJob, image: DecodedImage, answer: OcrResult | Exception
    ) -> None:
        """Store a computed job in every tier and notify, or leave its error marker."""
        assert self._dispatcher is not None
        if isinstance(answer, EngineBusy):
            self._dispatcher.fail(queued, f"busy:{answer.retry_after}:{answer}")
        elif isinstance(answer, EngineTimeout):
            self._dispatcher.fail(queued, f"timeout:{answer}")
        elif isinstance(answer, Exception):
            self._dispatcher.fail(queued, f"error:{answer}")
        else:
            metrics.DISPATCH_JOBS.labels(outcome="computed").inc()
            if self._write_entry(self._job_of(queued), image, answer, queued.ttl):
                self._store.publish(self._keys.done(queued.key), "ok")
            else:  # the requester computes for itself rather than wait in vain
                self._dispatcher.fail(queued, "lost")
            return
        metrics.DISPATCH_JOBS.labels(outcome="failed").inc()

    def _job_of(self, queued: DispatchJob) -> _Job:
        """A queued job as this process's front door would have seen it (to store it)."""
        task = self._keys.task(queued.params)
        controls = CacheControls(
            namespace=queued.namespace, ttl=None if queued.archive else queued.ttl
        )
        job = _Job(
            queued.data, queued.params, digest_image(queued.data), task, controls, queued.key
        )
        return job

    def _compute_and_store(self, job: _Job, image: DecodedImage) -> Outcome:
        result = self._run_engine(image, job.data, job.params)
        if not job.controls.no_store:
            ttl = job.controls.ttl or self._ttl()
            self._write_entry(job, image, result, ttl)
        return Outcome(result, CacheStatus.MISS)

    def _write_entry(self, job: _Job, image: DecodedImage, result: OcrResult, ttl: int) -> bool:
        """Store a computed result in every tier: L2 (what waiters elsewhere read when
        notified), L1, the cold tier (write-behind) and the near-duplicate indexes."""
        fingerprint = self._engine.fingerprint
        entry = self._codec.encode(result, job.digest.sha256, fingerprint, ttl, job.key)
        # Waiters elsewhere read this entry when notified: one retry covers a slow answer.
        stored = self._store.set(job.key, entry, ttl)
        if not stored and self._store.breaker_state == "closed":
            stored = self._store.set(job.key, entry, ttl)
        self._l1.put(self._l1_key(job), result, ttl)
        if self._l3 is not None and not job.controls.ttl:  # a caller's own TTL stays off L3
            self._l3.archive(self._object_name(job), entry)  # write-behind, never blocks
        self._near.record(image, result, job.task, job.controls, job.key, job.digest.sha256, ttl)
        return stored

    def _object_name(self, job: _Job) -> str:
        return self._keys.object(job.digest, job.task, job.controls.namespace)

    def _recall(self, job: _Job) -> Outcome | None:
        """L3 read-through: a verified object refills L2 (a fresh envelope for the rest of
        its L3 retention, at most CACHE_TTL_SECONDS or the request's TTL) and L1, unless the
        request says no-store."""
        assert self._l3 is not None
        fingerprint = self._engine.fingerprint
        found = self._l3.recall(self._object_name(job), job.key, job.digest.sha256, fingerprint)
        if found is None:
            return None
        bound = job.controls.ttl or self._options.cache_ttl_seconds
        ttl = max(1, int(min(found.remaining_seconds, bound)))
        if not job.controls.no_store:
            entry = self._codec.encode(found.result, job.digest.sha256, fingerprint, ttl, job.key)
            self._store.set(job.key, entry, ttl)
            self._l1.put(self._l1_key(job), found.result, ttl)
        metrics.CACHE_TIER_HITS.labels(tier="l3").inc()
        return Outcome(found.result, CacheStatus.HIT, "l3")

    def _ttl(self) -> int:
        ttl = self._options.cache_ttl_seconds
        jitter = int(ttl * self._options.cache_ttl_jitter)
        return max(1, ttl - random.randint(0, jitter)) if jitter else ttl

    def _compute(self, data: bytes, params: OcrParams) -> OcrResult:
        return self._run_engine(self._decode(data), data, params)

    def _run_engine(
        self, image: DecodedImage, data: bytes, params: OcrParams, timeout: float | None = None
    ) -> OcrResult:
        self._wait_for_engine()
        kind, spent = self._engine.kind, []
        try:
            result = self._engine_runner.run(
                self._engine.recognize, OcrRequest(data, image, params),
                timeout=timeout, elapsed=spent,
            )  # fmt: skip
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
        # The engine's own time (a call that waited in the worker queue is not slower).
        metrics.ENGINE_SECONDS.labels(engine=kind).observe(sum(spent))
        return result

    def _run_engine_many(
        self, requests: list[OcrRequest], timeout: float
    ) -> list[OcrResult | Exception]:
        """``ENGINE_BATCH_MAX`` jobs with one set of parameters: one engine call where the
        engine takes a list (``recognize_many``); a failed batch is retried image by image,
        so one bad image fails only itself."""
        many = getattr(self._engine, "recognize_many", None)
        if len(requests) > 1 and many is not None:
            self._wait_for_engine()
            spent: list[float] = []
            try:
                results = self._engine_runner.run(many, requests, timeout=timeout, elapsed=spent)
            except EngineError:
                pass
            else:
                self._on_engine_outcome(True)
                kind, share = self._engine.kind, sum(spent) / len(requests)
                for _ in results:
                    metrics.ENGINE_CALLS.labels(engine=kind, outcome="ok").inc()
                    metrics.ENGINE_SECONDS.labels(engine=kind).observe(share)
                return list(results)
        answers: list[OcrResult | Exception] = []
        for request in requests:
            try:
                answers.append(
                    self._run_engine(request.image, request.data, request.params, timeout)
                )
            except EngineError as exc:
                answers.append(exc)
        return answers

    def purge(self, namespace: str | None = None, md5: str | None = None) -> int:
        """Delete a namespace's entries, or one image's entries in a namespace, without
        blocking Redis (SCAN + UNLINK in batches); every process drops its L1."""
        removed = self._store.scan_unlink(self._keys.purge_pattern(namespace or "", md5))
        self._l1.clear()
        self._store.publish(self._keys.purge_channel(), self._keys.prefix(namespace or ""))
        if self._l3 is not None:  # L3 objects too (list + delete by prefix); counted in removed
            removed += self._l3.purge(self._keys.object_prefix(namespace or "", md5)) or 0
        return removed
