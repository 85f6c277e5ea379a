"""Who may do what: the request controls (``Settings.controls``) and the tenants (``Settings.tenants``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app import env as e
from app.env import RateLimit, Section, env


@dataclass(frozen=True)
class ControlSettings(Section):
    TITLE = "Request controls and trust"
    INTRO = "Who may use the controls that change shared state, and who sees the cache status: [SECURITY.md](SECURITY.md)."

    ttl_max_seconds: int = env(
        "CACHE_TTL_MAX_SECONDS",
        e.integer(1, 10 * 365 * 86400),
        2_592_000,
        "upper bound of the `X-Cache-TTL` request override",
    )
    tenant_header: str = env(
        "CACHE_TENANT_HEADER",
        e.header_name,
        "",
        "e.g. `X-Tenant`: per-tenant key namespaces (`{prefix}.{tenant}:...`)",
    )
    trusted_networks: tuple[Any, ...] = env(
        "TRUSTED_NETWORKS",
        e.networks,
        (),
        "CIDRs or addresses that may use the shared-state controls (with no token either: everyone)",
    )
    token: str = env(
        "CACHE_CONTROL_TOKEN",
        e.token,
        "",
        "the same, by `X-Cache-Control-Token` header or gRPC metadata",
        secret=True,
    )
    status_visible: str = env(
        "CACHE_STATUS_VISIBLE",
        e.choice("all", "trusted"),
        "all",
        "`trusted`: untrusted callers see no cache status, and get 403 on `/metrics` and `/v1/stats`",
    )


@dataclass(frozen=True)
class TenantSettings(Section):
    TITLE = "Tenants: API keys and quotas"
    INTRO = "Who may call and what each tenant may cost (`app/tenants.py`, `app/cache/quotas.py`); the file's format: [SECURITY.md](SECURITY.md#api-keys-and-tenants). Quotas apply to a tenant however it was named (its key, or a trusted tenant header)."

    auth: str = env(
        "AUTH",
        e.choice("off", "keys"),
        "off",
        "`keys`: every request names its tenant by API key, else 401; `off`: no keys",
    )
    keys_file: str = env(
        "API_KEYS_FILE",
        e.existing_file,
        "",
        "the tenants' JSON (key digests, limits, shares), reread when it changes; required with `AUTH=keys`",
    )
    reload_seconds: float = env(
        "API_KEYS_RELOAD_SECONDS",
        e.number(0.1, 3600.0),
        5.0,
        "how often the file is checked for changes",
    )
    keyless_networks: tuple[Any, ...] = env(
        "KEYLESS_NETWORKS",
        e.networks,
        (),
        "`AUTH=keys`: CIDRs or addresses served without a key, as the default tenant",
    )
    failure_limit: RateLimit = env(
        "AUTH_FAILURE_LIMIT",
        e.rate_limit,
        RateLimit(1.0, 10),
        "`RPS[:BURST]` of refused keys per client address, past which it gets 429 + `Retry-After`",
    )
    queue_hold_seconds: float = env(
        "TENANT_QUEUE_HOLD_SECONDS",
        e.number(1.0, 86400.0),
        300.0,
        "how long one tenant may hold half the waiting misses before `OcrTenantHoldsQueue` fires",
    )
