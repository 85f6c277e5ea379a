"""Who is asking, and whether they may ask now: the first step of every OCR request, over
HTTP (``routes/endpoints.py``) and gRPC (``grpc_server.py``) alike, before its body is
parsed.

- ``AUTH=keys``: the request's API key (``Authorization: Bearer``, ``X-Api-Key``; gRPC
  metadata the same) names its tenant, and so its key namespace, over any tenant header. No
  key: served only from ``KEYLESS_NETWORKS`` (stock Paddle Serving clients send no headers),
  as the default tenant whatever a tenant header says; else, or an unknown key,
  ``Unauthorized`` (401). A known key is always served; an address that keeps presenting
  missing or unknown keys past ``AUTH_FAILURE_LIMIT`` gets 429 + ``Retry-After`` for them
  instead (it is told to back off; clients behind the same address with good keys are
  not). Keys are never logged.
- Then the tenant's request-rate quota (``quotas.py``), whichever way it was named (its key,
  or a trusted tenant header).

With ``AUTH=off`` and no tenants file this is one attribute test per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from app import metrics
from app.cache.quotas import Quotas
from app.protocols import trust
from app.tenants import TenantBook, presented_key
from app.vocabulary import TENANT_NAME, Unauthorized

if TYPE_CHECKING:
    from app.config import Settings


class Admission:
    def __init__(self, settings: Settings, book: TenantBook, quotas: Quotas) -> None:
        tenants = settings.tenants
        self._keys = tenants.auth == "keys"
        self._keyless = tenants.keyless_networks
        self._tenant_header = settings.controls.tenant_header
        self._book = book
        self._quotas = quotas
        self.active = self._keys or bool(tenants.keys_file)

    def admit(self, headers: Mapping[str, str], address: str, trusted: bool) -> str | None:
        """The tenant the request's key names ("": the default tenant, a keyless request
        under ``AUTH=keys``; None: decided as without keys, by the tenant header if any);
        raises ``Unauthorized`` or ``QuotaExceeded``."""
        if not self.active:
            return None
        tenant = self._identify(headers, address) if self._keys else None
        self._quotas.admit(tenant if tenant is not None else self._header(headers, trusted))
        return tenant

    def _identify(self, headers: Mapping[str, str], address: str) -> str:
        key = presented_key(headers)
        if key is None and self._is_keyless(address):
            return ""  # the default tenant: a tenant header names nothing here
        tenant = self._book.identify(key) if key is not None else None
        if tenant is not None:
            return tenant.name
        self._quotas.key_refusals_allowed(address)
        self._quotas.key_refused(address)
        metrics.TENANT_REJECTIONS.labels(tenant="other", reason="unauthorized").inc()
        raise Unauthorized("an API key is required" if key is None else "unknown API key")

    def _is_keyless(self, address: str) -> bool:
        return bool(self._keyless) and trust.in_networks(address, self._keyless)

    def _header(self, headers: Mapping[str, str], trusted: bool) -> str:
        """The namespace a trusted tenant header names ("" for none or an invalid one: the
        request's controls refuse that one themselves)."""
        if not self._tenant_header or not trusted:
            return ""
        value = headers.get(self._tenant_header) or headers.get(self._tenant_header.lower())
        return value if value and TENANT_NAME.fullmatch(value) else ""
