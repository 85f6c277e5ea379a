"""Prometheus metrics. Under the front's server, ``PROMETHEUS_MULTIPROC_DIR`` is set by the
entry point before any worker imports this module, so counters are summed over all workers."""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

ENGINE_CALLS = Counter(
    "ocr_engine_calls_total",
    "OCR engine invocations (one per computed image)",
    ["engine", "outcome"],
)
ENGINE_SECONDS = Histogram(
    "ocr_engine_duration_seconds",
    "Time spent in the OCR engine per image",
    ["engine"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
)
DIRECT_CALLS = Counter(
    "ocr_direct_calls_total",
    "A front's calls to an engine process's direct endpoint (no queue to use: Redis down, "
    "caching off, no engine reported in, no-store/no-cache); the engine counts its own call",
    ["engine", "outcome"],
)
DIRECT_SECONDS = Histogram(
    "ocr_direct_duration_seconds",
    "A front's direct call to an engine process, end to end",
    ["engine"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
)
CACHE_REQUESTS = Counter(
    "ocr_cache_requests_total",
    "Cache lookups by outcome (error = Redis failed, answered from the engine)",
    ["result"],
)
CACHE_TIER_HITS = Counter(
    "ocr_cache_tier_hits_total", "Cache hits by tier (l1, l2, pixel, similar, l3)", ["tier"]
)
SIMILAR_CHECKS = Counter(
    "ocr_cache_similar_lookups_total",
    "Similarity-tier lookups (CACHE_SIMILAR=on) by outcome (hit: a verified candidate)",
    ["outcome"],
)
REDIS_ERRORS = Counter(
    "ocr_redis_errors_total", "Redis operations that failed or were skipped", ["op", "reason"]
)
REQUEST_SECONDS = Histogram(
    "ocr_request_duration_seconds",
    "Request latency by protocol and cache outcome",
    ["protocol", "cache"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
REQUESTS = Counter("ocr_requests_total", "Requests by protocol and status", ["protocol", "status"])
# State gauges for alerting. Under the front's server each worker writes its own value; the
# modes say how /metrics folds them: one worker whose breaker is open makes the service's
# value 1, one worker whose engine is unready makes it 0. Dead workers' values are dropped ("live").
REDIS_BREAKER_OPEN = Gauge(
    "ocr_redis_breaker_open",
    "1 while the Redis circuit breaker skips Redis (open or probing), else 0",
    multiprocess_mode="livemax",
)
# Read from Redis by a front at each scrape (app/queue/backlog.py), not kept in a process.
QUEUE_BACKLOG = "ocr_queue_backlog"
QUEUE_SHARD_BACKLOG = "ocr_queue_shard_backlog"  # with DISPATCH_SHARDS over 1
QUEUE_SHARD_ENGINES_LIVE = "ocr_queue_shard_engines_live"
QUEUE_ENGINES_LIVE = "ocr_queue_engines_live"
QUEUE_OLDEST_WAIT = "ocr_queue_oldest_wait_seconds"
ENGINE_BROKEN = Counter(
    "ocr_engine_broken_total",
    "Engine processes that stopped taking tickets and exited for a restart after "
    "ENGINE_UNREADY_AFTER_FAILURES failures of their own in a row (the OcrEngineBroken alert)",
)
ENGINE_ORPHAN_YIELDS = Counter(
    "ocr_engine_orphan_yields_total",
    "Engine calls run at a pause of a call whose callers had all gone (an orphan), instead "
    "of after its end",
)
ENGINE_READY = Gauge(
    "ocr_engine_ready",
    "1 when the engine is loaded and not failing (what /readyz reports), else 0",
    multiprocess_mode="livemin",
)
ENGINE_QUEUE_DEPTH = Gauge(
    "ocr_engine_queue_depth",
    "Engine calls waiting to start (summed over live workers)",
    multiprocess_mode="livesum",
)
ENGINE_CALLS_RUNNING = Gauge(
    "ocr_engine_calls_running",
    "Engine calls running now, including timed-out ones still finishing (summed over live "
    "workers): with ocr_engine_queue_depth 0, the engines are idle",
    multiprocess_mode="livesum",
)
ENGINE_QUEUE_DROPPED = Counter(
    "ocr_engine_queue_dropped_total",
    "Engine calls never run: queue full (refused) or caller gone (timed out while queued)",
    ["reason"],
)
# The global miss queue (app/queue/): one queue for the whole fleet, so
# each worker reports the depth it last read from Redis and /metrics shows the most recent.
DISPATCH_QUEUE_DEPTH = Gauge(
    "ocr_dispatch_queue_depth",
    "Tickets (queued misses) waiting to start in the global miss queue (one value for the "
    "whole fleet)",
    multiprocess_mode="livemostrecent",
)
DISPATCH_QUEUE_RUNNING = Gauge(
    "ocr_dispatch_queue_running",
    "Tickets (queued misses) an engine holds in the global miss queue: computing, or held by "
    "an engine that died until they are reclaimed (one value for the whole fleet)",
    multiprocess_mode="livemostrecent",
)
DISPATCH_OLDEST_WAIT = Gauge(
    "ocr_dispatch_oldest_wait_seconds",
    "How long the oldest ticket waiting in the global miss queue has waited (0: none waits)",
    multiprocess_mode="livemostrecent",
)
DISPATCH_ENGINES = Gauge(
    "ocr_dispatch_engines",
    "Live engines of the global miss queue (reported in lately), busy (holding a ticket) or "
    "idle (one value for the whole fleet)",
    ["state"],
    multiprocess_mode="livemostrecent",
)
DISPATCH_TICKETS = Counter(
    "ocr_dispatch_tickets_total",
    "Tickets (queued misses) by what became of them at an engine (computed, failed, caller_gone, "
    "already_stored, image_gone: its image evicted before it ran (its waiters submit again), "
    "reclaimed from a dead consumer, abandoned after DISPATCH_MAX_DELIVERIES; "
    "interjected: taken to run inside an engine's call in progress, counted again as computed; "
    "retried: failed by its engine unexpectedly and handed back for another, counted as failed; "
    "helped: taken from another queue shard that asked for help, counted again as computed)",
    ["outcome"],
)
# The cold tier (L3, app/cache/l3.py).
L3_READS = Counter(
    "ocr_l3_reads_total",
    "L3 lookups: hit, miss (no object), rejected (an object that failed verification or is "
    "older than CACHE_L3_TTL_SECONDS), error (the store failed), circuit_open (skipped)",
    ["result"],
)
L3_WRITES = Counter(
    "ocr_l3_writes_total",
    "L3 write-behind: queued, then stored, error (the store failed or the circuit was "
    "open) or purged (its image purged meanwhile); dropped (the queue was full, never "
    "queued). queued - stored - error - purged - ocr_l3_queue_depth: writes lost with a "
    "process that died (kill -9) before its queue drained",
    ["result"],
)
L3_QUEUE_DEPTH = Gauge(
    "ocr_l3_queue_depth",
    "Entries waiting to be written to L3 (summed over live workers)",
    multiprocess_mode="livesum",
)
L3_BREAKER_OPEN = Gauge(
    "ocr_l3_breaker_open",
    "1 while the L3 circuit breaker skips the object store (open or probing), else 0",
    multiprocess_mode="livemax",
)
DOCUMENT_LOOKUPS = Counter(
    "ocr_document_lookups_total",
    "Document (PDF) page-list lookups: hit = its pages are known without rendering it",
    ["result"],
)
PDF_PAGES_RENDERED = Counter(
    "ocr_pdf_pages_rendered_total",
    "PDF pages rendered to images (a repeated document whose pages are all cached renders none)",
)
LINES = Counter(
    "ocr_lines_total",
    "Text-line crops of computed pages with line reuse on (CACHE_LINES): reused (answered "
    "from Redis: every crop of its recognizer batch was stored) or recognized",
    ["outcome"],
)
LINE_FAULTS = Counter(
    "ocr_line_faults_total",
    "Line reuse worked around a fault: fetch (a store read failed: its lines recognised), "
    "keep (a store write failed), page (the page computed again with reuse off)",
    ["what"],
)
UNEXPECTED_ERRORS = Counter(
    "ocr_unexpected_errors_total",
    "Requests answered by the last-resort handler (a bug: logged with its request id)",
    ["protocol"],
)

RATE_LIMITED = Counter(
    "ocr_rate_limited_total",
    "Requests refused by RATE_LIMIT in the service (gRPC; nginx refuses HTTP's itself: "
    "status 429 in its access log)",
    ["protocol"],
)

# Tenants (issue 26): labels are the configured tenants, "default" (no namespace) and "other"
# (every tenant the tenants file does not name), so their number stays bounded.
TENANT_REQUESTS = Counter(
    "ocr_tenant_requests_total",
    "Images looked up per tenant, by cache outcome (hit, miss, coalesced, bypass)",
    ["tenant", "result"],
)
TENANT_ENGINE_SECONDS = Counter(
    "ocr_tenant_engine_seconds_total",
    "Engine seconds spent on each tenant's images (what the engine-seconds quota counts)",
    ["tenant"],
)
TENANT_REJECTIONS = Counter(
    "ocr_tenant_rejections_total",
    "Requests refused per tenant: unauthorized (401), auth_failures (an address past "
    "AUTH_FAILURE_LIMIT), rate, misses_in_flight, engine_seconds (its quotas: 429), "
    "queue_full (its share of the miss queue: 503)",
    ["tenant", "reason"],
)
TENANT_QUEUE_WAITING = Gauge(
    "ocr_dispatch_tenant_waiting",
    "Tickets (queued misses) waiting in the global miss queue per tenant (one value for the "
    "whole fleet)",
    ["tenant"],
    multiprocess_mode="livemostrecent",
)
TENANT_QUEUE_RUNNING = Gauge(
    "ocr_dispatch_tenant_running",
    "Tickets (queued misses) an engine holds per tenant (one value for the whole fleet)",
    ["tenant"],
    multiprocess_mode="livemostrecent",
)
TENANT_QUEUE_DEFICIT = Gauge(
    "ocr_dispatch_tenant_deficit_seconds",
    "A tenant's lane's credit in the fair queue's round robin (engine seconds; negative: "
    "in debt; 0: not in turn; summed over the tenants a label covers)",
    ["tenant"],
    multiprocess_mode="livemostrecent",
)
TENANT_QUEUE_OLDEST_WAIT = Gauge(
    "ocr_dispatch_tenant_oldest_wait_seconds",
    "How long a tenant's oldest waiting ticket has waited (0: none waits)",
    ["tenant"],
    multiprocess_mode="livemostrecent",
)
TENANT_QUEUE_HOLD = Gauge(
    "ocr_tenant_queue_hold_seconds",
    "How long a tenant has held at least half of the waiting misses, while others waited "
    "too, without a break (0: it does not)",
    ["tenant"],
    multiprocess_mode="livemax",
)
TENANT_QUEUE_HOLD_LIMIT = Gauge(
    "ocr_tenant_queue_hold_limit_seconds",
    "TENANT_QUEUE_HOLD_SECONDS: the OcrTenantHoldsQueue alert fires past it",
    multiprocess_mode="livemax",
)
API_KEYS_RELOADS = Counter(
    "ocr_api_keys_reloads_total",
    "API_KEYS_FILE reloads after a change: ok, or error (the tenants already loaded stay)",
    ["result"],
)


def initialise_tenants(labels: list[str]) -> None:
    """The tenants' label sets at 0 (``initialise``'s convention), for the tenants known now."""
    for tenant in labels:
        for result in ("hit", "miss", "coalesced", "bypass"):
            TENANT_REQUESTS.labels(tenant=tenant, result=result)
        TENANT_ENGINE_SECONDS.labels(tenant=tenant)
        for reason in ("unauthorized", "rate", "misses_in_flight", "engine_seconds", "queue_full"):
            TENANT_REJECTIONS.labels(tenant=tenant, reason=reason)
    TENANT_REJECTIONS.labels(tenant="other", reason="auth_failures")
    for result in ("ok", "error"):
        API_KEYS_RELOADS.labels(result=result)


def initialise(engine_kind: str) -> None:
    """Every known label set at 0 from start-up (Prometheus convention): dashboards and
    ``rate()`` work before the first event of each kind."""
    for outcome in ("ok", "error", "timeout", "busy"):
        ENGINE_CALLS.labels(engine=engine_kind, outcome=outcome)
        DIRECT_CALLS.labels(engine=engine_kind, outcome=outcome)
    for result in ("hit", "miss", "coalesced", "bypass", "error"):
        CACHE_REQUESTS.labels(result=result)
    for tier in ("extraction", "l1", "l2", "l3", "pixel", "similar"):
        CACHE_TIER_HITS.labels(tier=tier)
    for outcome in ("hit", "miss"):
        SIMILAR_CHECKS.labels(outcome=outcome)
    for reason in ("full", "caller_gone"):
        ENGINE_QUEUE_DROPPED.labels(reason=reason)
    outcomes = ("computed", "failed", "caller_gone", "already_stored", "reclaimed", "abandoned",
                "interjected", "helped")  # fmt: skip
    for outcome in outcomes:
        DISPATCH_TICKETS.labels(outcome=outcome)
    for result in ("hit", "miss", "rejected", "error", "circuit_open"):
        L3_READS.labels(result=result)
    for result in ("queued", "stored", "error", "purged", "dropped"):
        L3_WRITES.labels(result=result)
    for protocol in ("rest", "pipeline_http", "paddlex", "grpc", "kserve_http", "kserve_grpc"):
        UNEXPECTED_ERRORS.labels(protocol=protocol)
    for result in ("hit", "miss"):
        DOCUMENT_LOOKUPS.labels(result=result)
    RATE_LIMITED.labels(protocol="grpc")
    for outcome in ("reused", "recognized"):
        LINES.labels(outcome=outcome)
    for what in ("fetch", "keep", "page"):
        LINE_FAULTS.labels(what=what)


def render() -> tuple[bytes, str]:
    """The exposition text: every worker's samples when running multi-process."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
