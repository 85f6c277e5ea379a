"""The cross-process single-creator election: what ``dogpile/lock.py`` is to dogpile.

Processes and replicas elect one computer per key with a Redis lease (SET NX PX, random
token, renewed every third of its period while computing, released by its owner only);
the others wait for its pub/sub notification, bounded by ``wait_seconds``, then compute
themselves. A lease left by a dead owner expires after one period and a waiter takes over;
when Redis does not answer the lease calls, this process computes without the election.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

from app.cache.notify import Notifier
from app.cache.store import RedisStore
from app.vocabulary import CacheStatus, OcrResult, Outcome

log = logging.getLogger(__name__)

# Lease calls that may fail in a row (timeouts on a loaded host) before this process
# computes without the cross-process election.
LEASE_ATTEMPTS = 3


class Election:
    def __init__(
        self, store: RedisStore, notifier: Notifier, lease_ms: int, wait_seconds: float
    ) -> None:
        self._store = store
        self._notifier = notifier
        self._lease_ms = lease_ms
        self._wait_seconds = wait_seconds

    def run(
        self,
        lease: str,
        channel: str,
        reread: Callable[[], OcrResult | None],
        compute: Callable[[], Outcome],
        label: str,
        dispatch: Callable[[str], Outcome] | None = None,
    ) -> Outcome:
        """``compute`` once across processes: as the lease's owner (after one more
        ``reread``), or after waiting for the owner in vain; else the owner's result,
        COALESCED. ``label`` names the key in logs. ``dispatch(token)``, when given, is what
        the owner runs instead of ``compute`` (the global miss queue, ``dispatch.py``)."""
        # Even after a failed read: one slow answer (a loaded host) is not Redis being down,
        # and an open circuit makes the lease calls below fail fast anyway.
        deadline = time.monotonic() + self._wait_seconds
        failures = 0
        while True:
            token = secrets.token_hex(16)
            acquired = self._store.acquire_lease(lease, token, self._lease_ms)
            if acquired is None:
                failures += 1
                if failures >= LEASE_ATTEMPTS or self._store.breaker_state == "open":
                    # Redis is unreachable: single-flight is in-process only now.
                    return compute()
                continue
            if acquired:
                owned = compute if dispatch is None else partial(dispatch, token)
                return self._as_owner(lease, token, channel, reread, owned)
            waited = self._wait_for_owner(lease, channel, reread, deadline)
            if waited is not None:
                return Outcome(waited, CacheStatus.COALESCED)
            if time.monotonic() >= deadline:
                log.warning("waited %.0fs for another computation of %s; computing here",
                            self._wait_seconds, label)  # fmt: skip
                return compute()
            # The owner failed or died (its lease is gone or expiring): try to take over.

    def _wait_for_owner(
        self,
        lease: str,
        channel: str,
        reread: Callable[[], OcrResult | None],
        deadline: float,
    ) -> OcrResult | None:
        """Block on the owner's notification (not a poll); None if no result came."""
        event = self._notifier.register(channel)
        try:
            hit = reread()
            if hit is not None:
                return hit
            if self._store.exists(lease) is False:
                return None  # released without a result (owner failed): take over now
            # At most one lease period per round: a crashed owner's lease expires by then.
            timeout = min(deadline - time.monotonic(), self._lease_ms / 1000)
            event.wait(max(0.0, timeout))
            return reread()
        finally:
            self._notifier.unregister(channel, event)

    def _as_owner(
        self,
        lease: str,
        token: str,
        channel: str,
        reread: Callable[[], OcrResult | None],
        compute: Callable[[], Outcome],
    ) -> Outcome:
        outcome = "error"
        try:
            with self._renewing(lease, token):
                # The previous owner may have stored the result just before we took over.
                hit = reread()
                if hit is not None:
                    outcome = "ok"
                    return Outcome(hit, CacheStatus.HIT)
                result = compute()
                outcome = "ok"
                return result
        finally:
            self._store.release_lease(lease, token)
            self._store.publish(channel, outcome)

    @contextmanager
    def _renewing(self, lease: str, token: str) -> Iterator[None]:
        """Keep the lease alive while computing: renew every third of its period."""
        store, ttl_ms = self._store, self._lease_ms
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(ttl_ms / 3000):
                # A renewal Redis did not answer is retried at the next tick: only a lease
                # that is provably someone else's now ends the renewals.
                if store.renew_lease(lease, token, ttl_ms) is False:
                    log.warning("lost the single-flight lease %s", lease)
                    return

        thread = threading.Thread(target=renew, name="lease-renew", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
