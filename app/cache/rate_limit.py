"""``RATE_LIMIT`` for gRPC, counted in Redis: one budget per client address across every
worker and replica (gRPC does not pass the nginx edge, which limits HTTP itself).

The semantics are nginx's ``limit_req rate=R burst=B nodelay``: a client may send B+1
requests at once, then R per second; a refused request costs nothing. It is GCRA (the
generic cell rate algorithm): one number per client, its theoretical arrival time (TAT).
A request at ``now`` is allowed when ``max(TAT, now) - now <= B / R``, and then moves the
TAT on by ``1 / R``. The check and the update are one Lua script
(``app/cache/scripts/rate_limit_gcra.lua``), atomic in Redis, on Redis's clock (``TIME``),
so workers and replicas with skewed clocks share one budget. The key expires once its TAT
has passed (a client that stopped is at a full burst again then).

Redis unavailable (down, slow, circuit open): the request is allowed (fail open; Redis
errors are counted in ``ocr_redis_errors_total{op="rate_limit"}``). Caching off (no Redis
at all): each process counts its own budget in memory.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from app import metrics
from app.cache.keys import KeySpace
from app.cache.scripts import RATE_LIMIT_GCRA
from app.cache.store import NullStore, RedisStore

# In-memory budgets (caching off) kept at most; past it the expired ones are dropped.
_LOCAL_MAX_CLIENTS = 100_000


@dataclass(frozen=True)
class Decision:
    """``retry_after``: whole seconds until the client may send again (0 when allowed)."""

    allowed: bool
    retry_after: int = 0


ALLOWED = Decision(True)


class RateLimiter:
    """``check(client)`` for one protocol's requests (``protocol`` labels the metric, when
    given): ``rate`` requests per second, ``burst`` more at once (``RATE_LIMIT=rate:burst``).
    Also the tenants' request quotas and the failed-key budget (``quotas.py``)."""

    def __init__(
        self,
        store: RedisStore | NullStore,
        keys: KeySpace,
        rate: float,
        burst: int,
        protocol: str | None,
    ) -> None:
        self._store = store
        self._keys = keys
        self._protocol = protocol
        self._interval_us = 1_000_000 / rate
        self._tolerance_us = burst * self._interval_us
        self._args = (f"{self._interval_us:.3f}", f"{self._tolerance_us:.3f}")
        self._local: dict[str, float] = {}
        self._lock = threading.Lock()

    def check(self, client: str, spend: bool = True) -> Decision:
        """Whether ``client`` may send now; ``spend=False`` only looks (no cell spent)."""
        if isinstance(self._store, RedisStore):
            decision = self._check_redis(self._store, client, spend)
        else:
            decision = self._check_local(client, spend)
        if not decision.allowed and self._protocol:
            metrics.RATE_LIMITED.labels(protocol=self._protocol).inc()
        return decision

    def _check_redis(self, store: RedisStore, client: str, spend: bool) -> Decision:
        key = self._keys.rate_limit(client)
        args = (*self._args, "0" if spend else "1")

        def run(redis: Any) -> Any:
            return RATE_LIMIT_GCRA(redis, [key], args)

        ok, answer = store.run("rate_limit", run)
        if not ok:
            return ALLOWED  # fail open; the store counted the failure
        allowed, wait_ms = answer
        if int(allowed):
            return ALLOWED
        return Decision(False, _seconds(int(wait_ms) / 1000))

    def _check_local(self, client: str, spend: bool) -> Decision:
        """The same GCRA, in this process only."""
        now = time.monotonic() * 1_000_000
        with self._lock:
            tat = max(self._local.get(client, now), now)
            wait = tat - self._tolerance_us - now
            if wait > 0:
                return Decision(False, _seconds(wait / 1_000_000))
            if not spend:
                return ALLOWED
            if len(self._local) >= _LOCAL_MAX_CLIENTS:
                self._local = {c: t for c, t in self._local.items() if t > now}
            self._local[client] = tat + self._interval_us
        return ALLOWED


def _seconds(wait: float) -> int:
    """``retry-after``: whole seconds, at least 1."""
    return max(1, math.ceil(wait))
