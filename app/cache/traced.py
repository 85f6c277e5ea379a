"""The front door's calls as ``cache.lookup`` spans, with tracing on (``app.tracing``): the
lookup and, for a miss, everything below it (the queue's wait, the engine call), and the
outcome (``hit``, ``miss``, ``coalesced``, ``bypass``; the tier of a hit).

Installed on the instance only when tracing is on, so with tracing off the front door is not
wrapped at all and a hit pays nothing for it. A PDF (the document tier) is one span, each
page's outcome counted in it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from app import tracing
from app.cache.region import OcrCache
from app.vocabulary import Outcome


def describe(span: tracing.Span, outcomes: Sequence[Outcome]) -> None:
    """``ocr.cache`` (one status, or ``mixed``), ``ocr.cache_tier`` (one tier, or ``mixed``)
    and ``ocr.images``."""
    statuses = {outcome.status.value.lower() for outcome in outcomes}
    tiers = {outcome.tier for outcome in outcomes if outcome.tier}
    span.set("ocr.images", len(outcomes))
    span.set("ocr.cache", statuses.pop() if len(statuses) == 1 else "mixed")
    if tiers:
        span.set("ocr.cache_tier", tiers.pop() if len(tiers) == 1 else "mixed")


def instrument(cache: OcrCache, tracer: tracing.Tracer) -> OcrCache:
    """``cache`` with its front door traced (as it is when ``tracer`` is off)."""
    if not tracer.on:
        return cache
    many: Callable[..., list[Outcome]] = cache.get_or_compute_many
    document: Callable[..., tuple[Any, list[Outcome]]] = cache.get_or_compute_document

    def get_or_compute_many(images: Sequence[bytes], *args: Any, **kwargs: Any) -> list[Outcome]:
        with tracer.span("cache.lookup") as span:
            outcomes = many(images, *args, **kwargs)
            describe(span, outcomes)
            return outcomes

    def get_or_compute_document(*args: Any, **kwargs: Any) -> tuple[Any, list[Outcome]]:
        with tracer.span("cache.lookup", {"ocr.document": True}) as span:
            pages, outcomes = document(*args, **kwargs)
            describe(span, outcomes)
            return pages, outcomes

    # get_or_compute goes through get_or_compute_many: the instance's, so one span.
    setattr(cache, "get_or_compute_many", get_or_compute_many)  # noqa: B010
    setattr(cache, "get_or_compute_document", get_or_compute_document)  # noqa: B010
    return cache
