"""The document tier: a PDF -> the digests of its rendered pages.

A PaddleX PDF request is answered per page, and each page is an image the cache knows by its
bytes; finding that out meant rendering every page first (pdfium, a few hundred ms a page)
even when every page was a hit. This tier remembers, per document and renderer, which pages
it rendered to (each page's MD5 and SHA-256), so a repeated document is answered from its
pages' entries without rendering anything. It never answers by itself: every page is still
looked up and verified like any other entry (its SHA-256), and a page missing from the
cache sends the request down the rendering path as before.

Keyed by the document's bytes and the renderer ``spec`` (pdfium version, scale, page limit);
the page list is sealed like an entry (bound to its key, encrypted when keys are set).
"""

from __future__ import annotations

import orjson

from app import metrics
from app.cache.codec import Codec
from app.cache.keys import ImageDigest, KeySpace, known_digest
from app.cache.store import Store

_MAX_PAGES = 10_000


class Documents:
    """``lookup`` / ``record`` / ``purge`` (the latter by the key space's patterns)."""

    def __init__(self, store: Store, keys: KeySpace, codec: Codec) -> None:
        self._store = store
        self._keys = keys
        self._codec = codec

    def lookup(self, document: ImageDigest, spec: str, namespace: str) -> list[ImageDigest] | None:
        key = self._keys.document(document, spec, namespace)
        ok, (value,) = self._store.get_many([key])
        data = self._codec.decode_blob(value, document.sha256, spec, key) if ok else None
        pages = _pages(data)
        metrics.DOCUMENT_LOOKUPS.labels(result="miss" if pages is None else "hit").inc()
        return pages

    def record(
        self,
        document: ImageDigest,
        spec: str,
        namespace: str,
        pages: list[ImageDigest],
        ttl: int,
    ) -> None:
        key = self._keys.document(document, spec, namespace)
        data = orjson.dumps([[page.md5, page.sha256] for page in pages])
        self._store.set(key, self._codec.encode_blob(data, document.sha256, spec, ttl, key), ttl)


def _pages(data: bytes | None) -> list[ImageDigest] | None:
    """The page list, or None for anything that is not one."""
    if data is None:
        return None
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(raw, list) or not 0 < len(raw) <= _MAX_PAGES:
        return None
    pages = []
    for item in raw:
        if not (
            isinstance(item, list)
            and len(item) == 2
            and all(isinstance(part, str) for part in item)
            and len(item[0]) == 32
            and len(item[1]) == 64
        ):
            return None
        pages.append(known_digest(item[0], item[1]))
    return pages
