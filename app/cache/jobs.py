"""The global miss queue, the requester's side: one queue per engine fingerprint (and
sealing key) that every free engine of every worker and replica pulls from
(``feeders.py``), so no engine idles while a miss waits anywhere. Each tenant's jobs wait in
a lane of their own (a Redis stream); engines take from the lanes by deficit round robin
over engine time (``feeders.py``), so one tenant's back-fill cannot hold another's single
miss behind it.

Submitting is idempotent per key: a job already queued or running for the same entry key (a
marker beside the stream names it) makes the caller a waiter on it, so one image is computed
once across processes and replicas, without a lease. A waiter blocks on the entry's done
notification (``notify.py``) and checks on its job between notifications: an entry that
appears is its answer; an error marker is its error; a job that vanished (finished without an
entry, dropped, or taken by the LRU with the stream or its marker) is submitted again; a job
whose lane the LRU took from the ring is put back by that check. Every key here may be
evicted under ``allkeys-lru``: that costs a resubmission or one local engine call, never a
wait to the deadline.

- **Bounded per lane**: a new job is refused (``EngineBusy``) when ``DISPATCH_QUEUE_MAX``
  jobs per live engine are already waiting in its tenant's lane (a tenant's flood fills only
  its own); live engines are the feeders that reported lately.
- **Deadlines**: a waiter stops at its own (``OCR_TIMEOUT_SECONDS``); the job's creator then
  deletes it if no engine has started it.
- **Redis down**, or no live engine: the caller computes with its own engine (``None``).

Jobs carry the image bytes, the parameters, the tenant namespace, the entry key, the SHA-256,
the TTL and a wall-clock deadline; fields are plain strings and JSON (nothing is unpickled).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from app import metrics
from app.cache.keys import KeySpace
from app.cache.notify import Notifier
from app.cache.scripts import QUEUE_ALIVE, QUEUE_CANCEL, QUEUE_SUBMIT
from app.cache.store import RedisStore
from app.vocabulary import (
    EngineBusy,
    EngineError,
    EngineTimeout,
    OcrCacheError,
    OcrParams,
    OcrResult,
)

GROUP = "engines"
# An error marker outlives any waiter that could still read it: each of a failed job's
# waiters finds it, whether or not the announcement on the done channel reached it first
# (each job's marker is its own: a later request of the image queues a new job).
ERROR_TTL_S = 60
DEFAULT_LANE = "~"  # the default tenant's lane (not a tenant name), and every job's in FIFO

# The scripts (app/cache/scripts/): queue_submit.lua, queue_alive.lua, queue_cancel.lua.


@dataclass(frozen=True)
class Job:
    """What an engine anywhere needs to compute one miss and store it under its key."""

    key: str
    sha256: str
    params: OcrParams
    namespace: str
    ttl: int
    deadline: float  # wall clock (time.time()): hosts' clocks are assumed roughly in sync
    data: bytes = field(repr=False)
    archive: bool = True  # may go to the cold tier (not when the caller chose its own TTL)
    id: str = ""
    deliveries: int = 1
    lane: str = DEFAULT_LANE  # the lane it was read from (the feeders' side)

    def fields(self) -> list[str | bytes]:
        params = json.dumps(asdict(self.params), separators=(",", ":"))
        return ["key", self.key, "sha256", self.sha256, "params", params,
                "ns", self.namespace, "ttl", str(self.ttl), "deadline", repr(self.deadline),
                "data", self.data, "archive", "1" if self.archive else "0"]  # fmt: skip

    @classmethod
    def from_fields(
        cls, job_id: str, raw: dict[bytes, bytes], deliveries: int = 1, lane: str = DEFAULT_LANE
    ) -> Job:
        text = {k.decode(): v for k, v in raw.items()}
        params = json.loads(text["params"])
        params["task_args"] = tuple(tuple(pair) for pair in params.get("task_args", ()))
        return cls(
            key=text["key"].decode(), sha256=text["sha256"].decode(),
            params=OcrParams(**params), namespace=text["ns"].decode(), ttl=int(text["ttl"]),
            deadline=float(text["deadline"]), data=text["data"], id=job_id,
            archive=text.get("archive", b"1") == b"1", deliveries=deliveries, lane=lane,
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


Read = Callable[[str], tuple[bool, OcrResult | None, str | None]]


class JobQueue:
    """One per front door (per process): submits its misses and waits for their entries.
    ``fair``: each tenant's jobs in a lane of their own (``DISPATCH_FAIRNESS=drr``), else
    every job in the default lane (arrival order); ``share(namespace)``: a tenant's share,
    ``label(namespace)`` its metrics label."""

    def __init__(
        self,
        store: RedisStore,
        keys: KeySpace,
        notifier: Notifier,
        *,
        per_engine_max: int,
        live_ms: int,
        poll_seconds: float,
        mean_seconds: Callable[[], float],
        writer: str = "",
        fair: bool = True,
        share: Callable[[str], float] = lambda namespace: 1.0,
        label: Callable[[str], str] = lambda namespace: namespace or "default",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._keys = keys
        self._notifier = notifier
        self.names = keys.dispatch(writer)
        self._per_engine_max = per_engine_max
        self.live_ms = live_ms  # an engine that reported this lately is live
        self._poll_seconds = poll_seconds
        self._mean_seconds = mean_seconds
        self._fair = fair
        self._share = share
        self._label = label
        self._clock = clock

    def lane(self, namespace: str) -> str:
        """The lane of a tenant's jobs."""
        return namespace if self._fair and namespace else DEFAULT_LANE

    def stream(self, job: Job) -> str:
        return self.names.stream(self.lane(job.namespace))

    def marker(self, job: Job) -> str:
        return self.names.marker(job.key, job.sha256)

    def request(self, job: Job, read: Read, timeout: float) -> tuple[OcrResult | None, bool]:
        """(``job``'s result once an engine stored it, whether it joined a job another
        request had queued); None: compute it here instead (Redis down, no live engine, or
        the job ended without an entry to read). ``read(job id)`` answers (Redis ok, the
        entry's result, the job's error marker)."""
        channel = self._keys.done(job.key)
        event = self._notifier.register(channel)  # before submitting: no message is missed
        deadline = self._clock() + timeout
        try:
            while True:
                submitted = self._submit(job, deadline)
                if submitted is None:
                    return None, False
                job_id, created = submitted
                again, result, joined = self._wait(job, job_id, created, event, read, deadline)
                if not again:
                    return result, joined
        finally:
            self._notifier.unregister(channel, event)

    def _submit(self, job: Job, deadline: float) -> tuple[str, bool] | None:
        """(job id, created by us), or None: no queue to use."""
        marker_ttl = str(max(1000, int((deadline - self._clock()) * 1000)))

        lane, names = self.lane(job.namespace), self.names
        share = f"{self._share(job.namespace):g}"

        def run(client: Any) -> Any:
            keys = (names.stream(lane), names.engines, self.marker(job), names.ring,
                    names.lanes, names.shares, names.bell, names.interject_bell,
                    names.stream_prefix)  # fmt: skip
            limits = (self._per_engine_max, self.live_ms, marker_ttl, lane, share)
            return QUEUE_SUBMIT(client, keys, [GROUP, *limits, *job.fields()])

        ok, answer = self._store.run("dispatch", run)
        if not ok:
            return None
        raw_id, waiting, engines = answer[:3]
        if len(answer) > 3:
            metrics.DISPATCH_QUEUE_DEPTH.set(int(answer[3]))
        job_id = as_text(raw_id)
        if job_id == "none":
            return None  # no engine reported in: this process computes (or waits to load)
        if not job_id:
            metrics.ENGINE_QUEUE_DROPPED.labels(reason="full").inc()
            metrics.TENANT_REJECTIONS.labels(
                tenant=self._label(job.namespace), reason="queue_full"
            ).inc()
            retry = max(1, math.ceil(self._mean_seconds() * int(waiting) / max(1, int(engines))))
            whose = "the engine queue" if lane == DEFAULT_LANE else f"tenant {lane!r}'s lane"
            raise EngineBusy(
                f"{whose} is full ({waiting} waiting for {engines} engines); retry later", retry
            )
        return job_id, int(waiting) >= 0

    def _wait(
        self, job: Job, job_id: str, created: bool, event: Any, read: Read, deadline: float
    ) -> tuple[bool, OcrResult | None, bool]:
        """(submit again, the result, whether another job computed it); a result None:
        compute here."""
        seen = 0
        while True:
            messages = event.messages[seen:]  # one snapshot: nothing appended is skipped
            seen += len(messages)
            for message in messages:
                if message == f"lost:{job_id}":
                    return False, None, False
                if message.startswith(f"error:{job_id}:"):
                    if self._outlives(message.split(":", 2)[2], created, deadline):
                        return True, None, False
                    raise failure(message.split(":", 2)[2])
            finished = f"ok:{job_id}" in messages
            ok, result, error = read(job_id)
            if result is not None:
                # Ours, or another job's stored meanwhile: then ours is withdrawn unstarted.
                return False, result, not created or self._give_up(job_id, job, created, "")
            if error is not None:
                if self._outlives(error, created, deadline):
                    return True, None, False
                raise failure(error)
            if not ok:  # Redis stopped answering: this process's own engine
                self._give_up(job_id, job, created)
                return False, None, False
            if finished:  # done, and its entry is already gone (evicted): one call here
                return False, None, False
            remaining = deadline - self._clock()
            if remaining <= 0:
                self._give_up(job_id, job, created)
                raise EngineTimeout(f"OCR took longer than OCR_TIMEOUT_SECONDS ({job_id})")
            if not self._alive(job_id, job):
                # Finished since the read (its entry is stored before it leaves the queue, a
                # failure's marker too), or dropped, or its marker or stream evicted: then
                # submit again.
                ok, result, error = read(job_id)
                if result is not None:
                    return False, result, not created or self._give_up(job_id, job, created, "")
                if error is not None and not self._outlives(error, created, deadline):
                    raise failure(error)
                return True, None, False
            event.wait(min(remaining, self._poll_seconds))
            event.clear()

    def _outlives(self, error: str, created: bool, deadline: float) -> bool:
        """A joined job ran out of its creator's time (the job's deadline), not ours: this
        waiter submits again rather than fail before its own deadline."""
        return not created and error.startswith("timeout:") and self._clock() < deadline

    def _alive(self, job_id: str, job: Job) -> bool:
        lane, names = self.lane(job.namespace), self.names
        keys = (names.stream(lane), self.marker(job), names.ring, names.lanes)
        ok, alive = self._store.run("dispatch", lambda c: QUEUE_ALIVE(c, keys, [job_id, lane]))
        return not ok or bool(alive)  # Redis unsure: the next read tells

    def _give_up(self, job_id: str, job: Job, created: bool, reason: str = "caller_gone") -> bool:
        """Stop waiting: a job this caller created is deleted if no engine started it
        (whether it was; counted as dropped for ``reason``)."""
        if not created:
            return False
        ok, deleted = self._store.run(
            "dispatch",
            lambda c: QUEUE_CANCEL(c, [self.stream(job), self.marker(job)], [GROUP, job_id]),
        )
        if ok and deleted and reason:
            metrics.ENGINE_QUEUE_DROPPED.labels(reason=reason).inc()
        return bool(ok and deleted)


def as_text(value: bytes | str) -> str:
    """A Redis reply (bytes, or str from a decoding client) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
