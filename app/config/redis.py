"""Redis, the L2 tier: ``Settings.redis``."""

from __future__ import annotations

from dataclasses import dataclass, field

from app import env as e
from app.env import Section, env


@dataclass(frozen=True)
class RedisSettings(Section):
    TITLE = "Redis (L2)"
    INTRO = "The URL forms, Sentinel and Cluster: [ARCHITECTURE.md](ARCHITECTURE.md#scale-out-redis-sentinel-and-cluster)."

    url: str = field(default="", repr=False, metadata={"env": "REDIS_URL", "parse": e.redis_address, "secret": False, "doc": "`redis://`, `rediss://`, `unix://`, `redis+sentinel://` or `redis+cluster://`; unset: `serve` starts a private server"})  # fmt: skip
    username: str = env("REDIS_USERNAME", e.text, "", "ACL user when not in the URL")
    password: str = env(
        "REDIS_PASSWORD", e.text, "", "ACL password when not in the URL", secret=True
    )
    tls_ca_file: str = env(
        "REDIS_TLS_CA_FILE",
        e.existing_file,
        "",
        "TLS for `rediss://` (and the Sentinel/Cluster forms): the CA",
    )
    tls_cert_file: str = env("REDIS_TLS_CERT_FILE", e.existing_file, "", "client certificate")
    tls_key_file: str = env("REDIS_TLS_KEY_FILE", e.existing_file, "", "client key")
    timeout_ms: int = env("REDIS_TIMEOUT_MS", e.integer(1, 60_000), 50, "per-command timeout")
    connect_timeout_ms: int = env(
        "REDIS_CONNECT_TIMEOUT_MS", e.integer(1, 60_000), 50, "connect timeout"
    )
    breaker_failures: int = env(
        "REDIS_BREAKER_FAILURES", e.integer(1, 1000), 3, "failures in a row before Redis is skipped"
    )
    breaker_cooldown_seconds: float = env(
        "REDIS_BREAKER_COOLDOWN_SECONDS",
        e.number(0.0, 3600.0),
        2.0,
        "how long it is skipped before one probe",
    )
