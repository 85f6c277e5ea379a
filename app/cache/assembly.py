"""The one place the cache is put together from its settings: the tier chain in its fixed
order, the miss path, the engine side and the global queue.

The chain's order (docs/ARCHITECTURE.md, "The tier chain"), each tier present only when it
can work:

1. ``extraction`` subsets (extraction requests, with Redis): answered before the exact tiers,
   as it always was (one SMEMBERS per extraction request);
2. ``l1``, this process's LRU;
3. ``l2``, Redis, shared by every process (one MGET for all the images of a request);
4. ``l3``, object storage (``CACHE_L3_URL``, with Redis);
5. ``pixel``, the same decoded pixels under other bytes (engines that read pixels, Redis);
6. ``similar``, a verified near-duplicate (``CACHE_SIMILAR=on``, Redis).

Adding a tier: one module with a ``tier.Tier`` and one line below.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from app.cache import verify
from app.cache.codec import Codec
from app.cache.documents import Documents
from app.cache.extraction_index import ExtractionTier
from app.cache.keys import KeySpace
from app.cache.l1 import L1Cache, L1Tier
from app.cache.l2 import L2Tier
from app.cache.l3 import ColdTier, L3Tier
from app.cache.lines import RedisLineStore
from app.cache.misses import MissPath
from app.cache.notify import Notifier
from app.cache.pixel_index import PixelIndex, PixelTier
from app.cache.quotas import Quotas
from app.cache.region import Decoder, OcrCache
from app.cache.similarity import SimilarityIndex, SimilarTier
from app.cache.store import NullStore, RedisStore, Store
from app.cache.tier import Chain, Tier
from app.engine_calls.compute import Computer, Ttl
from app.engine_calls.engine_runner import EngineRunner
from app.engines.base import Engine
from app.queue.requester import TicketQueue
from app.queue.ticket import BLOCK_MS
from app.tenants import TenantBook

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from app.config import (
        CacheSettings,
        DispatchSettings,
        EngineSettings,
        L3Settings,
        LinesSettings,
        Settings,
        SimilarSettings,
        TenantSettings,
    )


def for_settings(
    settings: Settings,
    engine: Engine,
    store: Store | None,
    decode: Decoder,
    wait_for_engine: Callable[[], None] = lambda: None,
    on_engine_outcome: Callable[[bool], None] = lambda ok: None,
    book: TenantBook | None = None,
    role: str = "combined",
) -> OcrCache:
    """``build`` with each section taken from the service's ``Settings`` (the wiring's way in,
    and the benchmarks' and tests'); ``book``: the tenants (none: read from the settings).
    ``role``: ``front`` (its engine is a proxy: it consumes no queue), ``engine`` (an engine
    process: ``ENGINE_WORKERS`` slots on the queue), ``combined`` (both in one process: the
    tests' and benchmarks' in-process service)."""
    callers = settings.engine_callers()
    if role == "engine":
        callers = settings.processes.engine_workers or (1 if engine.kind == "paddle" else 4)
    return build(
        cache=settings.cache,
        engine_settings=settings.engine,
        dispatch=settings.dispatch,
        similar=settings.similar,
        l3=settings.l3,
        tenants=settings.tenants,
        book=book if book is not None else tenant_book(settings.tenants),
        lines=settings.lines,
        engine=engine,
        store=store,
        decode=decode,
        callers=callers,
        feed=role != "front",
        queue_size=settings.server.web_threads,
        wait_for_engine=wait_for_engine,
        on_engine_outcome=on_engine_outcome,
        background_share=settings.jobs.share,
    )


def build(
    *,
    cache: CacheSettings,
    engine_settings: EngineSettings,
    dispatch: DispatchSettings,
    similar: SimilarSettings,
    l3: L3Settings,
    tenants: TenantSettings,
    book: TenantBook,
    engine: Engine,
    store: Store | None,
    decode: Decoder,
    callers: int,
    queue_size: int,
    wait_for_engine: Callable[[], None] = lambda: None,
    on_engine_outcome: Callable[[bool], None] = lambda ok: None,
    lines: LinesSettings | None = None,
    feed: bool = True,
    background_share: float = 1.0,
) -> OcrCache:
    """``callers``: threads of a worker that may call the engine at once (HTTP and gRPC):
    a remote engine serves them concurrently, an in-process one says how many it takes;
    ``queue_size``: engine calls that may wait here to start (``WEB_THREADS``); ``feed``:
    this process's engine consumes the global queue (False for a front: its engine is a
    proxy, whose calls the engine processes count and charge themselves)."""
    store = store if store is not None and cache.enabled else NullStore()
    keys = KeySpace(cache.key_prefix, engine.fingerprint)
    codec = Codec(cache.encryption_keys)
    l1 = L1Cache(cache.l1_bytes if cache.enabled else 0, cache.l1_max_age_seconds)
    redis = store if isinstance(store, RedisStore) else None
    cold = ColdTier(l3, codec, callers) if l3.url and redis else None

    l1_tier, l2_tier = L1Tier(l1, keys), L2Tier(store, keys, codec)
    tiers: list[Tier | None] = [
        ExtractionTier(redis, keys, (l1_tier, l2_tier), cache.ttl_seconds) if redis else None,
        l1_tier,
        l2_tier,
        L3Tier(cold, keys, codec, cache.ttl_seconds) if cold else None,
        PixelTier(PixelIndex(redis, keys, codec))
        if redis and engine.reads_decoded_pixels
        else None,
        SimilarTier(SimilarityIndex(redis, keys, codec, _thresholds(similar), similar.max_distance))
        if redis and similar.enabled
        else None,
    ]
    chain = Chain([tier for tier in tiers if tier is not None])
    _use_lines(engine, redis, keys, codec, lines, Ttl(cache.ttl_seconds, cache.ttl_jitter))

    slots = engine.slots or callers
    interject = engine.interject if engine.can_interject else None  # in-process (paddle)
    runner = EngineRunner(slots, queue_size, engine_settings.timeout_seconds, interject)
    quotas = Quotas(
        store, keys, book, failure_limit=tenants.failure_limit,
        slot_seconds=engine_settings.timeout_seconds + 5,
        mean_seconds=lambda: runner.mean_seconds,
    )  # fmt: skip
    computer = Computer(
        engine, runner, chain, keys, Ttl(cache.ttl_seconds, cache.ttl_jitter), decode,
        wait_for_engine, on_engine_outcome,
        charge=quotas.charge if feed else lambda namespace, seconds: None, direct=not feed,
    )  # fmt: skip
    queue, feeders = None, None
    if redis is not None:
        fair = dispatch.fairness == "drr"
        notifier = Notifier(redis, keys, on_purge=l1.clear)
        notifier.start()
        queue = TicketQueue(
            redis, keys, notifier,
            per_engine_max=dispatch.queue_max,
            live_ms=max(dispatch.claim_ms, 3 * BLOCK_MS),
            poll_seconds=dispatch.check_seconds,  # a waiter's fallback check on its ticket
            mean_seconds=lambda: runner.mean_seconds,
            writer=codec.writer,
            fair=fair,
            share=book.share,
            background_share=background_share,
            label=book.label,
            shards=dispatch.shards,
            home=max(0, dispatch.shard),  # the shard this process's engines serve
        )  # fmt: skip
    if redis is not None and queue is not None and feed:
        if dispatch.shards > 1 and dispatch.shard < 0:  # as `python -m app engine` refuses
            raise ValueError(f"DISPATCH_SHARD: required where engines feed from "
                             f"DISPATCH_SHARDS={dispatch.shards} shards")  # fmt: skip
        from app.engine_side.feeders import Feeders  # engine side: never loaded in a front

        feeders = Feeders(
            redis, keys, queue, slots=slots, claim_ms=dispatch.claim_ms,
            max_deliveries=dispatch.max_deliveries, batch_max=engine_settings.batch_max,
            mean_seconds=lambda: runner.mean_seconds, label=book.label, labels=book.labels,
            hold_seconds=tenants.queue_hold_seconds,
            interjecting=interject is not None and dispatch.interject and fair,
        )  # fmt: skip
        broken_after = engine_settings.unready_after_failures
        feeders.start(wait_for_engine, lambda ts, inside: computer.serve(feeders, ts, inside),
                      healthy=lambda: not computer.failing,
                      broken=lambda: computer.failures >= broken_after)  # fmt: skip
    misses = MissPath(
        computer, queue, store, keys, codec, engine_settings.timeout_seconds,
        keep=lambda probe, result, ttl: chain.write_back(probe, result, ttl, "l2"),
        quotas=quotas,
    )  # fmt: skip
    return OcrCache(
        engine=engine, store=store, keys=keys, chain=chain, misses=misses, computer=computer,
        documents=Documents(store, keys, codec), decode=decode, l1=l1, l3=cold,
        feeders=feeders, quotas=quotas,
    )  # fmt: skip


def tenant_book(tenants: TenantSettings) -> TenantBook:
    """The tenants file's book (an empty one without a file)."""
    return TenantBook(tenants.keys_file, tenants.reload_seconds)


