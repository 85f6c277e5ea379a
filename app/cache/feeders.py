"""The global miss queue, the engines' side: one feeder thread per engine slot reads the next
job (XREADGROUP) only when its engine is free, so a miss goes to whichever engine of any
worker or replica frees up first (``jobs.py`` is the requester's side).

- A feeder reports its engine live (a sorted set scored by Redis's clock) every
  ``BLOCK_MS`` while idle and every third of ``DISPATCH_CLAIM_MS`` while computing, and
  touches its jobs (XCLAIM JUSTID); a job idle longer than ``DISPATCH_CLAIM_MS`` (its consumer
  died) is claimed by another feeder, at most ``DISPATCH_MAX_DELIVERIES`` times (an image
  that kills engines is then failed, not retried forever).
- A job nobody may still wait for is dropped unread: past its deadline, or its key's marker
  names another job (its requesters moved on to a newer one).
- When done, a job's marker is removed with it (XACK + XDEL): the next miss of that key
  (its entry evicted) is queued anew. Errors leave a marker (``{key}:error:{id}``, 60 s) and
  are announced on the done channel; they are never cached.
- While its engine fails (its own errors, not requests that stopped waiting) a feeder takes
  one job per ``UNHEALTHY_PAUSE_SECONDS``: a broken engine must not drain the fleet's queue
  into errors, yet it still probes, so it recovers.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from app import metrics
from app.cache.jobs import ERROR_TTL_S, GROUP, Job, JobQueue, as_text
from app.cache.keys import KeySpace
from app.cache.store import RedisStore
from app.vocabulary import EngineError, OcrParams

log = logging.getLogger(__name__)

BLOCK_MS = 1000  # a feeder's longest blocking read: how stale its report may get idle
UNHEALTHY_PAUSE_SECONDS = 5.0
_REDIS_ERRORS = (redis.RedisError, OSError)

_HEARTBEAT = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[2], ARGV[3])
if not ok then return -1 end
return redis.call('XLEN', KEYS[2]) - pending[1]
"""
# Done with these jobs: acknowledged, deleted, and their markers removed if still theirs.
_FINISH = """
local n = #ARGV - 1
for i = 1, n do
  if redis.call('GET', KEYS[i + 1]) == ARGV[i + 1] then redis.call('DEL', KEYS[i + 1]) end
end
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
return redis.call('XDEL', KEYS[1], unpack(ARGV, 2))
"""

Serve = Callable[[Sequence[Job]], None]


