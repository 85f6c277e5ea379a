"""``OcrCache``: the one front door from a canonical request to a result.

A request's images are probes (``tier.Probe``). The front door walks the tier chain
(``tier.Chain``, assembled in ``assembly.py``: extraction subsets, L1, L2, L3, pixel,
similar) in two steps: the exact tiers up to L2 for every image at once (one Redis round
trip), then, for each image still missing, the rest of the chain and the miss path
(``misses.MissPath``: one computation per image across threads, processes and replicas)
inside one flight per image. Every protocol adapter calls this, so an image first seen over
one protocol is a hit over all of them. Caching off is a store that holds nothing
(``store.NullStore``): requests are then answered BYPASS by the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from app import metrics
from app.cache.documents import Documents
from app.cache.keys import ImageDigest, KeySpace, digest_image
from app.cache.l1 import L1Cache
from app.cache.l3 import ColdTier
from app.cache.misses import MissPath
from app.cache.quotas import Quotas
from app.cache.store import Store
from app.cache.tier import Chain, Probe
from app.engine_calls.compute import Computer
from app.engines.base import Engine
from app.imaging import DecodedImage
from app.vocabulary import CacheControls, CacheStatus, OcrParams, Outcome

if TYPE_CHECKING:
    from app.engine_side.feeders import Feeders  # an engine's (assembly.build): typing only

Decoder = Callable[[bytes], DecodedImage]


class OcrCache:
    def __init__(
        self,
        *,
        engine: Engine,
        store: Store,
        keys: KeySpace,
        chain: Chain,
        misses: MissPath,
        computer: Computer,
        documents: Documents,
        decode: Decoder,
        l1: L1Cache,
        l3: ColdTier | None = None,
        feeders: Feeders | None = None,
        quotas: Quotas,
    ) -> None:
        self.engine = engine
        self.quotas = quotas  # the tenants' quotas (admission asks for the request rate)
        self._label = quotas.book.label
        self.store = store
        self.keys = keys
        self.chain = chain
        self.l1 = l1  # this worker's L1 (its figures in /v1/stats)
        self.l3 = l3  # the cold tier (its figures; flushed at shutdown), None when off
        self._misses = misses
        self._computer = computer
        self._documents = documents
        self._decode = decode
        self._feeders = feeders
        self._fast = chain.index("l2") + 1  # the tiers looked up for all images at once
        self._second_look = chain.index("l2")  # a miss's own look starts again at L2
        self._l2_hits = (
            metrics.CACHE_REQUESTS.labels(result="hit"),
            metrics.CACHE_TIER_HITS.labels(tier="l2"),
        )  # bound once: a labels() lookup per hit is measurable on the L2 hit path
        self._tenant_children: dict[tuple[str, str], Any] = {}
        self._tenant_generation = quotas.book.generation

    def dispatch_ready(self, timeout: float) -> bool:
        """True once this process's engine takes tickets from the global queue (at once when
        there is none): until then its misses are computed here."""
        return self._feeders is None or self._feeders.reported.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking tickets from the global queue (tickets being computed finish: waited for
        up to ``timeout`` seconds)."""
        if self._feeders is not None:
            self._feeders.stop(timeout)

    @property
    def computer(self) -> Computer:
        """The engine side of a miss (an engine process's direct endpoint calls it)."""
        return self._computer

    @property
    def decode(self) -> Decoder:
        return self._decode

    @property
    def misses(self) -> MissPath:
        return self._misses

    def prefix(self, namespace: str = "") -> str:
        """``{CACHE_KEY_PREFIX}`` or, for a tenant, ``{CACHE_KEY_PREFIX}.{tenant}``."""
        return self.keys.prefix(namespace)

    def key_for(self, digest: ImageDigest, params: OcrParams, namespace: str = "") -> str:
        return self.keys.entry(digest, self.keys.task(params), namespace)

    def probe(self, data: bytes, params: OcrParams, controls: CacheControls) -> Probe:
        digest = digest_image(data)
        return Probe(data, params, digest, self.keys.task(params), controls, decode=self._decode)

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
        """Outcomes in request order; all L2 lookups share one Redis round trip (MGET)."""
        params = params or self.engine.default_params
        self.engine.check_params(params)  # UnsupportedParams: a client error
        if not self.store.enabled or controls.bypass:
            tenant = self._label(controls.namespace)
            for _ in images:
                metrics.CACHE_REQUESTS.labels(result="bypass").inc()
                metrics.TENANT_REQUESTS.labels(tenant=tenant, result="bypass").inc()
            probes = [self.probe(data, params, controls) for data in images]
            with self.quotas.miss(controls.namespace):
                return [Outcome(self._computer.compute(p), CacheStatus.BYPASS) for p in probes]
        return self._walk([self.probe(data, params, controls) for data in images])

    def _walk(self, probes: list[Probe]) -> list[Outcome]:
        if not probes[0].controls.no_cache:
            self.chain.lookup(probes, stop=self._fast)
        for probe in probes:
            found = probe.outcome
            if found is not None:
                self._count(found, probe.controls.namespace)
                continue
            probe.entry_key(self.keys)
            outcome = self._misses.resolve(probe, self._look_again)
            label = "error" if probe.redis_failed else outcome.status.value.lower()
            metrics.CACHE_REQUESTS.labels(result=label).inc()
            self._tenant_count(probe.controls.namespace, outcome.status.value.lower())
            if outcome.tier and outcome.status is CacheStatus.HIT:
                metrics.CACHE_TIER_HITS.labels(tier=outcome.tier).inc()
            probe.outcome = outcome
        return [probe.outcome for probe in probes if probe.outcome is not None]

    def _look_again(self, probe: Probe) -> None:
        """Once this probe's flight is its own: L2 again (another computation may have
        finished between our read and our turn), then the slower tiers."""
        failed = probe.redis_failed
        self.chain.lookup([probe], start=self._second_look if not failed else self._fast)

    def _count(self, outcome: Outcome, namespace: str) -> None:
        if outcome.tier == "l2":
            self._l2_hits[0].inc()
            self._l2_hits[1].inc()
        else:
            metrics.CACHE_REQUESTS.labels(result="hit").inc()
            metrics.CACHE_TIER_HITS.labels(tier=outcome.tier).inc()
        self._tenant_count(namespace, "hit")

    def _tenant_count(self, namespace: str, result: str) -> None:
        """``ocr_tenant_requests_total``: its children kept per namespace, as the L2 hit's
        are (a hit pays one dict lookup), and forgotten when the tenants file changed (a
        namespace's label may have) or too many namespaces came by."""
        book = self.quotas.book
        children = self._tenant_children
        if book.generation != self._tenant_generation or len(children) > 4096:
            children.clear()
            self._tenant_generation = book.generation
        child = children.get((namespace, result))
        if child is None:
            child = metrics.TENANT_REQUESTS.labels(tenant=book.label(namespace), result=result)
            children[(namespace, result)] = child
        child.inc()

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
        every page is a hit in the exact tiers, without rendering (pages: None); else
        ``render()``'s pages through ``get_or_compute_many``, and the page list recorded.
        ``spec`` names the renderer; ``need_pages``: the caller draws on the pages."""
        params = params or self.engine.default_params
        usable = self.store.enabled and not controls.bypass
        digest = digest_image(document)
        if usable and not controls.no_cache and not need_pages:
            self.engine.check_params(params)
            pages = self._documents.lookup(digest, spec, controls.namespace)
            if pages is not None:
                task = self.keys.task(params)
                probes = [Probe(b"", params, page, task, controls) for page in pages]
                self.chain.lookup(probes, stop=self._fast)
                found = [probe.outcome for probe in probes if probe.outcome is not None]
                if len(found) == len(probes):
                    for outcome in found:
                        self._count(outcome, controls.namespace)
                    return None, found
        images = render()
        outcomes = self.get_or_compute_many(images, params, controls)
        if usable and not controls.no_store:
            ttl = controls.ttl or self._computer.ttl()
            pages = [digest_image(image) for image in images]
            self._documents.record(digest, spec, controls.namespace, pages, ttl)
        return images, outcomes

    def purge(self, namespace: str | None = None, md5: str | None = None) -> int:
        """Delete a namespace's entries, or one image's entries in a namespace, from every
        tier (Redis without blocking it, L3 by prefix); every process drops its L1, whether
        or not the purge is confirmed (``PurgeUnconfirmed``: repeat it)."""
        try:
            return self.chain.purge(namespace or "", md5)
        finally:
            self.store.publish(self.keys.purge_channel(), self.keys.prefix(namespace or ""))
