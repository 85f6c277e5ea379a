"""Global miss dispatch: no engine idles while a miss waits, in any worker of any replica.

The lease owner of a key (``election``) no longer computes itself: it submits a job to one
Redis stream per engine fingerprint (consumer group ``engines``) and waits for the entry's
done notification, as the election's other waiters do. Every process runs one feeder thread
per engine slot; a feeder reads (XREADGROUP) only when its engine is free, so the next miss
goes to whichever engine frees up first. It computes, writes the entry with the usual encode
+ SET + notification, then acks and deletes the job (XACK + XDEL).

- **Bounded**: a job is refused (``EngineBusy``: 503 + Retry-After, ``err_no``,
  RESOURCE_EXHAUSTED) when ``DISPATCH_QUEUE_MAX`` jobs per live engine are already waiting
  (one Lua script checks and adds). Live engines are the feeders that reported in the last
  ``DISPATCH_CLAIM_MS`` (a sorted set scored by Redis' own clock).
- **Callers gone**: a requester that gives up deletes its job if it has not started; a
  consumer drops a job whose deadline passed or whose lease another requester holds now
  (this one died or gave up, and a waiter re-elected and queued its own job).
- **Reclaim**: a consumer touches its jobs (XCLAIM JUSTID) every third of
  ``DISPATCH_CLAIM_MS`` while computing; a job idle longer (its consumer died) is claimed by
  another feeder, at most ``DISPATCH_MAX_DELIVERIES`` times (an image that kills engines is
  then failed, not retried forever).
- **Errors are never cached**: a failed job leaves a marker (``{key}:error:{token}``, 60 s)
  and says so on the done channel; the requester raises at once.
- **Redis down**: a submit that Redis does not answer, or no live engine, computes locally
  (each process falls back to its own engine); so does a requester whose polls fail.

Jobs carry the image bytes, the parameters, the tenant namespace, the entry key, the SHA-256
(the MD5-collision guard), the TTL and a wall-clock deadline; fields are plain strings and
JSON (nothing is unpickled).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from app import metrics
from app.cache.engine_runner import EngineBusy
from app.cache.keys import KeySpace
from app.cache.notify import Notifier
from app.cache.store import RedisStore
from app.vocabulary import EngineError, EngineTimeout, OcrCacheError, OcrParams, OcrResult

log = logging.getLogger(__name__)

GROUP = "engines"
BLOCK_MS = 1000  # a feeder's longest blocking read: how stale its heartbeat may get idle
ERROR_TTL_S = 60  # an error marker outlives any waiter that could still read it
UNHEALTHY_PAUSE_SECONDS = 5.0  # a failing engine takes at most one job per pause and slot
_REDIS_ERRORS = (redis.RedisError, OSError)

# Refuse when full, else add: {id, waiting, engines}; id "" when full, "none" without engines.
_SUBMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[3]))
local engines = redis.call('ZCARD', KEYS[2])
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1])
if not ok then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
  pending = {0}
end
local waiting = redis.call('XLEN', KEYS[1]) - pending[1]
if engines == 0 then return {'none', waiting, engines} end
if waiting >= tonumber(ARGV[2]) * engines then return {'', waiting, engines} end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 4))
return {id, waiting + 1, engines}
"""
# Delete a job that no consumer has read yet (1), else leave it (0): it runs or has run.
_CANCEL = """
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if ok and #p > 0 then return 0 end
return redis.call('XDEL', KEYS[1], ARGV[2])
"""
# Done with these jobs: acknowledged and deleted at once (one key: fine on a cluster too).
_FINISH = """
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
return redis.call('XDEL', KEYS[1], unpack(ARGV, 2))
"""
_HEARTBEAT = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[2], ARGV[3])
if not ok then return -1 end
return redis.call('XLEN', KEYS[2]) - pending[1]
"""


@dataclass(frozen=True)
class Job:
    """What an engine anywhere needs to compute one miss and store it under its key."""

    key: str
    sha256: str
    token: str  # the requester's lease token: the job is wanted while the lease is this
    params: OcrParams
    namespace: str
    ttl: int
    deadline: float  # wall clock (time.time()): hosts' clocks are assumed roughly in sync
    data: bytes = field(repr=False)
    archive: bool = True  # may go to the cold tier (not when the caller chose its own TTL)
    id: str = ""
    deliveries: int = 1

    def fields(self) -> list[str | bytes]:
        params = json.dumps(asdict(self.params), separators=(",", ":"))
        return ["key", self.key, "sha256", self.sha256, "token", self.token,
                "params", params, "ns", self.namespace, "ttl", str(self.ttl),
                "deadline", repr(self.deadline), "data", self.data,
                "archive", "1" if self.archive else "0"]  # fmt: skip

    @classmethod
    def from_fields(cls, job_id: str, raw: dict[bytes, bytes], deliveries: int = 1) -> Job:
        text = {k.decode(): v for k, v in raw.items()}
        params = json.loads(text["params"])
        params["task_args"] = tuple(tuple(pair) for pair in params.get("task_args", ()))
        return cls(
            key=text["key"].decode(), sha256=text["sha256"].decode(),
            token=text["token"].decode(), params=OcrParams(**params),
            namespace=text["ns"].decode(), ttl=int(text["ttl"]),
            deadline=float(text["deadline"]), data=text["data"], id=job_id,
            archive=text.get("archive", b"1") == b"1",
            deliveries=deliveries,
        )  # fmt: skip


class JobFailed(EngineError):
    """A consumer's engine failed on this job (raised in the requester)."""


