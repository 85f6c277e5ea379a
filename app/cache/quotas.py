"""A tenant's quotas, counted in Redis across every worker and replica, each on Redis's clock
in one atomic script (the limits come from the tenants file, ``app/tenants.py``):

- **request rate** (``rate``, ``RPS:BURST``): every request, hits included, before any work;
  the GCRA of ``rate_limit.py`` with one budget per tenant.
- **misses in flight** (``misses_in_flight``): requests of the tenant waiting on a miss (in
  the queue, on an engine, or joined to a ticket), a sorted set of slots scored by when each
  expires, so the slots of a killed worker free themselves at its deadline.
- **engine seconds per minute** (``engine_seconds_per_minute``): a GCRA over engine time:
  every engine call of the tenant's images spends its seconds afterwards; a new miss is
  refused while the tenant has spent more than its minute's budget, until enough of it
  has come back (the ``Retry-After``).

Hits are never refused by the miss quotas: those are asked only once an image is a miss.
Over a quota: ``QuotaExceeded`` (429 + ``Retry-After`` in each protocol's form), counted
in ``ocr_tenant_rejections_total``. Redis unavailable: allowed (fail open, as
``RATE_LIMIT``); caching off (no Redis): each process counts its own.

Also the failed-key budget of ``AUTH=keys``: an address whose keys were refused more often
than ``AUTH_FAILURE_LIMIT`` allows is refused (429) before its key is looked at.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from app import metrics
from app.cache.keys import KeySpace
from app.cache.rate_limit import RateLimiter
from app.cache.scripts import QUOTA_ENGINE_TIME, QUOTA_SLOTS
from app.cache.store import RedisStore, Store
from app.env import RateLimit
from app.tenants import Tenant, TenantBook
from app.vocabulary import QuotaExceeded

# The scripts: app/cache/scripts/quota_slots.lua and quota_engine_time.lua.
_MINUTE_US = 60_000_000


class Quotas:
    """The quotas of every tenant in ``book``; ``slot_seconds``: how long a miss may hold
    its slot (its deadline, and a margin); ``mean_seconds``: an engine call's mean (the
    ``Retry-After`` of a full slot set)."""

    def __init__(
        self,
        store: Store,
        keys: KeySpace,
        book: TenantBook,
        *,
        failure_limit: RateLimit,
        slot_seconds: float,
        mean_seconds: Callable[[], float] = lambda: 1.0,
    ) -> None:
        self.book = book
        self._store = store
        self._redis = store if isinstance(store, RedisStore) else None
        self._keys = keys
        self._slot_ms = int(slot_seconds * 1000)
        self._mean_seconds = mean_seconds
        self._failures = RateLimiter(
            store, keys, failure_limit.rate, failure_limit.burst, protocol=None
        )
        self._limiters: dict[tuple[str, float, int], RateLimiter] = {}
        self._lock = threading.Lock()
        self._local_slots: dict[str, int] = {}  # caching off: this process's own counts
        self._local_engine: dict[str, float] = {}

    # Before any work ---------------------------------------------------------------------

    def admit(self, namespace: str) -> None:
        """The tenant's request rate (every request, hits included)."""
        tenant = self.book.get(namespace)
        if tenant is None or tenant.rate is None:
            return
        decision = self._limiter(tenant).check(f"tenant:{tenant.name}")
        if not decision.allowed:
            self._refuse(
                namespace,
                "rate",
                f"tenant {tenant.name!r} over its request rate ({tenant.rate} per second)",
                decision.retry_after,
            )

    def key_refusals_allowed(self, address: str) -> None:
        """Before a key is looked at: an address past its failed-key budget is refused."""
        decision = self._failures.check(f"authfail:{address}", spend=False)
        if not decision.allowed:
            metrics.TENANT_REJECTIONS.labels(tenant="other", reason="auth_failures").inc()
            raise QuotaExceeded(
                "too many refused API keys from this address; retry later",
                decision.retry_after,
                "auth_failures",
            )

    def key_refused(self, address: str) -> None:
        """A refused key spends one cell of its address's budget."""
        self._failures.check(f"authfail:{address}")

    def _limiter(self, tenant: Tenant) -> RateLimiter:
        assert tenant.rate is not None
        index = (tenant.name, tenant.rate.rate, tenant.rate.burst)
        limiter = self._limiters.get(index)
        if limiter is None:
            limiter = RateLimiter(
                self._store, self._keys, tenant.rate.rate, tenant.rate.burst, protocol=None
            )
            self._limiters[index] = limiter
        return limiter

    # Misses -------------------------------------------------------------------------------

    @contextmanager
    def miss(self, namespace: str) -> Iterator[None]:
        """Hold one of the tenant's miss slots while its miss is computed (or waited for);
        refused when they are all taken or its engine-time budget is spent."""
        tenant = self.book.get(namespace)
        if tenant is None:
            yield
            return
        if tenant.engine_seconds_per_minute is not None:
            wait_ms = self._engine_time(tenant, 0.0)
            if wait_ms > 0:
                self._refuse(
                    namespace,
                    "engine_seconds",
                    f"tenant {tenant.name!r} spent its {tenant.engine_seconds_per_minute:g} "
                    "engine seconds of the last minute",
                    math.ceil(wait_ms / 1000),
                )
        release = self._enter(tenant) if tenant.misses_in_flight is not None else None
        try:
            yield
        finally:
            if release is not None:
                release()

    def charge(self, namespace: str, seconds: float) -> None:
        """An engine call of the tenant's took ``seconds`` (counted and spent)."""
        metrics.TENANT_ENGINE_SECONDS.labels(tenant=self.book.label(namespace)).inc(seconds)
        tenant = self.book.get(namespace)
        if tenant is not None and tenant.engine_seconds_per_minute is not None and seconds > 0:
            self._engine_time(tenant, seconds)

    def _enter(self, tenant: Tenant) -> Callable[[], None]:
        assert tenant.misses_in_flight is not None
        limit = tenant.misses_in_flight
        if self._redis is None:
            with self._lock:
                taken = self._local_slots.get(tenant.name, 0)
                if taken < limit:
                    self._local_slots[tenant.name] = taken + 1
            if taken >= limit:
                self._slots_full(tenant)
            return lambda: self._leave_local(tenant.name)
        key, slot = self._keys.quota("inflight", tenant.name), secrets.token_hex(8)
        ok, entered = self._redis.run(
            "quota", lambda c: QUOTA_SLOTS(c, [key], [limit, self._slot_ms, slot])
        )
        if ok and not int(entered):
            self._slots_full(tenant)
        if not ok:
            return lambda: None  # fail open: Redis did not answer
        redis = self._redis

        def leave() -> None:
            redis.run("quota", lambda c: c.zrem(key, slot))

        return leave

    def _leave_local(self, name: str) -> None:
        with self._lock:
            self._local_slots[name] = max(0, self._local_slots.get(name, 1) - 1)

    def _slots_full(self, tenant: Tenant) -> None:
        self._refuse(
            tenant.name,
            "misses_in_flight",
            f"tenant {tenant.name!r} has {tenant.misses_in_flight} misses in flight already",
            math.ceil(self._mean_seconds()),
        )

    def _engine_time(self, tenant: Tenant, seconds: float) -> float:
        """Spend ``seconds`` of engine time (0: only look); the wait in ms until allowed."""
        assert tenant.engine_seconds_per_minute is not None
        cost_us = seconds * _MINUTE_US / tenant.engine_seconds_per_minute
        if self._redis is None:
            return self._engine_time_local(tenant.name, cost_us)
        key = self._keys.quota("engine", tenant.name)

        def run(client: Any) -> Any:
            return QUOTA_ENGINE_TIME(client, [key], [f"{cost_us:.0f}", _MINUTE_US])

        ok, wait_ms = self._redis.run("quota", run)
        return float(wait_ms) if ok else 0.0

    def _engine_time_local(self, name: str, cost_us: float) -> float:
        now = time.monotonic() * 1_000_000
        with self._lock:
            tat = max(self._local_engine.get(name, now), now)
            if cost_us <= 0:
                return max(0.0, (tat - _MINUTE_US - now) / 1000)
            self._local_engine[name] = tat + cost_us
        return 0.0

    def _refuse(self, namespace: str, reason: str, message: str, retry_after: int) -> None:
        metrics.TENANT_REJECTIONS.labels(tenant=self.book.label(namespace), reason=reason).inc()
        raise QuotaExceeded(f"{message}; retry after {max(1, retry_after)} s", retry_after, reason)
