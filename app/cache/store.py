"""Redis, as the tiers and the miss queue reach it: short timeouts, one retry, a circuit
breaker, never an exception.

Every method answers even when Redis is down: reads report a miss, writes are dropped and
scripts report failure, so a Redis outage costs cache hits, not requests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import ResponseError

from app import metrics
from app.cache import purging, redis_client
from app.cache.breaker import CircuitBreaker
from app.cache.purging import Purged

log = logging.getLogger(__name__)

REDIS_ERRORS = redis_client.ERRORS


def _describe(exc: BaseException) -> str:
    """Class name, plus the server's error code for answered errors (e.g. OOM, NOPERM)."""
    if isinstance(exc, ResponseError) and exc.args:
        return f"{exc.__class__.__name__} {str(exc.args[0]).split(' ', 1)[0]}"
    return exc.__class__.__name__


class RedisStore:
    enabled = True  # a real tier (``NullStore`` is the one that is not)

    def __init__(
        self,
        url: str,
        timeout_ms: int,
        connect_timeout_ms: int,
        breaker: CircuitBreaker,
        client: Any = None,
        **options: Any,
    ) -> None:
        """``options``: username, password and TLS files for ``redis_client.connect``."""
        self._breaker = breaker
        self._url = url
        self._options = options
        self._timeouts = (timeout_ms / 1000, connect_timeout_ms / 1000)
        self._client = client or redis_client.connect(url, *self._timeouts, **options)
        self._cluster = redis_client.is_cluster(self._client)
        # Reads on the hit path: one connection per thread (``_read``), on one plain node.
        pool = getattr(self._client, "connection_pool", None)
        self._own_connections = type(pool) is redis.ConnectionPool
        self._thread = threading.local()

    @property
    def breaker_state(self) -> str:
        return self._breaker.state

    def _call(self, op: str, fn: Any) -> tuple[bool, Any]:
        if not self._breaker.allow():
            metrics.REDIS_ERRORS.labels(op=op, reason="circuit_open").inc()
            return False, None
        try:
            value = fn()
        except REDIS_ERRORS as exc:
            if redis_client.server_answered(exc):
                self._breaker.success()
            else:
                self._breaker.failure()
            metrics.REDIS_ERRORS.labels(op=op, reason=exc.__class__.__name__).inc()
            log.warning("redis %s failed: %s", op, _describe(exc))
            return False, None
        self._breaker.success()
        return True, value

    def get_many(self, keys: Sequence[str]) -> tuple[bool, list[bytes | None]]:
        """(ok, values) in one round trip (per node on a cluster); on failure all None."""
        keys = list(keys)
        if self._cluster and len(keys) > 1:
            ok, values = self._call("get", lambda: self._client.mget_nonatomic(keys))
        elif self._own_connections and not getattr(self._thread, "pooled", False):
            ok, values = self._call("get", lambda: self._read("MGET", *keys))
        else:
            ok, values = self._call("get", lambda: self._client.mget(keys))
        return (True, list(values)) if ok else (False, [None] * len(keys))

    def _read(self, *command: Any) -> Any:
        """A read on this thread's own connection, with the client's ``Retry``: a hit pays
        no pool lock, no is-the-connection-clean poll and no command dispatch (about half of
        redis-py's cost of a GET here, by ``python -m bench.profile_hit``). Plain single-node
        clients only (a Sentinel's pool finds the master per connection, a Cluster per slot)."""
        connection = getattr(self._thread, "connection", None)
        if connection is None:
            connection = self._client.connection_pool.make_connection()
            self._thread.connection = connection

        def attempt() -> Any:
            connection.send_command(*command)
            return connection.read_response()

        return connection.retry.call_with_retry(attempt, lambda _: connection.disconnect())

    def pooled_reads(self) -> None:
        """The calling thread reads through the shared pool, not on a connection of its own:
        for threads that read once per ticket, not per hit (the feeders: one per engine slot,
        16 per worker for a remote engine, each keeping an idle connection otherwise)."""
        self._thread.pooled = True

    def set(self, key: str, value: bytes, ttl_seconds: int) -> bool:
        ok, _ = self._call("set", lambda: self._client.set(key, value, ex=ttl_seconds))
        return ok

    def publish(self, channel: str, message: str) -> None:
        self._call("publish", lambda: self._client.publish(channel, message))

    def pubsub_client(self, timeout_s: float | None = None, *, dedicated: bool = False) -> Any:
        """A client for a long-lived subscription or blocking reads (no short timeout);
        ``dedicated``: one connection of its own (a single node only), whose blocking reads
        another client can end (CLIENT UNBLOCK)."""
        extra: dict[str, Any] = {}
        if dedicated and not self._cluster:
            extra["single_connection_client"] = True
        if "sentinel" in self._url.split("://", 1)[0]:
            extra = {}
        return redis_client.connect(
            self._url, timeout_s, self._timeouts[1], **self._options, **extra
        )

    def run(self, op: str, fn: Any) -> tuple[bool, Any]:
        """``fn(client)`` under the breaker, as the methods above: (ok, value), never raises
        (the miss queue's commands, ``app/queue/``; the quotas, the pixel index)."""
        return self._call(op, lambda: fn(self._client))

    def scan_unlink(self, pattern: str, sync: str, batch: int = 500) -> Purged:
        """Delete keys matching ``pattern`` in batches (SCAN + UNLINK, never blocking Redis the
        way KEYS or a big DEL would), each master then waiting for its replicas to have the
        deletes (a key named ``sync`` + a hash tag, ``purging.py``): how many were removed,
        and whether that is confirmed."""
        if not self._breaker.allow():
            metrics.REDIS_ERRORS.labels(op="purge", reason="circuit_open").inc()
            return Purged(0, "Redis is being skipped after failures (circuit open)")
        purged = purging.scan_unlink(self._client, pattern, sync, batch)
        if purged.unconfirmed:
            metrics.REDIS_ERRORS.labels(op="purge", reason="unconfirmed").inc()
            log.warning("redis purge unconfirmed: %s", purged.unconfirmed)
        return purged

    def _every_primary(self) -> dict[str, Any]:
        """What sends a server command (INFO, DBSIZE, CONFIG GET) to every primary: redis-py's
        cluster client sends one to a single node unless told; a single node needs nothing."""
        return {"target_nodes": self._client.PRIMARIES} if self._cluster else {}

    def stats(self) -> dict[str, Any]:
        """Server memory and eviction figures for /admin/stats ({} when unavailable)."""
        ok, info = self._call("stats", lambda: self._client.info(**self._every_primary()))
        if not ok or not isinstance(info, dict):
            return {}
        nodes = (
            list(info.values())
            if info and all(isinstance(v, dict) for v in info.values())
            else [info]
        )
        # A cluster's figures are its primaries' summed (memory, counters); the rest, the
        # first primary's, with the policy "mixed" when the primaries differ.
        summed = ("used_memory", "maxmemory", "evicted_keys", "expired_keys",
                  "keyspace_hits", "keyspace_misses")  # fmt: skip
        out: dict[str, Any] = {k: sum(int(n.get(k, 0)) for n in nodes) for k in summed
                               if k in nodes[0]}  # fmt: skip
        policies = {n.get("maxmemory_policy") for n in nodes}
        if "maxmemory_policy" in nodes[0]:
            out["maxmemory_policy"] = policies.pop() if len(policies) == 1 else "mixed"
        if "redis_version" in nodes[0]:
            out["redis_version"] = nodes[0]["redis_version"]
        if len(nodes) > 1:
            out["primaries"] = len(nodes)
        return out

    def key_count(self) -> int | None:
        """DBSIZE (summed over primaries on a cluster): entries and companions; None when down."""
        ok, value = self._call("dbsize", lambda: self._client.dbsize(**self._every_primary()))
        return int(value) if ok and value is not None else None

    def members(self, key: str) -> tuple[bool, frozenset[bytes]]:
        """(ok, the members of set ``key``); on failure (False, empty set)."""
        ok, value = self._call("smembers", lambda: self._client.smembers(key))
        return (True, frozenset(value)) if ok else (False, frozenset())

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

    def push_recent(self, items: Sequence[tuple[str, str]], keep: int, ttl_seconds: int) -> bool:
        """Put each member first in its list key, once, keeping the ``keep`` newest; the
        lists expire with the entries. One round trip (a plain pipeline: keys may span
        slots on a cluster)."""

        def run() -> Any:
            pipe = self._client.pipeline(transaction=False)
            for key, member in items:
                pipe.lrem(key, 0, member)
                pipe.lpush(key, member)
                pipe.ltrim(key, 0, keep - 1)
                pipe.expire(key, ttl_seconds)
            return pipe.execute()

        ok, _ = self._call("set", run)
        return ok

    def recent_many(self, keys: Sequence[str], keep: int) -> tuple[bool, list[list[bytes]]]:
        """(ok, the ``keep`` newest members of each list key) in one round trip."""

        def run() -> Any:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.lrange(key, 0, keep - 1)
            return pipe.execute()

        ok, values = self._call("get", run)
        return (True, [list(v) for v in values]) if ok else (False, [[] for _ in keys])

    def ping(self) -> bool:
        ok, _ = self._call("ping", self._client.ping)
        return ok

    def eviction_policy(self) -> str | None:
        """The server's ``maxmemory-policy``, or None when it cannot be read (e.g. ACLs)."""
        try:
            policy = self._client.config_get("maxmemory-policy", **self._every_primary())
        except REDIS_ERRORS:
            return None
        if not policy:
            return None
        if all(isinstance(v, dict) for v in policy.values()):  # per primary on a cluster
            found = {v.get("maxmemory-policy") for v in policy.values()}
            return (
                found.pop()
                if len(found) == 1
                else "mixed (" + ", ".join(sorted(map(str, found))) + ")"
            )
        return policy.get("maxmemory-policy")

    def close(self) -> None:
        self._client.close()


class NullStore:
    """Caching off (``CACHE_ENABLED=false`` or no ``REDIS_URL``): the front door is handed
    this instead of ``None``. Reads miss, writes vanish; ``enabled`` tells the front door to
    answer BYPASS and the admin/readiness views to say "disabled"."""

    enabled = False
    breaker_state = "closed"

    def get_many(self, keys: Sequence[str]) -> tuple[bool, list[bytes | None]]:
        return True, [None] * len(keys)

    def set(self, key: str, value: bytes, ttl_seconds: int) -> bool:
        return True

    def publish(self, channel: str, message: str) -> None:
        return None

    def scan_unlink(self, pattern: str, sync: str, batch: int = 500) -> Purged:
        return Purged(0)

    def close(self) -> None:
        return None


Store = RedisStore | NullStore