class Feeders:
    """This process's engine slots, feeding on the queue of ``queue``."""

    def __init__(
        self,
        store: RedisStore,
        keys: KeySpace,
        queue: JobQueue,
        *,
        slots: int,
        claim_ms: int,
        max_deliveries: int,
        batch_max: int,
    ) -> None:
        self._store = store
        self._keys = keys
        self._queue = queue
        self._stream, self._engines = queue.stream, queue.engines
        self._slots = slots
        self._claim_ms = claim_ms
        self._max_deliveries = max_deliveries
        self._batch_max = batch_max
        self._stopped = threading.Event()
        self.reported = threading.Event()  # a feeder has reported in: jobs can be taken
        self._threads: list[threading.Thread] = []
        self._client_ids: dict[int, int] = {}
        self._name = f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        _live.add(self)

    def start(
        self, wait_ready: Callable[[], None], serve: Serve, healthy: Callable[[], bool]
    ) -> None:
        """``wait_ready`` blocks until the engine is loaded; ``serve`` computes jobs and
        stores them (``succeeded``/``fail``); ``healthy()`` False: its last call failed."""
        for slot in range(self._slots):
            thread = threading.Thread(
                target=self._feed, args=(slot, wait_ready, serve, healthy),
                name=f"dispatch-{slot}", daemon=True,
            )  # fmt: skip
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop reading new jobs (jobs being computed finish); wakes blocked reads."""
        self._stopped.set()
        for client_id in list(self._client_ids.values()):
            self._store.run("dispatch", lambda c, i=client_id: c.client_unblock(i))
        for thread in self._threads:
            thread.join(timeout)
        _live.discard(self)

    def _feed(
        self, slot: int, wait_ready: Callable[[], None], serve: Serve, healthy: Callable[[], bool]
    ) -> None:
        while not self._stopped.is_set():
            try:
                wait_ready()
                break
            except EngineError:  # not loaded (yet): keep out of the queue
                self._stopped.wait(1.0)
        consumer = f"{self._name}-{slot}"
        client: Any = None
        backoff, next_reclaim = 0.1, 0.0
        while not self._stopped.is_set():
            if not healthy() and self._stopped.wait(UNHEALTHY_PAUSE_SECONDS):
                break
            try:
                if client is None:
                    client = self._store.pubsub_client(BLOCK_MS / 1000 + 5, dedicated=True)
                    if getattr(client, "_single_connection_client", False):
                        self._client_ids[slot] = client.client_id()
                try:
                    self._heartbeat(client, consumer)
                except redis.ResponseError:  # Redis answered (out of memory under noeviction):
                    pass  # the jobs already queued are still read
                jobs: list[Job] = []
                if time.monotonic() >= next_reclaim:
                    jobs = self._reclaim(client, consumer)
                    next_reclaim = time.monotonic() + self._claim_ms / 2000
                if not jobs and not self._stopped.is_set():
                    jobs = self._read(client, consumer)
                backoff = 0.1
            except _REDIS_ERRORS as exc:
                log.debug("dispatch feeder: %s; retrying", exc.__class__.__name__)
                self._client_ids.pop(slot, None)
                _close(client)
                client = None
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            if jobs:
                self._run(client, consumer, jobs, serve)
        self._client_ids.pop(slot, None)
        if client is not None:  # stopped between jobs: nothing of ours is pending
            try:
                client.xgroup_delconsumer(self._stream, GROUP, consumer)
            except _REDIS_ERRORS:
                pass
        _close(client)

    def _heartbeat(self, client: Any, consumer: str) -> None:
        depth = client.eval(_HEARTBEAT, 2, self._engines, self._stream, consumer,
                            self._claim_ms * 4, GROUP)  # fmt: skip
        if depth >= 0:
            metrics.DISPATCH_QUEUE_DEPTH.set(depth)
        self.reported.set()

    def _read(self, client: Any, consumer: str) -> list[Job]:
        try:
            answer = client.xreadgroup(GROUP, consumer, {self._stream: ">"},
                                       count=self._batch_max, block=BLOCK_MS)  # fmt: skip
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            try:  # the stream was never created, or evicted with its group
                client.xgroup_create(self._stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as again:
                if "BUSYGROUP" not in str(again):
                    raise
            return []
        jobs, malformed = [], []
        for _, entries in answer or ():
            for entry_id, raw in entries:
                job = _decode(entry_id, raw)
                if job is None:
                    blank = Job("", "", OcrParams(), "", 0, 0.0, b"", id=as_text(entry_id))
                    malformed.append(blank)
                else:
                    jobs.append(job)
        if malformed:
            self._finish(client, malformed)
        return jobs

    def _reclaim(self, client: Any, consumer: str) -> list[Job]:
        """Jobs idle longer than ``DISPATCH_CLAIM_MS``: their consumer died."""
        try:
            stale = client.xpending_range(self._stream, GROUP, min="-", max="+",
                                          count=self._batch_max, idle=self._claim_ms)  # fmt: skip
        except redis.ResponseError:
            return []  # no stream or no group yet
        jobs: list[Job] = []
        for entry in stale:
            entry_id = as_text(entry["message_id"])
            claimed = client.xclaim(self._stream, GROUP, consumer, self._claim_ms, [entry_id])
            if not claimed or claimed[0][1] is None:
                continue  # someone else claimed it first, or it was deleted
            deliveries = int(entry["times_delivered"]) + 1
            job = _decode(entry_id, claimed[0][1], deliveries)
            if job is None:
                continue
            metrics.DISPATCH_JOBS.labels(outcome="reclaimed").inc()
            log.warning("reclaimed job %s of %s (delivery %d)", entry_id,
                        as_text(entry["consumer"]), deliveries)  # fmt: skip
            if deliveries > self._max_deliveries:
                metrics.DISPATCH_JOBS.labels(outcome="abandoned").inc()
                self.fail(job, f"error:no engine survived this image ({deliveries - 1} deliveries)")
                self._finish(client, [job])
                continue
            jobs.append(job)
        return jobs

    def _run(self, client: Any, consumer: str, jobs: list[Job], serve: Serve) -> None:
        try:
            wanted = self._wanted(client, jobs)
        except _REDIS_ERRORS:  # unsure whether anyone waits: compute (reclaimed otherwise)
            wanted = [job for job in jobs if job.deadline > time.time()]
        stop = threading.Event()
        toucher = threading.Thread(
            target=self._touch, args=(consumer, [j.id for j in wanted], stop),
            name="dispatch-touch", daemon=True,
        )  # fmt: skip
        toucher.start()
        try:
            if wanted:
                serve(wanted)
        except Exception:  # serve reports per job; never let a feeder die
            log.exception("dispatch: serving %d jobs failed", len(wanted))
        finally:
            stop.set()
            toucher.join()
            try:
                self._finish(client, jobs)
            except _REDIS_ERRORS:
                pass  # the jobs stay pending and are reclaimed, then dropped as done

    def _wanted(self, client: Any, jobs: list[Job]) -> list[Job]:
        """Jobs someone may still wait for: before their deadline, and their marker (when
        it survives) still naming them."""
        now = time.time()
        pipe = client.pipeline(transaction=False)
        for job in jobs:
            pipe.get(self._queue.marker(job))
        markers = pipe.execute()
        wanted = []
        for job, marker in zip(jobs, markers, strict=True):
            if job.deadline > now and (marker is None or as_text(marker) == job.id):
                wanted.append(job)
            else:
                metrics.DISPATCH_JOBS.labels(outcome="caller_gone").inc()
                metrics.ENGINE_QUEUE_DROPPED.labels(reason="caller_gone").inc()
        return wanted

    def _touch(self, consumer: str, ids: list[str], stop: threading.Event) -> None:
        """While computing: keep the jobs ours (reset their idle time) and this engine live."""
        while ids and not stop.wait(self._claim_ms / 3000):

            def run(client: Any) -> Any:
                client.xclaim(self._stream, GROUP, consumer, 0, ids, justid=True)
                return client.eval(_HEARTBEAT, 2, self._engines, self._stream, consumer,
                                   self._claim_ms * 4, GROUP)  # fmt: skip

            self._store.run("dispatch", run)

    def _finish(self, client: Any, jobs: list[Job]) -> None:
        markers = [self._queue.marker(job) for job in jobs]
        client.eval(_FINISH, 1 + len(jobs), self._stream, *markers, GROUP,
                    *[job.id for job in jobs])  # fmt: skip

    def succeeded(self, job: Job) -> None:
        """The job's entry is stored: its waiters read it now."""
        self._store.publish(self._keys.done(job.key), f"ok:{job.id}")

    def fail(self, job: Job, marker: str) -> None:
        """Tell the requesters (marker key, then the done channel) that ``job`` failed:
        ``marker`` is ``kind:detail`` (error, timeout, busy:<seconds>, bug) or ``lost`` (no
        entry could be stored: they compute for themselves)."""
        channel = self._keys.done(job.key)
        if marker == "lost":
            self._store.publish(channel, f"lost:{job.id}")
            return
        # A consumer's timeout comes after its requester's own (which started earlier, at
        # submit), as does any failure past the deadline: no one is left to read a marker.
        if not marker.startswith("timeout:") and time.time() < job.deadline:
            self._store.run(
                "dispatch",
                lambda c: c.set(self._keys.job_error(job.key, job.id), marker, ex=ERROR_TTL_S),
            )
        self._store.publish(channel, f"error:{job.id}:{marker}")


# Every started set of feeders, so tests (and shutdown) can stop them all.
_live: set[Feeders] = set()


def stop_all() -> None:
    for feeders in list(_live):
        feeders.stop()


def _decode(entry_id: bytes | str, raw: dict[bytes, bytes], deliveries: int = 1) -> Job | None:
    try:
        return Job.from_fields(as_text(entry_id), raw, deliveries)
    except (KeyError, TypeError, ValueError):
        log.warning("dropping a malformed dispatch job %s", as_text(entry_id))
        return None


def _close(client: Any) -> None:
    if client is not None:
        try:
            client.close()
        except Exception:  # noqa: S110 - closing a broken client
            pass
