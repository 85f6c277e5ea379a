"""The Redis tier (L2): short timeouts, one retry, a circuit breaker, never an exception.

Every method answers even when Redis is down: reads report a miss and writes are dropped,
so a Redis outage costs cache hits, not requests.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from app import metrics
from app.cache.breaker import CircuitBreaker

log = logging.getLogger(__name__)

_REDIS_ERRORS = (redis.RedisError, OSError)


class RedisStore:
    def __init__(
        self,
        url: str,
        timeout_ms: int,
        connect_timeout_ms: int,
        breaker: CircuitBreaker,
        client: redis.Redis | None = None,
    ) -> None:
        self._breaker = breaker
        self._client = client or redis.Redis.from_url(
            url,
            socket_timeout=timeout_ms / 1000,
            socket_connect_timeout=connect_timeout_ms / 1000,
            # One immediate retry covers a pooled connection that died with a restart.
            retry=Retry(NoBackoff(), 1),
            retry_on_timeout=False,
            health_check_interval=30,
        )

    @property
    def breaker_state(self) -> str:
        return self._breaker.state

    def _call(self, op: str, fn: Any) -> tuple[bool, Any]:
        if not self._breaker.allow():
            metrics.REDIS_ERRORS.labels(op=op, reason="circuit_open").inc()
            return False, None
        try:
            value = fn()
        except _REDIS_ERRORS as exc:
            self._breaker.failure()
            metrics.REDIS_ERRORS.labels(op=op, reason=exc.__class__.__name__).inc()
            log.warning("redis %s failed: %s", op, exc.__class__.__name__)
            return False, None
        self._breaker.success()
        return True, value

    def get_many(self, keys: Sequence[str]) -> tuple[bool, list[bytes | None]]:
        """(ok, values) in one round trip; on failure (False, all None)."""
        ok, values = self._call("get", lambda: self._client.mget(list(keys)))
        return (True, list(values)) if ok else (False, [None] * len(keys))

    def set(self, key: str, value: bytes, ttl_seconds: int) -> bool:
        ok, _ = self._call("set", lambda: self._client.set(key, value, ex=ttl_seconds))
        return ok

    def members(self, key: str) -> tuple[bool, set[bytes]]:
        """(ok, the members of set ``key``); on failure (False, empty set)."""
        ok, value = self._call("smembers", lambda: self._client.smembers(key))
        return (True, set(value)) if ok else (False, set())

    def add_member(self, key: str, member: str, ttl_seconds: int) -> bool:
        """SADD and EXPIRE in one round trip, so a set lives as long as its entries (no MULTI:
        one key, and plain pipelines work on Redis Cluster too)."""

        def run() -> Any:
            pipe = self._client.pipeline(transaction=False)
            pipe.sadd(key, member)
            pipe.expire(key, ttl_seconds)
            return pipe.execute()

        ok, _ = self._call("sadd", run)
        return ok

    def ping(self) -> bool:
        ok, _ = self._call("ping", self._client.ping)
        return ok

    def eviction_policy(self) -> str | None:
        """The server's ``maxmemory-policy``, or None when it cannot be read (e.g. ACLs)."""
        try:
            return self._client.config_get("maxmemory-policy").get("maxmemory-policy")
        except _REDIS_ERRORS:
            return None

    def close(self) -> None:
        self._client.close()
