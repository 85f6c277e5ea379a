"""A purge that a fail-over cannot undo. Redis replicates asynchronously: a master that dies
before its replica got a purge's deletes has the replica promoted with the purged entries
in it, and they would be served again. So after the deletes (SCAN + UNLINK in batches, never
blocking Redis) every master (each primary of a cluster) writes a short-lived key and waits
(``WAIT``, at most ``WAIT_MS``) until every replica it has acknowledges that write, and so
everything before it: this purge's deletes and an earlier, unconfirmed purge's. A purge
not confirmed on every replica, or whose scan or unlink failed part-way, says so
(``Purged.unconfirmed``): the operator repeats it (a purge is idempotent).

``WAIT`` counts the writes of its own connection, hence the key, written on a connection of
the purge's own to each master just before its ``WAIT``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from app.cache import redis_client
from app.vocabulary import OcrCacheError

WAIT_MS = 1000  # how long each master waits for its replicas to confirm
SYNC_TTL_MS = 10_000  # the written key's life: it only has to reach the replicas


@dataclass(frozen=True)
class Purged:
    """``removed`` keys; ``unconfirmed``: why the purge is not known complete on every
    replica ("" when it is)."""

    removed: int
    unconfirmed: str = ""


class PurgeUnconfirmed(OcrCacheError):
    """A purge removed ``removed`` entries but is not known complete and replicated: repeat it."""

    code = "purge_unconfirmed"

    def __init__(self, removed: int, reason: str) -> None:
        super().__init__(reason)
        self.removed = removed
        self.reason = reason


def scan_unlink(
    client: Any, pattern: str, sync: str, batch: int = 500, wait_ms: int = WAIT_MS
) -> Purged:
    """Delete every key matching ``pattern`` (on every primary of a cluster), then confirm it
    on each master's replicas with a key named ``sync`` + a hash tag; Redis errors are
    reported in ``unconfirmed``, never raised."""
    removed = 0
    try:
        chunk: list[bytes] = []
        for key in client.scan_iter(match=pattern, count=batch):
            chunk.append(key)
            if len(chunk) >= batch:
                removed += _unlink(client, chunk)
                chunk = []
        if chunk:
            removed += _unlink(client, chunk)
        return Purged(removed, confirm(client, sync, wait_ms))
    except redis_client.ERRORS as exc:
        return Purged(removed, f"Redis failed during the purge ({exc.__class__.__name__})")


def _unlink(client: Any, keys: list[bytes]) -> int:
    if not redis_client.is_cluster(client):
        return int(client.unlink(*keys))
    pipe = client.pipeline(transaction=False)  # keys may span slots
    for key in keys:
        pipe.unlink(key)
    return sum(int(n) for n in pipe.execute())


def confirm(client: Any, sync: str, wait_ms: int) -> str:
    """Empty once every master's replicas acknowledged its writes so far; else why not. The
    masters wait at once, so this takes ``wait_ms`` at most, however many there are."""
    cluster = redis_client.is_cluster(client)
    masters = client.get_primaries() if cluster else [None]
    waiting: list[tuple[str, Any, int]] = []
    try:
        for master in masters:
            node = client if master is None else client.get_redis_connection(master)
            connection = node.connection_pool.make_connection()
            name = "the master" if master is None else f"master {master.name}"
            waiting.append((name, connection, 0))
            # Connected now: a Sentinel pool's connection finds the master only in connect();
            # sent a command first, it would dial its default address (localhost:6379).
            connection.connect()
            needed = replicas(connection, cluster)
            waiting[-1] = (name, connection, needed)
            key = _sync_key(client, master, sync)
            commands = [("SET", key, "1", "PX", SYNC_TTL_MS), ("WAIT", needed, wait_ms)]
            connection.send_packed_command(connection.pack_commands(commands))
        short = []
        for name, connection, needed in waiting:
            connection.read_response()
            acked = int(connection.read_response(timeout=wait_ms / 1000 + 1))
            if acked < needed:
                short.append(f"{acked} of {needed} replicas of {name} confirmed in time")
        return "; ".join(short)
    finally:
        for _, connection, _ in waiting:
            connection.disconnect()


def _sync_key(client: Any, master: Any, sync: str) -> str:
    """A key of ``master``'s slots (the first hash tag that lands there)."""
    if master is None:
        return f"{sync}{{0}}"
    for n in itertools.count():
        key = f"{sync}{{{n}}}"
        if client.get_node_from_key(key).name == master.name:
            return key
    raise AssertionError("unreachable")


def replicas(connection: Any, cluster: bool) -> int:
    """How many replicas the master behind ``connection`` has: on a cluster every replica the
    cluster knows for it and does not hold failed (one that may yet be promoted); else every
    replica connected to it."""
    if cluster:
        connection.send_command("CLUSTER", "MYID")
        me = _text(connection.read_response())
        connection.send_command("CLUSTER", "REPLICAS", me)
        flags = [_text(line).split()[2].split(",") for line in connection.read_response()]
        return sum(1 for f in flags if not {"fail", "noaddr"} & set(f))
    connection.send_command("INFO", "replication")
    for line in _text(connection.read_response()).splitlines():
        if line.startswith("connected_slaves:"):
            return int(line.split(":", 1)[1])
    return 0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
