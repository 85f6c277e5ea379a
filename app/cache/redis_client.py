"""Building the redis-py client for ``REDIS_URL``: one node, Sentinel or Cluster.

- ``redis://``, ``rediss://``, ``unix://`` — redis-py's own URL parsing.
- ``redis+sentinel://[user:pass@]host:port[,host:port]/service[/db]`` — redis-py's
  ``Sentinel``; the client follows the master through failovers.
- ``redis+cluster://[user:pass@]host:port[,host:port]`` — redis-py's ``RedisCluster``.

Every form gets the same short timeouts and one immediate retry (redis-py's ``Retry``).
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ClusterError, RedisClusterException, ResponseError
from redis.retry import Retry
from redis.sentinel import Sentinel

from app.redis_url import parse

# Every way a Redis call fails (redis-py's cluster errors, SlotNotCoveredError among them, are
# not RedisErrors).
ERRORS = (redis.RedisError, OSError, RedisClusterException)


def connect(
    url: str,
    timeout_s: float | None,
    connect_timeout_s: float,
    *,
    username: str = "",
    password: str = "",
    tls_ca_file: str = "",
    tls_cert_file: str = "",
    tls_key_file: str = "",
    **extra: Any,
) -> Any:
    """A client for ``url`` (``redis.Redis`` or ``RedisCluster``) with our timeouts.

    ``username``/``password`` (from REDIS_USERNAME / REDIS_PASSWORD[_FILE]) apply where the
    URL has none; the TLS files apply to ``rediss://`` (and turn TLS on for the Sentinel and
    Cluster forms).
    """
    tls: dict[str, Any] = {}
    if tls_ca_file:
        tls["ssl_ca_certs"] = tls_ca_file
    if tls_cert_file:
        tls["ssl_certfile"] = tls_cert_file
    if tls_key_file:
        tls["ssl_keyfile"] = tls_key_file
    common: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        # One immediate retry covers a pooled connection that died with a restart.
        "retry": Retry(NoBackoff(), 1),
        **extra,
    }
    endpoint = parse(url)
    if endpoint.kind == "single":
        secured = tls if url.startswith("rediss://") else {}
        auth_kw = {k: v for k, v in (("username", username), ("password", password)) if v}
        return redis.Redis.from_url(url, health_check_interval=30, **auth_kw, **secured, **common)
    auth: dict[str, Any] = {
        "username": endpoint.username or username or None,
        "password": endpoint.password or password or None,
    }
    if tls:
        common.update(ssl=True, **tls)
    if endpoint.kind == "sentinel":
        sentinel = Sentinel(
            list(endpoint.hosts),
            sentinel_kwargs={
                "socket_timeout": timeout_s,
                "socket_connect_timeout": connect_timeout_s,
                **auth,
            },
            **common,
        )
        return sentinel.master_for(endpoint.service, db=endpoint.db, **auth)
    return RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in endpoint.hosts],
        # A failed node is given up on quickly: the engine answers meanwhile.
        cluster_error_retry_attempts=1,
        **auth,
        **common,
    )


def server_answered(exc: BaseException) -> bool:
    """A server that answers with an error (OOM under noeviction, NOPERM, WRONGTYPE) is up:
    only transport failures should open a circuit breaker."""
    return isinstance(exc, ResponseError) and not isinstance(exc, ClusterError)


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)
