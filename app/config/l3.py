"""The cold tier in object storage: ``Settings.l3``."""

from __future__ import annotations

from dataclasses import dataclass

from app import env as e
from app.env import Section, env


@dataclass(frozen=True)
class L3Settings(Section):
    TITLE = "L3: the cold tier"
    INTRO = "S3-compatible object storage, off when `CACHE_L3_URL` is unset; endpoint, region and credentials from the standard AWS variables ([L3.md](L3.md))."

    url: str = env("CACHE_L3_URL", e.s3_url, "", "`s3://bucket[/prefix]`")
    ttl_seconds: int = env(
        "CACHE_L3_TTL_SECONDS",
        e.integer(1, 10 * 365 * 86400),
        2_592_000,
        "L3 retention, checked on read from the envelope's creation time",
    )
    addressing: str = env(
        "CACHE_L3_ADDRESSING",
        e.choice("auto", "path", "virtual"),
        "auto",
        "`path` for MinIO, SeaweedFS, Ceph",
    )
    connect_timeout_ms: int = env(
        "CACHE_L3_CONNECT_TIMEOUT_MS", e.integer(1, 60_000), 500, "per S3 request"
    )
    timeout_ms: int = env("CACHE_L3_TIMEOUT_MS", e.integer(1, 600_000), 1000, "per S3 request")
    retries: int = env("CACHE_L3_RETRIES", e.integer(0, 10), 1, "per S3 request")
    queue_max: int = env(
        "CACHE_L3_QUEUE_MAX",
        e.integer(1, 1_000_000),
        1000,
        "write-behind queue per worker (full: the write is dropped, counted)",
    )
    breaker_failures: int = env(
        "CACHE_L3_BREAKER_FAILURES",
        e.integer(1, 1000),
        3,
        "failures in a row before the store is skipped",
    )
    breaker_cooldown_seconds: float = env(
        "CACHE_L3_BREAKER_COOLDOWN_SECONDS",
        e.number(0.0, 3600.0),
        10.0,
        "how long it is skipped before one probe",
    )
