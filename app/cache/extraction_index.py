"""Field-level reuse for ``extraction``: a request whose fields are a subset of an earlier
extraction of the same image is answered from that entry, without calling the engine.

Beside the entries, one Redis set per image (and engine fingerprint and non-field params)
lists the field sets already extracted. Its key is an entry key whose task segment is
``extraction_index-…``; its members are JSON arrays of sorted field names; it expires with the
entries (``CACHE_TTL_SECONDS``, refreshed on every add). A request for fields F reads the set
(one SMEMBERS); if it lists a strict superset G of F, G's entry is read with
``OcrCache.peek`` and projected onto F. Otherwise the front door runs as usual (an exact hit,
or a computation whose fields are then added to the set). A listed set whose entry has
expired or been evicted is just a miss; a Redis failure costs the reuse, never the request.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import orjson

from app import metrics
from app.cache.keys import digest_image
from app.cache.region import OcrCache
from app.cache.store import RedisStore
from app.engines.tasks import EXTRACTION, FIELD_ARG, extraction_text, extraction_values
from app.vocabulary import CacheControls, CacheStatus, OcrParams, OcrResult, Outcome

log = logging.getLogger(__name__)

INDEX_TASK = "extraction_index"
MAX_FIELD_SETS = 64  # per image: beyond this, new field sets are answered but not listed


class ExtractionIndex:
    def __init__(self, cache: OcrCache, ttl_seconds: int) -> None:
        self._cache = cache
        self._ttl = ttl_seconds  # CACHE_TTL_SECONDS

    def get_or_compute(
        self, image_bytes: bytes, params: OcrParams, controls: CacheControls = CacheControls()
    ) -> Outcome:
        """``OcrCache.get_or_compute``, plus subset reuse for extraction requests."""
        store = self._cache.store
        if params.task != EXTRACTION or not isinstance(store, RedisStore) or controls.bypass:
            return self._cache.get_or_compute(image_bytes, params, controls)
        self._cache.engine.check_params(params)  # UnsupportedParams before any lookup
        fields = params.arg_values(FIELD_ARG)
        index_key = self._cache.key_for(
            digest_image(image_bytes),
            replace(params, task=INDEX_TASK, task_args=()),
            controls.namespace,
        )
        listed: set[tuple[str, ...]] = set()
        if not controls.no_cache:
            _, members = store.members(index_key)
            listed = {fs for fs in map(_field_set, members) if fs is not None}
            reused = self._from_superset(image_bytes, params, fields, listed, controls.namespace)
            if reused is not None:
                return reused
        outcome = self._cache.get_or_compute(image_bytes, params, controls)
        if (
            outcome.status is CacheStatus.MISS
            and not controls.no_store
            and len(listed) < MAX_FIELD_SETS
        ):
            store.add_member(index_key, orjson.dumps(list(fields)).decode(), self._ttl)
        return outcome

    def _from_superset(
        self,
        image_bytes: bytes,
        params: OcrParams,
        fields: tuple[str, ...],
        listed: set[tuple[str, ...]],
        namespace: str,
    ) -> Outcome | None:
        if fields in listed:
            return None  # the exact entry exists: the front door hits it
        wanted = set(fields)
        supersets = sorted((fs for fs in listed if wanted < set(fs)), key=lambda fs: (len(fs), fs))
        for superset in supersets:
            source = replace(params, task_args=tuple((FIELD_ARG, name) for name in superset))
            stored = self._cache.peek(image_bytes, source, namespace)
            projected = _project(stored, fields) if stored is not None else None
            if projected is not None:
                metrics.CACHE_REQUESTS.labels(result="hit").inc()
                return Outcome(projected, CacheStatus.HIT)
        return None


def _field_set(member: bytes) -> tuple[str, ...] | None:
    try:
        names = orjson.loads(member)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return tuple(names)


def _project(result: OcrResult, fields: tuple[str, ...]) -> OcrResult | None:
    """The superset's answer restricted to ``fields``, in the engine's canonical form."""
    try:
        values = extraction_values(result.text or "")
    except ValueError:
        log.info("extraction entry is not a JSON object; not reused")
        return None
    text = extraction_text({name: values.get(name) for name in fields})
    return OcrResult(width=result.width, height=result.height, text=text)
