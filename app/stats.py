"""``GET /v1/stats``: the figures people ask for first (hit ratio, engine calls and time,
latency, cache size), derived from the service's own Prometheus metrics so they agree with
``/metrics`` and are summed over every front worker. Served by ``app.routes.ops``, read by
``ocr-cache stats`` and the web page's status panel; no secrets, so public like ``/metrics``."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from app.cache.region import OcrCache
from app.cache.store import RedisStore

# Cache lookups that were answered without calling the engine.
_SAVED = ("hit", "coalesced")


def summarize(exposition: str, cache: OcrCache) -> dict[str, Any]:
    counters: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    buckets: dict[float, float] = defaultdict(float)
    sums: dict[str, float] = defaultdict(float)
    tenants: dict[str, dict[str, Any]] = defaultdict(_tenant)
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name.startswith(_TENANT_METRICS):
                _tenant_sample(tenants[labels.get("tenant", "other")], name, labels, value)
            elif name == "ocr_cache_requests_total":
                counters["lookups"][labels.get("result", "")] += value
            elif name == "ocr_engine_calls_total":
                counters["engine"][labels.get("outcome", "")] += value
            elif name in ("ocr_engine_duration_seconds_sum", "ocr_engine_duration_seconds_count"):
                sums[name] += value
            elif name == "ocr_request_duration_seconds_bucket":
                buckets[float(labels["le"])] += value
            elif name in (
                "ocr_request_duration_seconds_sum",
                "ocr_request_duration_seconds_count",
            ):
                sums[name] += value
    lookups = counters["lookups"]
    total = sum(lookups.values())
    saved = sum(lookups.get(k, 0.0) for k in _SAVED)
    engine_count = sums["ocr_engine_duration_seconds_count"]
    request_count = sums["ocr_request_duration_seconds_count"]
    store = cache.store
    redis: dict[str, Any]
    if not isinstance(store, RedisStore):
        redis = {"state": "disabled"}
    else:
        info = store.stats()
        redis = {
            "state": "up" if info else "down",
            "keys": store.key_count(),
            "used_memory_bytes": info.get("used_memory"),
            "maxmemory_bytes": info.get("maxmemory"),
            "evicted_keys": info.get("evicted_keys"),
            "maxmemory_policy": info.get("maxmemory_policy"),
        }
    return {
        "cache": {
            "lookups": int(total),
            "hits": int(lookups.get("hit", 0)),
            "coalesced": int(lookups.get("coalesced", 0)),
            "misses": int(lookups.get("miss", 0)),
            "bypassed": int(lookups.get("bypass", 0)),
            "redis_errors": int(lookups.get("error", 0)),
            # Answers that did not call the engine, over all lookups.
            "hit_ratio": round(saved / total, 4) if total else None,
            "l1": {"entries": len(cache.l1), "bytes": cache.l1.size_bytes},  # this worker
            "redis": redis,
        },
        "engine": {
            "calls": int(sum(counters["engine"].values())),
            "by_outcome": {k: int(v) for k, v in sorted(counters["engine"].items())},
            "seconds_total": round(sums["ocr_engine_duration_seconds_sum"], 3),
            "mean_seconds": (
                round(sums["ocr_engine_duration_seconds_sum"] / engine_count, 4)
                if engine_count
                else None
            ),
        },
        "tenants": {name: _tenant_summary(t) for name, t in sorted(tenants.items())},
        "latency": {
            "requests": int(request_count),
            "mean_seconds": (
                round(sums["ocr_request_duration_seconds_sum"] / request_count, 4)
                if request_count
                else None
            ),
            "p50_seconds": _quantile(buckets, 0.5),
            "p95_seconds": _quantile(buckets, 0.95),
        },
    }


_TENANT_METRICS = (
    "ocr_tenant_requests_total",
    "ocr_tenant_engine_seconds_total",
    "ocr_tenant_rejections_total",
    "ocr_dispatch_tenant_waiting",
    "ocr_tenant_queue_hold_seconds",
)


def _tenant() -> dict[str, Any]:
    return {"lookups": defaultdict(float), "rejected": defaultdict(float), "engine": 0.0,
            "waiting": 0.0, "hold": 0.0}  # fmt: skip


def _tenant_sample(tenant: dict[str, Any], name: str, labels: dict[str, str], value: float) -> None:
    if name == "ocr_tenant_requests_total":
        tenant["lookups"][labels.get("result", "")] += value
    elif name == "ocr_tenant_engine_seconds_total":
        tenant["engine"] += value
    elif name == "ocr_tenant_rejections_total":
        tenant["rejected"][labels.get("reason", "")] += value
    elif name == "ocr_dispatch_tenant_waiting":
        tenant["waiting"] = max(tenant["waiting"], value)
    elif name == "ocr_tenant_queue_hold_seconds":
        tenant["hold"] = max(tenant["hold"], value)


def _tenant_summary(tenant: dict[str, Any]) -> dict[str, Any]:
    """Who costs what: a tenant's hits and misses, engine seconds, refusals by reason, and
    its share of the miss queue now (``AUTH=keys`` or a tenant header names the tenant)."""
    lookups, rejected = tenant["lookups"], tenant["rejected"]
    return {
        "hits": int(lookups.get("hit", 0)),
        "coalesced": int(lookups.get("coalesced", 0)),
        "misses": int(lookups.get("miss", 0)),
        "bypassed": int(lookups.get("bypass", 0)),
        "engine_seconds": round(tenant["engine"], 3),
        "rejected": int(sum(rejected.values())),
        "rejected_by_reason": {k: int(v) for k, v in sorted(rejected.items()) if v},
        "queue_waiting": int(tenant["waiting"]),
        "queue_hold_seconds": round(tenant["hold"], 1),
    }


def _quantile(buckets: dict[float, float], q: float) -> float | None:
    """Like PromQL's histogram_quantile: linear within the bucket that holds the rank."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]  # the +Inf bucket counts everything
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return round(lower, 4)
            share = (rank - below) / (count - below) if count > below else 1.0
            return round(lower + (bound - lower) * share, 4)
        lower, below = bound, count
    return round(lower, 4)
