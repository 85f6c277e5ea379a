"""The similarity tier (``CACHE_SIMILAR=on``): a resized or re-encoded copy of a cached
image is answered from the cached entry, once ``verify.compare`` has found no difference
that could change one character.

Candidates come from a 256-bit perceptual hash (``imagehash.phash``, hash size 16) split
into ``BANDS`` bands of 32 bits; each band is a Redis list key holding the newest
``KEEP`` entries whose hash has that band value. A lookup is one pipelined read of the
``BANDS`` lists; an image within ``BANDS - 1`` differing bits of a cached one shares at least
one band. Candidates are ranked by Hamming distance, and at most ``MAX_CHECKS`` of those
within ``max_distance`` are verified against their reference picture (``{entry}:simref``,
the grey picture the check needs, stored through the codec: compressed, and sealed when
``CACHE_ENCRYPTION_KEYS`` is set). Only line results (with boxes) take part: the line check
needs them. The served result's boxes are scaled to the request's size.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import orjson

from app import metrics
from app.cache import verify
from app.cache.codec import Codec
from app.cache.keys import KeySpace
from app.cache.pixel_index import read_entry
from app.cache.store import RedisStore
from app.cache.tier import ENGINE, Probe, Tier
from app.imaging import DecodedImage
from app.vocabulary import OcrResult

log = logging.getLogger(__name__)

SOURCE_HEADER = "X-Cache-Similar-Source"  # the SHA-256 of the cached image that answered
FIGURES_HEADER = "X-Cache-Similarity"  # the verification figures and the hash distance
HASH_SIZE = 16  # 16 x 16 = 256 bits
BANDS = 8
KEEP = 16  # entries per band list
MAX_CHECKS = 3


@dataclass(frozen=True)
class Candidate:
    entry_key: str
    sha256: str
    phash: int
    width: int
    height: int


@dataclass(frozen=True)
class SimilarHit:
    result: OcrResult  # rescaled to the request
    source_sha256: str
    figures: verify.Figures
    distance: int


def perceptual_hash(image: DecodedImage) -> int:
    import imagehash
    from PIL import Image

    bits = imagehash.phash(Image.fromarray(image.pixels), hash_size=HASH_SIZE).hash.flatten()
    return int("".join("1" if b else "0" for b in bits), 2)


def bands(value: int) -> list[str]:
    width = HASH_SIZE * HASH_SIZE // BANDS
    mask = (1 << width) - 1
    return [f"{(value >> (i * width)) & mask:0{width // 4}x}" for i in range(BANDS)]


class SimilarityIndex:
    def __init__(
        self,
        store: RedisStore,
        keys: KeySpace,
        codec: Codec,
        thresholds: verify.Thresholds,
        max_distance: int,
    ) -> None:
        self._store = store
        self._keys = keys
        self._codec = codec
        self._thresholds = thresholds
        self._max_distance = max_distance

    def find(self, image: DecodedImage, task: str, namespace: str) -> SimilarHit | None:
        phash = perceptual_hash(image)
        band_keys = [
            self._keys.similar_band(i, band, task, namespace) for i, band in enumerate(bands(phash))
        ]
        ok, lists = self._store.recent_many(band_keys, KEEP)
        if not ok:
            return None
        seen: dict[str, Candidate] = {}
        for members in lists:
            for member in members:
                cand = _candidate(member)
                if cand is not None:
                    seen.setdefault(cand.sha256, cand)
        ranked = sorted((bin(c.phash ^ phash).count("1"), c.sha256, c) for c in seen.values())
        scope = self._keys.entry_scope(task, namespace)
        request_grey: np.ndarray | None = None
        checks = 0
        for distance, _, cand in ranked:
            if distance > self._max_distance or checks >= MAX_CHECKS:
                break
            aspect = abs((image.width / image.height) / (cand.width / cand.height) - 1) * 100
            if aspect > self._thresholds.aspect:
                continue
            checks += 1
            found = read_entry(
                self._store,
                self._codec,
                self._keys,
                f"{cand.entry_key} {cand.sha256}".encode(),
                scope,
            )
            if found is None:
                continue
            result = found[0]
            if result.text is not None or not result.lines:
                continue  # text tasks and empty pages: no lines to check against
            reference = self._reference(cand)
            if reference is None:
                continue
            if request_grey is None:
                request_grey = verify.grey(image)
            figures = verify.compare(
                request_grey,
                (image.width, image.height),
                reference,
                (result.width, result.height),
                result,
                stop_above=self._thresholds,
            )
            if self._thresholds.accept(figures):
                scaled = verify.rescale(result, image.width, image.height)
                return SimilarHit(scaled, cand.sha256, figures, distance)
        return None

    def record(
        self,
        image: DecodedImage,
        result: OcrResult,
        task: str,
        namespace: str,
        entry_key: str,
        sha256: str,
        ttl: int,
    ) -> None:
        if result.text is not None or not result.lines:
            return
        import cv2

        grey = verify.grey(image)
        ok, png = cv2.imencode(".png", grey)
        if not ok:
            return
        ref_key = self._keys.similar_ref(entry_key)
        value = self._codec.encode_blob(png.tobytes(), sha256, self._keys.fingerprint, ttl, ref_key)
        if not self._store.set(ref_key, value, ttl):
            return
        phash = perceptual_hash(image)
        member = orjson.dumps(
            [entry_key, sha256, f"{phash:064x}", image.width, image.height]
        ).decode()
        items = [
            (self._keys.similar_band(i, band, task, namespace), member)
            for i, band in enumerate(bands(phash))
        ]
        self._store.push_recent(items, KEEP, ttl)

    def _reference(self, cand: Candidate) -> np.ndarray | None:
        import cv2

        ref_key = self._keys.similar_ref(cand.entry_key)
        ok, (value,) = self._store.get_many([ref_key])
        if not ok or value is None:
            return None
        png = self._codec.decode_blob(value, cand.sha256, self._keys.fingerprint, ref_key)
        if png is None:
            return None
        # Only what ``record`` writes: a PNG no larger than REF_MAX_SIDE (checked in its
        # header before anything is decompressed).
        if png[:8] != b"\x89PNG\r\n\x1a\n" or len(png) < 24:
            return None
        width, height = struct.unpack(">II", png[16:24])
        if not (0 < width <= verify.REF_MAX_SIDE and 0 < height <= verify.REF_MAX_SIDE):
            return None
        grey = cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_GRAYSCALE)
        return grey if grey is not None and grey.ndim == 2 else None


def _candidate(member: bytes) -> Candidate | None:
    """A band member (JSON written by ``record``); anything else is skipped."""
    try:
        key, sha256, phash, width, height = orjson.loads(member)
        cand = Candidate(str(key), str(sha256), int(phash, 16), int(width), int(height))
    except (ValueError, TypeError):
        return None
    return cand if cand.width > 0 and cand.height > 0 and len(cand.sha256) == 64 else None


class SimilarTier(Tier):
    """The similarity index in the chain (``CACHE_SIMILAR=on``): last, and only for requests
    that did not say ``X-Cache-Similar: off``; its answers are kept by no other tier."""

    name = "similar"

    def __init__(self, index: SimilarityIndex) -> None:
        self._index = index

    def lookup(self, probes: Sequence[Probe]) -> None:
        for probe in probes:
            if not probe.controls.similar:
                continue
            hit = self._index.find(probe.image, probe.task, probe.controls.namespace)
            metrics.SIMILAR_CHECKS.labels(outcome="hit" if hit else "miss").inc()
            if hit is not None:
                details = (
                    (SOURCE_HEADER, hit.source_sha256),
                    (FIGURES_HEADER, f"{hit.figures.header()}; distance={hit.distance}"),
                )
                probe.answer(hit.result, self.name, 0.0, details)

    def record(self, probe: Probe, result: OcrResult, ttl: float, source: str) -> bool:
        if source == ENGINE:
            self._index.record(
                probe.image, result, probe.task, probe.controls.namespace,
                probe.key, probe.digest.sha256, max(1, int(ttl)),
            )  # fmt: skip
        return True
