"""The tier interface and the chain that walks it.

A tier answers lookups for some requests (``lookup``), keeps what it is given (``record``)
and forgets a namespace or an image (``purge``); each part is optional (``Tier`` does
nothing by default). The chain is assembled in one place (``app/cache/assembly.py``) in a
fixed order; the front door walks it: a lookup stops at the first tier that answers, and the
tiers before that one are given the result (write-back, fastest last); a computed result is
given to every tier, slowest first, so a waiter woken by the fastest shared tier finds the
others already written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from app.cache.keys import ImageDigest, KeySpace
from app.cache.purging import PurgeUnconfirmed
from app.imaging import DecodedImage
from app.vocabulary import CacheControls, CacheStatus, OcrParams, OcrResult, Outcome

ENGINE = "engine"  # the source of a computed result (``record``'s ``source``)


@dataclass(eq=False)
class Probe:
    """One image of a request on its way through the tiers."""

    data: bytes = field(repr=False)
    params: OcrParams
    digest: ImageDigest
    task: str  # ``KeySpace.task(params)``
    controls: CacheControls
    key: str = ""  # the L2 key (``KeySpace.entry``), set by the front door
    decode: Callable[[bytes], DecodedImage] | None = field(default=None, repr=False)
    outcome: Outcome | None = None  # set by the tier that answered
    ttl: float = 0.0  # how long the answer may still be kept (write-back)
    redis_failed: bool = False  # the shared tier could not be read (a Redis error)
    sealed: tuple[int, bytes] | None = field(default=None, repr=False)  # (ttl, entry bytes)
    _image: DecodedImage | None = field(default=None, repr=False)

    @property
    def image(self) -> DecodedImage:
        """The decoded image, decoded once when a tier first needs pixels (``InvalidImage``:
        a client error)."""
        if self._image is None:
            assert self.decode is not None
            self._image = self.decode(self.data)
        return self._image

    def entry_key(self, keys: KeySpace) -> str:
        """The L2 key (``key``), made the first time a tier or the miss path needs it: it
        takes the MD5, which an L1 hit never computes."""
        if not self.key:
            self.key = keys.entry(self.digest, self.task, self.controls.namespace)
        return self.key

    def answer(self, result: OcrResult, tier: str, ttl: float, details: tuple = ()) -> None:
        self.outcome = Outcome(result, CacheStatus.HIT, tier, details)
        self.ttl = ttl


class Tier:
    """One place a result may be found or kept. ``name`` is its ``X-Cache-Tier`` and metric
    label. ``shared``: waiters in other processes read results there (L2): a computed
    result counts as stored once every shared tier holds it."""

    name = ""
    shared = False

    def lookup(self, probes: Sequence[Probe]) -> None:
        """Answer (``Probe.answer``) those of ``probes`` this tier holds."""

    def record(self, probe: Probe, result: OcrResult, ttl: float, source: str) -> bool:
        """Keep ``result`` (from the engine, or from the tier named ``source`` after a hit)
        if this tier wants it; True unless it wanted to and could not."""
        return True

    def purge(self, namespace: str, md5: str | None) -> int:
        """Forget a namespace, or one image of it; how many items went."""
        return 0


class Chain:
    def __init__(self, tiers: Sequence[Tier]) -> None:
        self.tiers = tuple(tiers)
        self._positions = {tier.name: i for i, tier in enumerate(self.tiers)}

    def index(self, name: str) -> int:
        """The position of the tier named ``name`` (the end if there is none); asked on
        every write-back, so looked up, not searched."""
        return self._positions.get(name, len(self.tiers))

    def lookup(self, probes: Sequence[Probe], start: int = 0, stop: int | None = None) -> None:
        """Walk ``tiers[start:stop]`` for the probes not answered yet; each answer is given
        to the tiers before the one that found it."""
        for position in range(start, len(self.tiers) if stop is None else stop):
            pending = [probe for probe in probes if probe.outcome is None]
            if not pending:
                return
            tier = self.tiers[position]
            tier.lookup(pending)
            for probe in pending:
                if probe.outcome is not None:
                    self.write_back(probe, probe.outcome.result, probe.ttl, tier.name)

    def write_back(self, probe: Probe, result: OcrResult, ttl: float, found_in: str) -> None:
        """``result``, found in the tier named ``found_in``, to the tiers before it (fastest
        last); a request that says ``no-store`` leaves every tier as it was."""
        if probe.controls.no_store:
            return
        for earlier in reversed(self.tiers[: self.index(found_in)]):
            earlier.record(probe, result, ttl, found_in)

    def record(self, probe: Probe, result: OcrResult, ttl: float) -> bool:
        """A computed result, to every tier (slowest first); False when a shared tier could
        not keep it. A request that says ``no-store`` is kept nowhere."""
        if probe.controls.no_store:
            return False
        stored = True
        for tier in reversed(self.tiers):
            kept = tier.record(probe, result, ttl, ENGINE)
            stored = stored and (kept or not tier.shared)
        return stored

    def purge(self, namespace: str, md5: str | None) -> int:
        """Every tier purged, even after one that could not confirm its purge (then
        ``PurgeUnconfirmed`` with the total removed)."""
        removed, unconfirmed = 0, ""
        for tier in self.tiers:
            try:
                removed += tier.purge(namespace, md5)
            except PurgeUnconfirmed as exc:
                removed += exc.removed
                unconfirmed = unconfirmed or exc.reason
        if unconfirmed:
            raise PurgeUnconfirmed(removed, unconfirmed)
        return removed
