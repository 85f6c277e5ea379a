"""What the blueprints share: the request's cache controls, the request metrics, the cache
headers and the JSON answer with ``Retry-After`` when the engine is busy."""

from __future__ import annotations

import time

from flask import Response, g, request

from app import metrics
from app.cache import near_dup
from app.config import Settings
from app.protocols import controls as cache_controls
from app.vocabulary import CacheControls, EngineBusy

JSON = "application/json"
TIER_HEADER = "X-Cache-Tier"
DETAIL_HEADERS = (near_dup.SOURCE_HEADER, near_dup.FIGURES_HEADER)  # "similar" hits


def controls(settings: Settings) -> CacheControls:
    """The request's cache controls (headers; trust decided in ``lifecycle``)."""
    return cache_controls.parse(request.headers, settings, trusted=g.trusted)


def observe(protocol: str, status: int, cache_status: str) -> None:
    metrics.REQUESTS.labels(protocol=protocol, status=str(status)).inc()
    metrics.REQUEST_SECONDS.labels(protocol=protocol, cache=cache_status).observe(
        time.perf_counter() - g.started
    )


def cache_headers(
    status: str, tier: str, details: tuple[tuple[str, str], ...] = ()
) -> dict[str, str]:
    """``X-Cache`` and, for hits, ``X-Cache-Tier`` (l1, l2, ...) and a similar hit's
    ``DETAIL_HEADERS``; all hidden together from untrusted callers when
    ``CACHE_STATUS_VISIBLE=trusted`` (``lifecycle``)."""
    headers = {"X-Cache": status, **dict(details)}
    if tier:
        headers[TIER_HEADER] = tier
    return headers


def error(body: bytes, status: int, exc: Exception) -> Response:
    """An error answer; overload (``EngineBusy``) says when to come back."""
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, EngineBusy) else None
    return Response(body, status=status, mimetype=JSON, headers=headers)
