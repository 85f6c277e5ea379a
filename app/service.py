"""The service's shared objects, built once per app from ``Settings`` and kept in
``app.extensions["ocr"]`` (the Flask tutorial's extension pattern): the blueprints read them
through ``current()``; gRPC and the gunicorn hooks take the same object."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from flask import current_app

from app import metrics
from app.cache.breaker import CircuitBreaker
from app.cache.extraction_index import ExtractionIndex
from app.cache.options import CacheOptions
from app.cache.region import OcrCache
from app.cache.store import RedisStore
from app.config import Settings
from app.engine_state import EngineState
from app.engines.base import Engine
from app.imaging import DecodedImage, decode_image
from app.vocabulary import OcrParams

log = logging.getLogger("app.web")  # the name its log lines have always carried


@dataclass
class OcrService:
    settings: Settings
    cache: OcrCache
    engine_state: EngineState
    extractions: ExtractionIndex
    # Read per request, so computed once here.
    engine_description: dict[str, Any]
    default_params: OcrParams
    default_task: str
    min_score: float  # OCR_REC_SCORE_THRESH: REST and the pipeline's default line filter
    grpc: Any = None  # the worker's gRPC server, when gunicorn started one

    def __getitem__(self, name: str) -> Any:
        """``extensions["ocr"]["cache"]``: the mapping form earlier callers and tests use."""
        return getattr(self, name)


def current() -> OcrService:
    service: OcrService = current_app.extensions["ocr"]
    return service


def build(settings: Settings, engine: Engine, store: RedisStore | None) -> OcrService:
    """The cache front door and the engine's loader (shared by HTTP and gRPC); starts loading."""
    if store is None and settings.cache_enabled and settings.redis_url:
        store = RedisStore(
            settings.redis_url,
            settings.redis_timeout_ms,
            settings.redis_connect_timeout_ms,
            CircuitBreaker(
                settings.redis_breaker_failures,
                settings.redis_breaker_cooldown_seconds,
                on_change=metrics.REDIS_BREAKER_OPEN.set,
            ),
            username=settings.redis_username,
            password=settings.redis_password,
            tls_ca_file=settings.redis_tls_ca_file,
            tls_cert_file=settings.redis_tls_cert_file,
            tls_key_file=settings.redis_tls_key_file,
        )
    if settings.cache_enabled and store is None:
        log.warning("REDIS_URL is not set: every request goes to the engine")
    if store is not None:
        _warn_if_not_evicting(store)

    def decode(data: bytes) -> DecodedImage:
        return decode_image(data, settings.max_image_pixels)

    engine.prepare()
    state = EngineState(
        engine,
        wait_seconds=float(settings.request_timeout_seconds),
        unready_after=settings.engine_unready_after_failures,
    )
    state.start()
    cache = OcrCache(
        CacheOptions.from_settings(settings),
        engine,
        store,
        decode,
        wait_for_engine=state.wait,
        on_engine_outcome=state.record,
    )
    return OcrService(
        settings=settings,
        cache=cache,
        engine_state=state,
        extractions=ExtractionIndex(cache, settings.cache_ttl_seconds),
        engine_description=engine.describe(),
        default_params=engine.default_params,
        default_task=settings.default_task(),
        min_score=settings.ocr_rec_score_thresh,
    )


def _warn_if_not_evicting(store: RedisStore) -> None:
    policy = store.eviction_policy()
    if policy == "noeviction":
        log.warning(
            "Redis maxmemory-policy is 'noeviction': writes will fail when memory is full; "
            "use allkeys-lru (docker/redis.conf)"
        )
