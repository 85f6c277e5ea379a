"""The service's shared objects, built once per app from ``Settings`` and kept in
``app.extensions["ocr"]`` (the Flask tutorial's extension pattern): the blueprints read them
through ``current()``; gRPC and the front server's worker hooks take the same object."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from flask import current_app

from app import metrics, tracing
from app.admission import Admission
from app.cache import assembly, traced
from app.cache.breaker import CircuitBreaker
from app.cache.region import OcrCache
from app.cache.store import RedisStore
from app.config import Settings
from app.engine_state import EngineState
from app.engines.base import Engine
from app.imaging import DecodedImage, decode_image
from app.jobs.store import JobStore
from app.vocabulary import OcrParams

log = logging.getLogger("app.web")  # the name its log lines have always carried


@dataclass
class OcrService:
    settings: Settings
    cache: OcrCache
    engine_state: EngineState
    # Read per request, so computed once here.
    engine_description: dict[str, Any]
    default_params: OcrParams
    default_task: str
    min_score: float  # OCR_REC_SCORE_THRESH: REST and the pipeline's default line filter
    admission: Admission  # who is asking (AUTH=keys), and the tenant's request rate
    grpc: Any = None  # the worker's gRPC server, when the front server started one
    jobs: JobStore | None = None  # document jobs (None: off, or no Redis)

    def __getitem__(self, name: str) -> Any:
        """``extensions["ocr"]["cache"]``: the mapping form earlier callers and tests use."""
        return getattr(self, name)


def current() -> OcrService:
    service: OcrService = current_app.extensions["ocr"]
    return service


def build(
    settings: Settings, engine: Engine, store: RedisStore | None, role: str = "combined"
) -> OcrService:
    """The cache front door and the engine's loader (shared by HTTP and gRPC). The caller
    starts the load (``engine_state.start()``) once its routes exist: CPython 3.11's ``ast``
    is not safe across threads (gh-106905), and werkzeug compiling a URL rule while PaddleX
    read its model's configuration in the loader's thread failed with "AST constructor
    recursion depth mismatch" (in a clean-clone ``make test``). ``role``: ``front``
    (``engine`` is a proxy), ``engine`` (an engine process) or ``combined`` (both in one
    process; ``assembly.for_settings``)."""
    redis = settings.redis
    if store is None and settings.cache.enabled and redis.url:
        store = RedisStore(
            redis.url,
            redis.timeout_ms,
            redis.connect_timeout_ms,
            CircuitBreaker(
                redis.breaker_failures,
                redis.breaker_cooldown_seconds,
                on_change=metrics.REDIS_BREAKER_OPEN.set,
            ),
            username=redis.username,
            password=redis.password,
            tls_ca_file=redis.tls_ca_file,
            tls_cert_file=redis.tls_cert_file,
            tls_key_file=redis.tls_key_file,
        )
    if settings.cache.enabled and store is None:
        log.warning("REDIS_URL is not set: every request goes to the engine")
    if store is not None:
        _warn_if_not_evicting(store)

    def decode(data: bytes) -> DecodedImage:
        return decode_image(data, settings.server.max_image_pixels)

    engine.prepare()
    state = EngineState(
        engine,
        wait_seconds=float(settings.server.request_timeout_seconds),
        unready_after=settings.engine.unready_after_failures,
    )
    book = assembly.tenant_book(settings.tenants)
    metrics.initialise_tenants(book.labels())
    cache = assembly.for_settings(
        settings, engine, store, decode, wait_for_engine=state.wait,
        on_engine_outcome=state.record, book=book, role=role,
    )  # fmt: skip
    traced.instrument(cache, tracing.TRACER)  # tracing off: left as it is
    return OcrService(
        settings=settings,
        cache=cache,
        engine_state=state,
        engine_description=engine.describe(),
        default_params=engine.default_params,
        default_task=settings.default_task(),
        min_score=settings.ocr.rec_score_thresh,
        admission=Admission(settings, book, cache.quotas),
        jobs=job_store(settings),
    )


def job_store(settings: Settings) -> JobStore | None:
    """Where document jobs live: the cache's Redis, on a client of their own."""
    redis = settings.redis
    if not (settings.jobs.enabled and settings.cache.enabled and redis.url):
        return None
    return JobStore(
        redis.url, settings.cache.key_prefix, settings.jobs.ttl_seconds,
        username=redis.username, password=redis.password, tls_ca_file=redis.tls_ca_file,
        tls_cert_file=redis.tls_cert_file, tls_key_file=redis.tls_key_file,
    )  # fmt: skip


def _warn_if_not_evicting(store: RedisStore) -> None:
    policy = store.eviction_policy()
    if policy and "noeviction" in policy:  # on a cluster, any primary's
        log.warning(
            "Redis maxmemory-policy is 'noeviction': writes will fail when memory is full; "
            "use allkeys-lru (docker/redis.conf)"
        )