class EngineCrashed(OcrCacheError):
    """A consumer's engine call ended in an unexpected exception (a bug, not an engine
    failure): the requester answers it as the last resort does (500, logged, counted)."""


def failure(marker: str) -> OcrCacheError:
    """The requester's exception for a consumer's marker ``kind:detail``."""
    kind, _, detail = marker.partition(":")
    if kind == "bug":
        return EngineCrashed(f"unexpected error in the engine: {detail}")
    if kind == "timeout":
        return EngineTimeout(detail or "OCR timed out")
    if kind == "busy":
        seconds, _, message = detail.partition(":")
        return EngineBusy(message or "the engine queue is full", max(1, int(seconds or 1)))
    return JobFailed(detail or "the engine failed")


class Dispatcher:
    """One per front door (per process): submits its misses, and feeds its engine."""

    def __init__(
        self,
        store: RedisStore,
        keys: KeySpace,
        notifier: Notifier,
        *,
        slots: int,
        per_engine_max: int,
        claim_ms: int,
        max_deliveries: int,
        batch_max: int,
        poll_seconds: float,
        mean_seconds: Callable[[], float],
        writer: str = "",
    ) -> None:
        self._store = store
        self._keys = keys
        self._notifier = notifier
        self._stream, self._engines = keys.dispatch(writer)
        self._slots = slots
        self._per_engine_max = per_engine_max
        self._claim_ms = claim_ms
        # An idle feeder reports in every BLOCK_MS, a busy one every third of claim_ms.
        self._live_ms = max(claim_ms, 3 * BLOCK_MS)
        self._max_deliveries = max_deliveries
        self._batch_max = batch_max
        self._poll_seconds = poll_seconds
        self._mean_seconds = mean_seconds
        self._stopped = threading.Event()
        self.reported = threading.Event()  # a feeder has reported in: jobs can be taken
        self._threads: list[threading.Thread] = []
        self._client_ids: dict[int, int] = {}
        self._name = f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        _live.add(self)

    # The requester's side -------------------------------------------------------------

    def request(
        self,
        job: Job,
        read: Callable[[], tuple[bool, OcrResult | None, str | None]],
        timeout: float,
    ) -> OcrResult | None:
        """Submit ``job`` and wait for its entry's result; None: compute it here instead
        (Redis down, no live engine, or the entry could not be stored). ``read`` answers
        (Redis ok, the entry's result, the job's error marker)."""
        channel = self._keys.done(job.key)
        event = self._notifier.register(channel)  # before submitting: no message is missed
        try:
            submitted = self._submit(job)
            if submitted is None:
                return None
            job_id, waiting, engines = submitted
            if not job_id:
                metrics.ENGINE_QUEUE_DROPPED.labels(reason="full").inc()
                retry = max(1, math.ceil(self._mean_seconds() * waiting / max(1, engines)))
                raise EngineBusy(
                    f"the engine queue is full ({waiting} waiting for {engines} engines); "
                    "retry later",
                    retry,
                )
            deadline = time.monotonic() + timeout
            seen = 0
            while True:
                for message in event.messages[seen:]:
                    if message == f"lost:{job.token}":
                        return None
                    if message.startswith(f"error:{job.token}:"):
                        self._forget(job)
                        raise failure(message.split(":", 2)[2])
                seen = len(event.messages)
                ok, result, error = read()
                if result is not None:
                    return result
                if error is not None:
                    self._forget(job)
                    raise failure(error)
                remaining = deadline - time.monotonic()
                if not ok or remaining <= 0:
                    cancelled = self._cancel(job_id)
                    if cancelled:
                        metrics.ENGINE_QUEUE_DROPPED.labels(reason="caller_gone").inc()
                    if not ok:  # Redis stopped answering: this process's own engine
                        return None
                    raise EngineTimeout(f"OCR took longer than OCR_TIMEOUT_SECONDS={timeout:g}")
                event.wait(min(remaining, self._poll_seconds))
                event.clear()
        finally:
            self._notifier.unregister(channel, event)

    def _submit(self, job: Job) -> tuple[str, int, int] | None:
        ttl = str(self._live_ms)

        def run(client: Any) -> Any:
            return client.eval(_SUBMIT, 2, self._stream, self._engines, GROUP,
                               self._per_engine_max, ttl, *job.fields())  # fmt: skip

        ok, answer = self._store.run("dispatch", run)
        if not ok:
            return None
        raw_id, waiting, engines = answer
        job_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
        metrics.DISPATCH_QUEUE_DEPTH.set(int(waiting))
        if job_id == "none":
            return None  # no engine reported in: this process computes (or waits to load)
        return job_id, int(waiting), int(engines)

    def _forget(self, job: Job) -> None:
        """The error reached its requester: its marker has served (nothing stays behind)."""
        self._store.run("dispatch", lambda c: c.delete(self._keys.job_error(job.key, job.token)))

    def _cancel(self, job_id: str) -> bool:
        ok, deleted = self._store.run(
            "dispatch", lambda c: c.eval(_CANCEL, 1, self._stream, GROUP, job_id)
        )
        return bool(ok and deleted)

    # The consumer's side --------------------------------------------------------------

    def start(
        self,
        wait_ready: Callable[[], None],
        serve: Callable[[Sequence[Job]], None],
        healthy: Callable[[], bool] = lambda: True,
    ) -> None:
        """One feeder per engine slot: ``wait_ready`` blocks until the engine is loaded;
        ``serve`` computes jobs and writes their entries (or error markers). While
        ``healthy()`` is False (its last call failed) a feeder takes one job per
        ``UNHEALTHY_PAUSE_SECONDS``: a broken engine must not drain the fleet's queue into
        errors, yet it still probes, so it can recover."""
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
        self,
        slot: int,
        wait_ready: Callable[[], None],
        serve: Callable[[Sequence[Job]], None],
        healthy: Callable[[], bool],
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
                self._heartbeat(client, consumer)
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
            self._create_group(client)
            return []
        jobs, malformed = [], []
        for _, entries in answer or ():
            for entry_id, raw in entries:
                job = _decode(entry_id, raw)
                if job is None:
                    malformed.append(Job("", "", "", OcrParams(), "", 0, 0.0, b"", _text(entry_id)))
                else:
                    jobs.append(job)
        if malformed:
            self._finish(client, malformed)
        return jobs

    def _create_group(self, client: Any) -> None:
        try:
            client.xgroup_create(self._stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _reclaim(self, client: Any, consumer: str) -> list[Job]:
        """Jobs idle longer than ``DISPATCH_CLAIM_MS``: their consumer died."""
        try:
            stale = client.xpending_range(self._stream, GROUP, min="-", max="+",
                                          count=self._batch_max, idle=self._claim_ms)  # fmt: skip
        except redis.ResponseError:
            return []  # no stream or no group yet
        jobs: list[Job] = []
        for entry in stale:
            entry_id = _text(entry["message_id"])
            claimed = client.xclaim(self._stream, GROUP, consumer, self._claim_ms, [entry_id])
            if not claimed or claimed[0][1] is None:
                continue  # someone else claimed it first, or it was deleted
            deliveries = int(entry["times_delivered"]) + 1
            job = _decode(entry_id, claimed[0][1], deliveries)
            if job is None:
                continue
            metrics.DISPATCH_JOBS.labels(outcome="reclaimed").inc()
            log.warning("reclaimed job %s of %s (delivery %d)", entry_id,
                        _text(entry["consumer"]), deliveries)  # fmt: skip
            if deliveries > self._max_deliveries:
                metrics.DISPATCH_JOBS.labels(outcome="abandoned").inc()
                self.fail(job, "error:no engine survived this image "
                               f"({deliveries - 1} deliveries)")  # fmt: skip
                self._finish(client, [job])
                continue
            jobs.append(job)
        return jobs

    def _run(
        self, client: Any, consumer: str, jobs: list[Job], serve: Callable[[Sequence[Job]], None]
    ) -> None:
        wanted = self._wanted(client, jobs)
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
        """Jobs someone may still wait for: before their deadline, and their key's lease not
        taken by another requester (that one re-elected after this one died or gave up, and
        queued its own job). A lease that merely expired (its owner starved on a loaded host)
        keeps the job: its requester may still be waiting."""
        now = time.time()
        pipe = client.pipeline(transaction=False)
        for job in jobs:
            pipe.get(self._keys.lease(job.key))
        leases = pipe.execute()
        wanted = []
        for job, lease in zip(jobs, leases, strict=True):
            if job.deadline > now and (lease is None or _text(lease) == job.token):
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
        client.eval(_FINISH, 1, self._stream, GROUP, *[job.id for job in jobs])

    def fail(self, job: Job, marker: str) -> None:
        """Tell the requester (marker key, then the done channel) that ``job`` failed:
        ``marker`` is ``kind:detail`` (error, timeout, busy:<seconds>) or ``lost``."""
        if marker == "lost":
            self._store.publish(self._keys.done(job.key), f"lost:{job.token}")
            return
        # A consumer's timeout comes after its requester's own (which started earlier, at
        # submit), as does any failure past the deadline: no one is left to read a marker.
        if marker.startswith("timeout:") or time.time() >= job.deadline:
            self._store.publish(self._keys.done(job.key), f"error:{job.token}:{marker}")
            return
        self._store.run(
            "dispatch",
            lambda c: c.set(self._keys.job_error(job.key, job.token), marker, ex=ERROR_TTL_S),
        )
        self._store.publish(self._keys.done(job.key), f"error:{job.token}:{marker}")


# Every started dispatcher, so tests (and shutdown) can stop them all.
_live: set[Dispatcher] = set()


def stop_all() -> None:
    for dispatcher in list(_live):
        dispatcher.stop()


def _decode(entry_id: bytes | str, raw: dict[bytes, bytes], deliveries: int = 1) -> Job | None:
    try:
        return Job.from_fields(_text(entry_id), raw, deliveries)
    except (KeyError, TypeError, ValueError):
        log.warning("dropping a malformed dispatch job %s", _text(entry_id))
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _close(client: Any) -> None:
    if client is not None:
        try:
            client.close()
        except Exception:  # noqa: S110 - closing a broken client
            pass
