"""Redis URLs of the Sentinel and Cluster forms, parsed without redis-py: a leaf module, so
``config`` validates ``REDIS_URL`` at start-up without importing the cache layer."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

SENTINEL = "redis+sentinel://"
CLUSTER = "redis+cluster://"


@dataclass(frozen=True)
class Endpoint:
    kind: str  # "single" | "sentinel" | "cluster"
    hosts: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    service: str | None
    db: int


def parse(url: str) -> Endpoint:
    """Parse the Sentinel and Cluster forms (``single`` URLs go to redis-py as they are)."""
    if not url.startswith((SENTINEL, CLUSTER)):
        return Endpoint("single", (), None, None, None, 0)
    kind = "sentinel" if url.startswith(SENTINEL) else "cluster"
    rest = url.split("://", 1)[1]
    auth, _, rest = rest.rpartition("@")
    hostlist, _, path = rest.partition("/")
    hosts = []
    for item in hostlist.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad host:port {item!r}")
        hosts.append((host.strip("[]"), int(port)))
    username, password = None, None
    if auth:
        user, sep, secret = auth.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if sep else None)
    parts = [p for p in path.split("/") if p]
    service, db = None, 0
    if kind == "cluster" and parts:
        raise ValueError("redis+cluster:// takes no path (clusters have one db)")
    if kind == "sentinel":
        if not parts:
            raise ValueError("redis+sentinel:// needs a /service name")
        service = parts[0]
        db = int(parts[1]) if len(parts) > 1 else 0
    return Endpoint(kind, tuple(hosts), username, password, service, db)
