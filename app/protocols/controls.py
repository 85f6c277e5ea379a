"""Per-request cache controls from HTTP headers or gRPC metadata (same names).

- ``Cache-Control: no-cache`` recomputes and refreshes; ``no-store`` does not write.
- ``X-Cache-TTL: <seconds>`` overrides the TTL of what this request writes, within
  1..CACHE_TTL_MAX_SECONDS.
- ``X-Cache-Similar: off`` keeps this request off the similarity tier (``CACHE_SIMILAR``):
  only exact and pixel hits answer it. It changes nothing shared: any caller may send it.
- the header named by ``CACHE_TENANT_HEADER`` (when set) selects a tenant namespace: its own
  keys, its own L1 entries, never another tenant's. A tenant named by the request's API key
  (``AUTH=keys``, ``app/admission.py``) is its namespace instead, whatever the header says.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from app.protocols.errors import BadRequest
from app.vocabulary import TENANT_NAME, CacheControls

TTL_HEADER = "X-Cache-TTL"
SIMILAR_HEADER = "X-Cache-Similar"
# ASCII digits only: str.isdigit() accepts "²" (int() then raises) and int() accepts " 1_0".
_SECONDS = re.compile(r"[0-9]{1,10}")


if TYPE_CHECKING:
    from app.config import ControlSettings


def parse(
    headers: Mapping[str, str],
    settings: ControlSettings,
    bypass: bool = False,
    trusted: bool = True,
    tenant: str | None = None,
) -> CacheControls:
    """``headers`` is case-insensitive for HTTP; gRPC metadata keys are lower-case.
    Untrusted callers (app/protocols/trust.py): no-cache and X-Cache-TTL are ignored, a
    tenant header is refused. ``tenant``: the namespace the request's API key decided."""

    def get(name: str) -> str | None:
        return headers.get(name) or headers.get(name.lower())

    directives = {d.strip().lower() for d in (get("Cache-Control") or "").split(",")}
    ttl = None
    raw_ttl = get(TTL_HEADER) if trusted else None
    if raw_ttl is not None:
        digits = raw_ttl.strip(" \t")  # HTTP's optional whitespace, nothing else
        if not _SECONDS.fullmatch(digits) or not 1 <= int(digits) <= settings.ttl_max_seconds:
            raise BadRequest(
                f"{TTL_HEADER} must be whole seconds in 1..{settings.ttl_max_seconds}",
                "invalid_ttl",
            )
        ttl = int(digits)
    similar = (get(SIMILAR_HEADER) or "on").strip().lower()
    if similar not in ("on", "off"):
        raise BadRequest(f"{SIMILAR_HEADER} must be on or off", "invalid_similar")
    namespace = tenant or ""
    if settings.tenant_header and tenant is None:
        tenant = get(settings.tenant_header)
        if tenant is not None:
            if not trusted:
                raise BadRequest(
                    f"{settings.tenant_header} is accepted from trusted callers only",
                    "untrusted_control",
                )
            if not TENANT_NAME.fullmatch(tenant):
                raise BadRequest(
                    f"{settings.tenant_header} must be 1-64 of [A-Za-z0-9_-]",
                    "invalid_tenant",
                )
            namespace = tenant
    return CacheControls(
        bypass=bypass,
        no_cache="no-cache" in directives and trusted,
        no_store="no-store" in directives,
        ttl=ttl,
        namespace=namespace,
        trusted=trusted,
        similar=similar == "on",
    )
