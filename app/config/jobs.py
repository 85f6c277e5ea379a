"""Asynchronous document jobs (``Settings.jobs``): ``/v1/jobs`` and PaddleOCR's
``/api/v2/ocr/jobs``."""

from __future__ import annotations

from dataclasses import dataclass

from app import env as e
from app.env import Section, env


@dataclass(frozen=True)
class JobsSettings(Section):
    TITLE = "Document jobs"
    INTRO = "Large documents submitted, driven by the engine processes page by page through the cache, polled or called back: [ARCHITECTURE.md](ARCHITECTURE.md#document-jobs)."

    enabled: bool = env(
        "JOBS_ENABLED", e.boolean, True, "the job endpoints, and engines driving jobs"
    )
    max_pages: int = env("JOBS_MAX_PAGES", e.integer(1, 100_000), 500, "pages per job")
    max_bytes: int = env(
        "JOBS_MAX_BYTES",
        e.integer(1024, 1 << 31),
        104_857_600,
        "bytes per uploaded document (this path only; `MAX_REQUEST_BYTES` for the rest)",
    )
    max_open_per_tenant: int = env(
        "JOBS_MAX_OPEN_PER_TENANT",
        e.integer(1, 1_000_000),
        20,
        "jobs not yet ended per tenant (429 past it)",
    )
    ttl_seconds: int = env(
        "JOBS_TTL_SECONDS",
        e.integer(60, 365 * 86400),
        86_400,
        "how long a job, its document and its pages are kept in Redis",
    )
    share: float = env(
        "JOBS_SHARE",
        e.number(0.01, 1.0),
        0.25,
        "a job lane's share of the engines, as a fraction of its tenant's",
    )
    pages_in_flight: int = env(
        "JOBS_PAGES_IN_FLIGHT", e.integer(1, 64), 4, "pages of one job queued or computing at once"
    )
    drivers: int = env(
        "JOBS_DRIVERS", e.integer(0, 64), 1, "jobs each engine process drives at once (0: none)"
    )
    claim_idle_seconds: int = env(
        "JOBS_CLAIM_IDLE_SECONDS",
        e.integer(2, 3600),
        60,
        "a job whose driver has not reported for this long is taken over by another engine",
    )
    api_models: str = env(
        "JOBS_API_MODELS",
        e.text,
        "",
        "models `/api/v2/ocr/jobs` answers for, comma-separated (empty: the engine's own)",
    )
    callback_allowed_hosts: str = env(
        "JOBS_CALLBACK_ALLOWED_HOSTS",
        e.text,
        "",
        "hosts a `callback_url` may name (`host` or `host:port`); empty: callbacks refused",
    )
    callback_secret: str = env(
        "JOBS_CALLBACK_SECRET",
        e.token,
        "",
        "signs callbacks (Standard Webhooks); each tenant's secret is derived from it",
        secret=True,
    )
    callback_attempts: int = env(
        "JOBS_CALLBACK_ATTEMPTS", e.integer(1, 20), 5, "tries of one callback, with backoff"
    )

    def upload_limit(self) -> int:
        """A multipart submission's body limit (the document, its fields and framing)."""
        return self.max_bytes + (1 << 20)

    def callback_hosts(self) -> frozenset[str]:
        hosts = self.callback_allowed_hosts.split(",")
        return frozenset(h.strip().lower() for h in hosts if h.strip())

    def models(self, engine_model: str) -> tuple[str, ...]:
        """The model names the PaddleOCR job API accepts."""
        named = tuple(m.strip() for m in self.api_models.split(",") if m.strip())
        return named or (engine_model,)
