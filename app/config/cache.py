"""The cache itself and what it masks: ``Settings.cache``, ``Settings.redaction``."""

from __future__ import annotations

from dataclasses import dataclass

from app import env as e
from app.env import Section, env


@dataclass(frozen=True)
class CacheSettings(Section):
    TITLE = "Cache"

    enabled: bool = env("CACHE_ENABLED", e.boolean, True, "false: every request is `BYPASS`")
    ttl_seconds: int = env(
        "CACHE_TTL_SECONDS", e.integer(1, 10 * 365 * 86400), 86400, "`SET ... EX ttl`"
    )
    ttl_jitter: float = env(
        "CACHE_TTL_JITTER",
        e.number(0.0, 0.5),
        0.1,
        "the TTL shortened by up to this fraction at random",
    )
    key_prefix: str = env("CACHE_KEY_PREFIX", e.prefix, "ocr", "first key segment")
    encryption_keys: tuple[tuple[str, bytes], ...] = env(
        "CACHE_ENCRYPTION_KEYS",
        e.encryption_keys,
        (),
        "`kid:base64key[,kid:base64key]`: AES-GCM at rest; the first encrypts, all decrypt",
        secret=True,
    )
    l1_bytes: int = env(
        "CACHE_L1_BYTES", e.integer(0, 1 << 40), 32 * 1024 * 1024, "the in-process L1 (0: off)"
    )
    l1_max_age_seconds: float = env(
        "CACHE_L1_MAX_AGE_SECONDS",
        e.number(0.0, 86400.0),
        300.0,
        "how long an L1 entry may outlive a purge elsewhere",
    )


@dataclass(frozen=True)
class RedactionSettings(Section):
    TITLE = "Redaction"

    types: tuple[str, ...] = env(
        "CACHE_REDACT",
        e.redact_types,
        (),
        "`cn_id`, `phone`, `bank_card`, `email` (comma-separated) or `all`: masked in every answer and everything stored",
    )
    patterns_file: str = env(
        "CACHE_REDACT_PATTERNS_FILE",
        e.redact_patterns_file,
        "",
        "more types: one `name = regex` per line",
    )
