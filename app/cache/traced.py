"""The front door's calls traced (``app.tracing``): a lookup that meets a miss is a
``cache.lookup`` span from the lookup's start, with everything below it (the queue's wait, the
engine call) and the outcome (``miss``, ``coalesced``, ``bypass``, or ``mixed``); a lookup
answered whole from the tiers opens no span of its own (each span costs a hit about as much
as its own work, to encode and export): its outcome (``hit``, the tier) goes on the server
span.

Installed on the instance only when tracing is on, so with tracing off the front door is not
wrapped at all and a hit pays nothing for it. A PDF (the document tier) is one span, each
page's outcome counted in it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from app import tracing
from app.cache.region import OcrCache
from app.vocabulary import Outcome


def describe(span: tracing.Span, outcomes: Sequence[Outcome]) -> None:
    """``ocr.cache`` (one status, or ``mixed``), ``ocr.cache_tier`` (one tier, or ``mixed``)
    and ``ocr.images``."""
    statuses = {outcome.status.value.lower() for outcome in outcomes}
    tiers = {outcome.tier for outcome in outcomes if outcome.tier}
    attributes: dict[str, tracing.Value] = {
        "ocr.images": len(outcomes),
        "ocr.cache": statuses.pop() if len(statuses) == 1 else "mixed",
    }
    if tiers:
        attributes["ocr.cache_tier"] = tiers.pop() if len(tiers) == 1 else "mixed"
    span.set_many(attributes)


@dataclass
class _Lookup:
    began: int  # wall clock, ns
    span: tracing.Span | None = None


def instrument(cache: OcrCache, tracer: tracing.Tracer) -> OcrCache:
    """``cache`` with its front door traced (as it is when ``tracer`` is off)."""
    if not tracer.on:
        return cache
    many: Callable[..., list[Outcome]] = cache.get_or_compute_many
    document: Callable[..., tuple[Any, list[Outcome]]] = cache.get_or_compute_document
    resolve: Callable[..., Outcome] = cache.misses.resolve
    local = threading.local()  # this thread's lookup under way (``_Lookup``)

    def get_or_compute_many(images: Sequence[bytes], *args: Any, **kwargs: Any) -> list[Outcome]:
        outer = getattr(local, "lookup", None)
        local.lookup = lookup = _Lookup(time.time_ns())
        failed: BaseException | None = None
        outcomes: list[Outcome] = []
        try:
            outcomes = many(images, *args, **kwargs)
            return outcomes
        except BaseException as exc:
            failed = exc
            raise
        finally:
            local.lookup = outer
            # Answered whole from the tiers: the server span says how many images (its
            # protocol's answer says the outcome, ``routes/common.traced``); else the lookup's
            # span says all.
            if outcomes and lookup.span is not None:
                describe(lookup.span, outcomes)
            elif outcomes:
                tracer.current().set("ocr.images", len(outcomes))
            if lookup.span is not None:
                lookup.span.__exit__(type(failed) if failed else None, failed, None)

    def traced_resolve(probe: Any, look_again: Callable[..., None]) -> Outcome:
        lookup = getattr(local, "lookup", None)
        if lookup is not None and lookup.span is None:  # the first miss opens the lookup's span
            lookup.span = tracer.span("cache.lookup", start_ns=lookup.began).__enter__()
        return resolve(probe, look_again)

    def get_or_compute_document(*args: Any, **kwargs: Any) -> tuple[Any, list[Outcome]]:
        with tracer.span("cache.lookup", {"ocr.document": True}) as span:
            pages, outcomes = document(*args, **kwargs)
            describe(span, outcomes)
            return pages, outcomes

    # get_or_compute goes through get_or_compute_many: the instance's.
    setattr(cache, "get_or_compute_many", get_or_compute_many)  # noqa: B010
    setattr(cache, "get_or_compute_document", get_or_compute_document)  # noqa: B010
    setattr(cache.misses, "resolve", traced_resolve)  # noqa: B010
    return cache
