"""Field-level reuse for ``extraction``: a request whose fields are a subset of an earlier
extraction of the same image is answered from that entry, without calling the engine.

Beside the entries, one Redis set per image (and engine fingerprint and non-field params)
lists the field sets already extracted. Its key is an entry key whose task segment is
``extraction_index-…``; its members are JSON arrays of sorted field names; it expires with the
entries (``CACHE_TTL_SECONDS``, refreshed on every add). A request for fields F reads the set
(one SMEMBERS); if it lists a strict superset G of F, G's entry is read from L1 or L2 and
projected onto F. Otherwise the chain goes on (an exact hit, or a computation whose fields
are then added to the set). A listed set whose entry has expired or been evicted is just a
miss; a Redis failure costs the reuse, never the request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import orjson

from app.cache.keys import KeySpace
from app.cache.store import RedisStore
from app.cache.tier import ENGINE, Probe, Tier
from app.engines.tasks import EXTRACTION, FIELD_ARG, extraction_text, extraction_values
from app.vocabulary import OcrParams, OcrResult

log = logging.getLogger(__name__)

INDEX_TASK = "extraction_index"
MAX_FIELD_SETS = 64  # per image: beyond this, new field sets are answered but not listed


class ExtractionTier(Tier):
    """First in the chain (it answers before the exact tiers, as it always has); ``exact``:
    the tiers that hold entries (L1, L2), read for a superset's entry."""

    name = "extraction"

    def __init__(
        self, store: RedisStore, keys: KeySpace, exact: Sequence[Tier], ttl_seconds: int
    ) -> None:
        self._store = store
        self._keys = keys
        self._exact = exact
        self._ttl = ttl_seconds  # CACHE_TTL_SECONDS

    def _index_key(self, probe: Probe) -> str:
        params = replace(probe.params, task=INDEX_TASK, task_args=())
        return self._keys.entry(probe.digest, self._keys.task(params), probe.controls.namespace)

    def _listed(self, probe: Probe) -> set[tuple[str, ...]]:
        _, members = self._store.members(self._index_key(probe))
        return {fs for fs in map(_field_set, members) if fs is not None}

    def lookup(self, probes: Sequence[Probe]) -> None:
        for probe in probes:
            if probe.params.task != EXTRACTION:
                continue
            fields = probe.params.arg_values(FIELD_ARG)
            listed = self._listed(probe)
            if fields in listed:
                continue  # the exact entry exists: the exact tiers hit it
            wanted = set(fields)
            supersets = sorted(
                (fs for fs in listed if wanted < set(fs)), key=lambda fs: (len(fs), fs)
            )
            for superset in supersets:
                stored = self._peek(probe, superset)
                projected = _project(stored, fields) if stored is not None else None
                if projected is not None:
                    probe.answer(projected, self.name, 0.0)
                    break

    def _peek(self, probe: Probe, superset: tuple[str, ...]) -> OcrResult | None:
        """The superset's stored result (L1, then L2): never computes, never writes."""
        params: OcrParams = replace(probe.params, task_args=tuple((FIELD_ARG, f) for f in superset))
        source = Probe(b"", params, probe.digest, self._keys.task(params), probe.controls)
        for tier in self._exact:
            tier.lookup([source])
            if source.outcome is not None:
                return source.outcome.result
        return None

    def record(self, probe: Probe, result: OcrResult, ttl: float, source: str) -> bool:
        if source == ENGINE and probe.params.task == EXTRACTION:
            if len(self._listed(probe)) < MAX_FIELD_SETS:
                fields = orjson.dumps(list(probe.params.arg_values(FIELD_ARG))).decode()
                self._store.add_member(self._index_key(probe), fields, self._ttl)
        return True


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
