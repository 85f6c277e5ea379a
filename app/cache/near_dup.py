"""Near-duplicate tiers after an exact-bytes miss: ``pixel`` (always on, exact) and
``similar`` (``CACHE_SIMILAR=on``, verified). ``OcrCache`` calls ``lookup`` once the image
is decoded and before it elects a computer, and ``record`` after it stored a fresh result.

Both read only what this engine (fingerprint), these parameters (task segment) and this
namespace wrote. Redis failures cost the tier, never the request. ``X-Cache-Similar: off``
(HTTP header or gRPC metadata) keeps one request off the similarity tier; it changes nothing
shared, so untrusted callers may send it too.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from app import metrics
from app.cache import verify
from app.cache.codec import Codec
from app.cache.keys import KeySpace
from app.cache.l1 import L1Cache
from app.cache.pixel_index import PixelIndex, pixel_digest
from app.cache.similarity import SimilarityIndex
from app.cache.store import RedisStore, Store
from app.engines.base import Engine
from app.imaging import DecodedImage
from app.vocabulary import CacheControls, CacheStatus, OcrResult, Outcome

if TYPE_CHECKING:
    from app.cache.options import CacheOptions

log = logging.getLogger(__name__)

SOURCE_HEADER = "X-Cache-Similar-Source"  # the SHA-256 of the cached image that answered
FIGURES_HEADER = "X-Cache-Similarity"  # the verification figures and the hash distance


class NearDuplicates:
    def __init__(
        self,
        settings: CacheOptions,
        engine: Engine,
        store: Store,
        keys: KeySpace,
        codec: Codec,
        l1: L1Cache,
    ) -> None:
        self._l1 = l1
        self._pixel: PixelIndex | None = None
        self._similar: SimilarityIndex | None = None
        if not isinstance(store, RedisStore):
            return
        if getattr(engine, "reads_decoded_pixels", False):
            self._pixel = PixelIndex(store, keys, codec)
        if settings.cache_similar:
            thresholds = verify.Thresholds(
                settings.cache_similar_max_aspect,
                settings.cache_similar_max_block,
                settings.cache_similar_max_line,
            )
            self._similar = SimilarityIndex(
                store, keys, codec, thresholds, settings.cache_similar_max_distance
            )

    def lookup(
        self, image: DecodedImage, task: str, controls: CacheControls, l1_key: tuple[str, ...]
    ) -> Outcome | None:
        """A pixel or similar hit for this decoded image, or None."""
        if self._pixel is not None:
            found = self._pixel.find(pixel_digest(image), task, controls.namespace)
            if found is not None:
                result, entry = found
                self._l1.put(l1_key, result, entry.expires_at - time.time())  # same pixels
                metrics.CACHE_TIER_HITS.labels(tier="pixel").inc()
                return Outcome(result, CacheStatus.HIT, "pixel")
        if self._similar is not None and controls.similar:
            hit = self._similar.find(image, task, controls.namespace)
            metrics.SIMILAR_CHECKS.labels(outcome="hit" if hit else "miss").inc()
            if hit is not None:
                metrics.CACHE_TIER_HITS.labels(tier="similar").inc()
                details = (
                    (SOURCE_HEADER, hit.source_sha256),
                    (FIGURES_HEADER, f"{hit.figures.header()}; distance={hit.distance}"),
                )
                return Outcome(hit.result, CacheStatus.HIT, "similar", details)
        return None

    def record(
        self,
        image: DecodedImage,
        result: OcrResult,
        task: str,
        controls: CacheControls,
        entry_key: str,
        sha256: str,
        ttl: int,
    ) -> None:
        """Index a freshly stored entry (same TTL, same namespace)."""
        if self._pixel is not None:
            self._pixel.record(
                pixel_digest(image), task, controls.namespace, entry_key, sha256, ttl
            )
        if self._similar is not None:
            self._similar.record(image, result, task, controls.namespace, entry_key, sha256, ttl)
