"""What the cache front door reads from ``Settings`` (fields named as there), filled by
``Settings`` like the engines' options: ``OcrCache`` never sees the whole configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.cache.l3 import L3Options
from app.engines.base import options_from


@dataclass(frozen=True)
class CacheOptions:
    cache_enabled: bool
    cache_key_prefix: str
    cache_ttl_seconds: int
    cache_ttl_jitter: float
    cache_compress_min_bytes: int
    cache_encryption_keys: tuple[tuple[str, bytes], ...]
    cache_l1_bytes: int
    cache_l1_max_age_seconds: float
    singleflight_lease_ms: int
    singleflight_wait_seconds: float
    ocr_timeout_seconds: float
    # Derived: engine threads of one worker (``Settings.engine_callers``; an engine that says
    # how many calls it takes at once overrides it) and the queue before EngineBusy.
    engine_callers: int
    engine_queue_size: int
    # Global miss dispatch (app/cache/dispatch.py) and engine batching.
    dispatch_enabled: bool
    dispatch_queue_max: int
    dispatch_claim_ms: int
    dispatch_max_deliveries: int
    engine_batch_max: int
    # The similarity tier (CACHE_SIMILAR, app/cache/near_dup.py) and its thresholds.
    cache_similar: bool
    cache_similar_max_distance: int
    cache_similar_max_aspect: float
    cache_similar_max_block: float
    cache_similar_max_line: float
    l3: L3Options  # the cold tier's own options (off when ``cache_l3_url`` is empty)

    @classmethod
    def from_settings(cls, settings: Any) -> CacheOptions:
        return options_from(
            cls,
            settings,
            engine_callers=settings.engine_callers(),
            engine_queue_size=settings.engine_queue_max or settings.web_threads,
            l3=L3Options.from_settings(settings),
        )