def _use_lines(
    engine: Engine,
    redis: RedisStore | None,
    keys: KeySpace,
    codec: Codec,
    lines: LinesSettings | None,
    ttl: Ttl,
) -> None:
    """Line reuse into the engine (``CACHE_LINES``, an engine that ``reuses_lines``, Redis),
    or out of it: an engine shared by several caches (the tests') takes the last one's say.
    ``ttl``: the entries' (``CACHE_LINES_TTL_SECONDS=0``, the default, means theirs)."""
    enabled = lines is not None and lines.enabled
    if enabled and (not engine.reuses_lines or redis is None):
        log.warning(
            "CACHE_LINES=on has no effect: %s",
            "no Redis (caching off or no REDIS_URL)"
            if engine.reuses_lines
            else f"the {engine.kind} engine does not reuse lines (only OCR_ENGINE=paddle does)",
        )
    if not engine.reuses_lines:
        return
    if not enabled or redis is None:
        engine.use_line_store(None)
        return
    assert lines is not None
    seconds = Ttl(lines.ttl_seconds, ttl.jitter) if lines.ttl_seconds else ttl
    engine.use_line_store(RedisLineStore(redis, keys, codec, seconds, engine.line_schema))


def _thresholds(similar: SimilarSettings) -> verify.Thresholds:
    return verify.Thresholds(similar.max_aspect, similar.max_block, similar.max_line)
