"""Who may use the controls that change shared state.

``X-Cache-TTL``, ``Cache-Control: no-cache``, ``pipeline.profile`` (bypass) and the tenant
header change what every other client gets (an entry's lifetime, a recomputation, a
namespace). With ``TRUSTED_NETWORKS`` and/or ``CACHE_CONTROL_TOKEN`` configured, only callers
from those networks or presenting the token (``X-Cache-Control-Token`` header or gRPC
metadata) may use them: for others the first three are ignored and a tenant header is refused.
With ``CACHE_STATUS_VISIBLE=trusted``, untrusted callers do not see the cache status
(``X-Cache``, the REST ``cache`` field, gRPC ``x-cache``), which tells whether an image was
seen before. Neither configured: every caller is trusted (the behaviour before this existed).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.config import ControlSettings

TOKEN_HEADER = "X-Cache-Control-Token"


def is_trusted(address: str, headers: Mapping[str, str], settings: ControlSettings) -> bool:
    if not settings.trusted_networks and not settings.token:
        return True
    if settings.token:
        given = headers.get(TOKEN_HEADER) or headers.get(TOKEN_HEADER.lower()) or ""
        if hmac.compare_digest(given.encode(), settings.token.encode()):
            return True
    return in_networks(address, settings.trusted_networks)


def in_networks(address: str, networks: tuple[Any, ...]) -> bool:
    """Whether ``address`` (text) is in one of ``networks``; not an address: no."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in networks)


def shows_cache_status(trusted: bool, settings: ControlSettings) -> bool:
    return trusted or settings.status_visible == "all"


def http_client_address(environ: Mapping[str, object]) -> str:
    """REMOTE_ADDR; on the front server's unix socket (empty REMOTE_ADDR) only our nginx edge
    connects, and it sets X-Forwarded-For to the client's address, replacing any the client sent."""
    remote = str(environ.get("REMOTE_ADDR") or "")
    if remote:
        return remote
    return str(environ.get("HTTP_X_FORWARDED_FOR") or "").rsplit(",", 1)[-1].strip()


def grpc_peer_address(peer: str) -> str:
    """``ipv4:1.2.3.4:5678`` / ``ipv6:[::1]:5678`` -> the address; anything else -> ''."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return ""
