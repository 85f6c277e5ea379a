"""Each feeder thread's own Redis connection, for its blocking reads (the doorbells): one
per thread, registered so that ``stop`` can end a blocked read at once (CLIENT UNBLOCK).
Its reports and ticket markers go on it too, while entries are read through the store's
shared pool, so what a feeder holds does not grow as tickets first reach it (the soak,
docs/RELIABILITY.md)."""

from __future__ import annotations

from typing import Any

from app.cache.store import RedisStore
from app.queue.ticket import BLOCK_MS, LISTEN_MS  # the longest waits for a doorbell


class Connections:
    """The dedicated connections of one set of feeders, by thread key."""

    def __init__(self, store: RedisStore) -> None:
        self._store = store
        self._ids: dict[int, int] = {}

    def open(self, key: int) -> Any:
        """A connection of the thread's own for blocking reads, registered under ``key``."""
        client = self._store.pubsub_client(max(BLOCK_MS, LISTEN_MS) / 1000 + 5, dedicated=True)
        if getattr(client, "_single_connection_client", False):
            self._ids[key] = client.client_id()
        return client

    def drop(self, key: int, client: Any) -> None:
        """Forget ``key``'s connection and close ``client`` (None: none was open)."""
        self._ids.pop(key, None)
        close(client)

    def unblock_all(self) -> None:
        """End every registered connection's blocking read now."""
        for client_id in list(self._ids.values()):
            self._store.run("dispatch", lambda c, i=client_id: c.client_unblock(i))


def close(client: Any) -> None:
    if client is not None:
        try:
            client.close()
        except Exception:  # noqa: S110 - closing a broken client
            pass
