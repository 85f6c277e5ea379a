"""The process roles: fronts (granian workers, no engine) and engine processes
(``Settings.processes``)."""

from __future__ import annotations

from dataclasses import dataclass

from app import env as e
from app.env import Section, env


@e.accepts("comma-separated `http(s)://` URLs")
def http_urls(name: str, raw: str) -> tuple[str, ...]:
    """Comma-separated ``http(s)://host:port`` URLs (``e.http_url`` each)."""
    return tuple(e.http_url(name, item) for item in raw.split(",") if item.strip())


@dataclass(frozen=True)
class ProcessSettings(Section):
    TITLE = "Roles: fronts and engine processes"
    INTRO = "Fronts answer requests and hold no engine; engine processes take misses from the queue ([DEPLOYMENT.md](DEPLOYMENT.md#roles))."

    engine_port: int = env(
        "ENGINE_PORT",
        e.integer(1, 65535),
        18100,
        "an engine process's internal port: /healthz, /readyz, /metrics and the direct endpoint",
    )
    engine_workers: int = env(
        "ENGINE_WORKERS",
        e.integer(0, 256),
        0,
        "engine slots per engine process (0: 1 for `paddle`, 4 for remote engines)",
    )
    engine_processes: int = env(
        "ENGINE_PROCESSES",
        e.integer(0, 256),
        0,
        "engine processes `serve` runs (0: sized to the machine's cores and memory)",
    )
    engine_urls: tuple[str, ...] = env(
        "ENGINE_URLS",
        http_urls,
        (),
        "the engines' direct endpoints a front calls while Redis is down (`serve` sets it)",
    )
    engine_token: str = env(
        "ENGINE_TOKEN",
        e.token,
        "",
        "shared token of the engines' direct endpoint (empty: the endpoint is off)",
        secret=True,
    )
    direct_max_inflight: int = env(
        "ENGINE_DIRECT_MAX_INFLIGHT",
        e.integer(1, 1024),
        4,
        "direct calls in flight per engine process before 503",
    )
    max_calls: int = env(
        "ENGINE_MAX_CALLS",
        e.integer(0, 10**9),
        0,
        "an engine process retires after this many calls (0: never)",
    )
    max_rss_mb: int = env(
        "ENGINE_MAX_RSS_MB",
        e.integer(0, 10**6),
        0,
        "an engine process retires past this resident memory (0: never)",
    )
    engine_wait_seconds: float = env(
        "ENGINE_WAIT_SECONDS",
        e.number(0.0, 3600.0),
        0.0,
        "how long a front's direct call (Redis down only) retries engines that refuse the connection before 503 (0: at once: an engine Service with no endpoint fails fast)",
    )
    engine_nice: int = env(
        "ENGINE_NICE",
        e.integer(0, 19),
        10,
        "an engine process's CPU priority below the fronts' (`nice`): hits keep the CPU while engines compute",
    )
