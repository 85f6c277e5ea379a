"""Document jobs in Redis: the job's record, its document, its finished pages, the stream of
jobs the engines' drivers take, and each tenant's open jobs.

Every key of one job shares the hash tag of its id (``{prefix}:job:{<id>}``, ``...:doc``,
``...:pages``), so on a Redis Cluster a job lives on one node; all of them expire
``JOBS_TTL_SECONDS`` after the job's last change. They lie outside the cache's root
(``{prefix}:v<schema>:``), so no purge reaches them. A page's answer is copied into the job
(its canonical result, a few KB), not pointed at: a job stays readable after its pages'
cache entries were evicted. Under ``allkeys-lru`` a job's keys may be evicted like any
other: a job without its record answers 404, a job whose document was evicted before its
driver read it ends ``failed`` saying so.

Jobs are stored through a client of their own with generous timeouts (a document is up to
``JOBS_MAX_BYTES``), not the cache's 50 ms one; Redis down is ``JobsUnavailable`` (503).
"""

from __future__ import annotations

import contextlib
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, BinaryIO

import orjson

from app.cache import redis_client
from app.cache.scripts import JOB_PAGE, JOB_TRANSITION, QUOTA_SLOTS
from app.vocabulary import EngineBusy

GROUP = "drivers"  # the consumer group of the jobs stream
SETTLE_SECONDS = 60  # an open-job place younger than this is never taken for an evicted one
CHUNK = 1 << 20  # a document is written to Redis this much at a time
ID = re.compile(r"job_[A-Za-z0-9_-]{22}")
STATES = ("queued", "running", "succeeded", "failed", "cancelled")
ENDED = frozenset({"succeeded", "failed", "cancelled"})


class JobsUnavailable(EngineBusy):
    """Redis, where jobs live, cannot be reached: nothing was accepted or changed."""

    code = "jobs_unavailable"

    def __init__(self, why: str) -> None:
        super().__init__(f"document jobs are unavailable: {why}", retry_after=5)


@dataclass(frozen=True)
class Job:
    """A job's record (everything but its document and pages). Times are Unix seconds."""

    id: str
    tenant: str  # the namespace its pages are keyed in ("" the default)
    kind: str  # "pdf" or "image"
    pages: tuple[int, ...]  # the document's page indexes to read (0-based), in order
    params: dict[str, Any]  # OcrParams.to_dict()
    options: dict[str, Any] = field(default_factory=dict)  # min_score, PaddleX's options
    status: str = "queued"
    done: int = 0
    failed: int = 0
    created: float = 0.0
    started: float = 0.0
    finished: float = 0.0
    error: str = ""
    callback_url: str = ""
    batch: str = ""  # PaddleOCR's batchId
    model: str = ""
    result_token: str = ""  # the secret part of the PaddleOCR result URL

    @property
    def total(self) -> int:
        return len(self.pages)

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    def record(self) -> dict[str, bytes]:
        return {"job": orjson.dumps(asdict(self) | {"pages": list(self.pages)})}

    @classmethod
    def from_record(cls, raw: dict[bytes, bytes]) -> Job | None:
        """The job, with its counters and state from their own fields; None if malformed."""
        try:
            data = orjson.loads(raw[b"job"])
            data["pages"] = tuple(int(p) for p in data["pages"])
            job = cls(**data)
            changes: dict[str, Any] = {}
            for name in ("done", "failed"):
                if name.encode() in raw:
                    changes[name] = int(raw[name.encode()])
            for name in ("status", "error"):
                if name.encode() in raw:
                    changes[name] = raw[name.encode()].decode()
            for name in ("started", "finished"):
                if name.encode() in raw:
                    changes[name] = float(raw[name.encode()])
            return replace(job, **changes)
        except (KeyError, TypeError, ValueError, orjson.JSONDecodeError):
            return None


def new_id() -> str:
    return "job_" + secrets.token_urlsafe(16)[:22].ljust(22, "A")


class JobStore:
    """The jobs of one deployment (``prefix``: ``CACHE_KEY_PREFIX``)."""

    def __init__(self, url: str, prefix: str, ttl_seconds: int, **options: Any) -> None:
        self._url, self._options = url, options
        self._prefix = prefix
        self.ttl = ttl_seconds
        self._client: Any = None
        self.stream = f"{prefix}:jobs:queue"

    # Keys ------------------------------------------------------------------------------

    def _key(self, job_id: str, part: str = "") -> str:
        return f"{self._prefix}:job:{{{job_id}}}" + (f":{part}" if part else "")

    def _open(self, tenant: str) -> str:
        return f"{self._prefix}:jobs:open:{{{tenant or '~'}}}"

    def _batch(self, tenant: str, batch: str) -> str:
        return f"{self._prefix}:jobs:batch:{{{tenant or '~'}}}:{batch}"

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = redis_client.connect(self._url, 30.0, 5.0, **self._options)
        return self._client

    def _do(self, fn: Any) -> Any:
        try:
            return fn(self.client)
        except redis_client.ERRORS as exc:
            raise JobsUnavailable(exc.__class__.__name__) from None

    # The fronts' side ------------------------------------------------------------------

    def reserve(self, job: Job, limit: int) -> bool:
        """A place among its tenant's open jobs for ``job``, unless ``limit`` are taken: the
        count and the place in one step (``QUOTA_SLOTS``, the in-flight quota's script), so
        two fronts' concurrent submissions never both take the last place. A place lasts the
        job's TTL at most (a job whose record expired counts no more); when they are all
        taken, those whose record is gone (evicted under ``allkeys-lru``) are given back
        first, so eviction never holds a tenant's places for the TTL."""
        keys, args = [self._open(job.tenant)], [str(limit), str(self.ttl * 1000), job.id]
        if self._do(lambda c: QUOTA_SLOTS(c, keys, args)):
            return True
        return self._prune_open(job.tenant) and bool(self._do(lambda c: QUOTA_SLOTS(c, keys, args)))

    def _prune_open(self, tenant: str) -> bool:
        """Give back the places of jobs whose record is gone; whether there were any (each
        record is read apart: it lies under its own hash tag). Only places older than
        ``SETTLE_SECONDS``: a newer one may belong to a job still being stored, whose record
        is not written yet. A place is scored by when it expires, a TTL after it was taken."""
        settled = (time.time() - SETTLE_SECONDS + self.ttl) * 1000

        def run(client: Any) -> bool:
            places = client.zrangebyscore(self._open(tenant), "-inf", settled)
            held = [_text(raw) for raw in places]
            gone = [job_id for job_id in held if not client.exists(self._key(job_id))]
            if gone:
                client.zrem(self._open(tenant), *gone)
            return bool(gone)

        return bool(self._do(run))

    def leave_open(self, job: Job) -> None:
        """Give back the job's place among its tenant's open jobs (it ended, or never was)."""
        self._do(lambda c: c.zrem(self._open(job.tenant), job.id))

    def create(self, job: Job, document: BinaryIO) -> Job:
        """Store the job and its document (read from the file in chunks: a front holds one
        chunk of it at a time), then announce it to the drivers."""
        job = replace(job, created=time.time(), result_token=secrets.token_urlsafe(24))

        def run(client: Any) -> None:
            key, ttl, doc = self._key(job.id), self.ttl, self._key(job.id, "doc")
            document.seek(0)
            client.set(doc, document.read(CHUNK), ex=ttl)
            while chunk := document.read(CHUNK):
                client.append(doc, chunk)
            client.hset(key, mapping=job.record())
            client.expire(key, ttl)
            if job.batch:
                client.sadd(self._batch(job.tenant, job.batch), job.id)
                client.expire(self._batch(job.tenant, job.batch), ttl)
            client.xadd(self.stream, {"id": job.id})

        try:
            self._do(run)
        except JobsUnavailable:
            with contextlib.suppress(JobsUnavailable):
                self.leave_open(job)
            raise
        return job

    def get(self, job_id: str) -> Job | None:
        if not ID.fullmatch(job_id):
            return None
        raw = self._do(lambda c: c.hgetall(self._key(job_id)))
        return Job.from_record(raw) if raw else None

    def batch(self, tenant: str, batch: str) -> list[Job]:
        ids = self._do(lambda c: c.smembers(self._batch(tenant, batch)))
        jobs = [self.get(raw.decode()) for raw in sorted(ids)]
        return [job for job in jobs if job is not None]

    def pages(self, job_id: str, numbers: Sequence[int] | None = None) -> dict[int, dict[str, Any]]:
        """Finished pages by number (1-based): each page's answer or its error."""
        key = self._key(job_id, "pages")
        if numbers is None:
            raw = self._do(lambda c: c.hgetall(key))
        else:
            values = self._do(lambda c: c.hmget(key, [str(n) for n in numbers]))
            raw = {str(n).encode(): v for n, v in zip(numbers, values, strict=True) if v}
        out = {}
        for name, value in raw.items():
            try:
                out[int(name)] = orjson.loads(value)
            except (ValueError, orjson.JSONDecodeError):
                continue
        return dict(sorted(out.items()))

    def cancel(self, job: Job) -> str:
        """Cancel the job unless it ended (its driver stops at its next page, its waiting
        pages' tickets withdrawn); the status it has now (cancelled, or how it ended)."""
        return self._transition(job, "cancelled", "", ("queued", "running"))

    def _transition(self, job: Job, status: str, error: str, leaving: tuple[str, ...]) -> str:
        """``JOB_TRANSITION``: the status after; an ended job leaves its tenant's open jobs."""
        keys = [self._key(job.id), self._key(job.id, "doc")]
        args = [status, repr(time.time()), error, *leaving]
        now = _text(self._do(lambda c: JOB_TRANSITION(c, keys, args)))
        if now in ENDED:
            self.leave_open(job)
        return now

    # The drivers' side -----------------------------------------------------------------

    def document(self, job_id: str) -> bytes | None:
        return self._do(lambda c: c.get(self._key(job_id, "doc")))

    def status(self, job_id: str) -> str | None:
        """The job's status now (None: its record is gone)."""
        raw = self._do(lambda c: c.hget(self._key(job_id), "status"))
        if raw is not None:
            return str(raw.decode())
        exists = self._do(lambda c: c.exists(self._key(job_id)))
        return "queued" if exists else None

    def start(self, job: Job) -> str:
        """The job runs (unless it was cancelled meanwhile): its status after."""
        return self._transition(job, "running", "", ("queued", "running"))

    def record_page(self, job: Job, number: int, answer: dict[str, Any], failed: bool) -> None:
        """A finished page (its place in the job, 1-based): its answer and the job's progress,
        in one step (``JOB_PAGE``)."""
        keys = [self._key(job.id, "pages"), self._key(job.id), self._key(job.id, "doc")]
        args: list[str | bytes | int] = [
            str(number), orjson.dumps(answer), "failed" if failed else "done", self.ttl,
        ]  # fmt: skip
        self._do(lambda c: JOB_PAGE(c, keys, args))

    def finish(self, job: Job, status: str, error: str = "") -> str:
        """The job's end (unless it was cancelled meanwhile): its status after."""
        return self._transition(job, status, error, ("queued", "running"))

    def claim_callback(self, job: Job) -> bool:
        """Whether this caller is the one to send the job's end (once per job, whichever
        driver ends it or finds it ended)."""

        def run(client: Any) -> bool:
            key = self._key(job.id)
            if not client.exists(key):  # expired or evicted: not written again (no TTL)
                return False
            claimed = bool(client.hsetnx(key, "callback", "1"))
            client.expire(key, self.ttl)
            return claimed

        return bool(self._do(run))

    def drop_document(self, job: Job) -> None:
        self._do(lambda c: c.delete(self._key(job.id, "doc")))

    def ensure_group(self) -> None:
        def run(client: Any) -> None:
            try:
                client.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
            except redis_client.ERRORS as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

        self._do(run)

    def take(
        self, consumer: str, idle_ms: int, block_ms: int, *, takeover: bool = True
    ) -> tuple[str, str, int] | None:
        """(stream entry, job id, how many times it was taken): with ``takeover``, the oldest
        job whose driver has not reported for ``idle_ms`` first (taken over), else a new one,
        waiting up to ``block_ms``."""

        def run(client: Any) -> tuple[Any, int] | None:
            idle = takeover and client.xpending_range(self.stream, GROUP, "-", "+", 1, idle=idle_ms)
            if idle:
                taken = client.xclaim(
                    self.stream, GROUP, consumer, idle_ms, [idle[0]["message_id"]]
                )
                if taken:
                    return taken[0], int(idle[0]["times_delivered"]) + 1
            got = client.xreadgroup(GROUP, consumer, {self.stream: ">"}, count=1, block=block_ms)
            return (got[0][1][0], 1) if got and got[0][1] else None

        found = self._do(run)
        if found is None:
            return None
        (entry_id, fields), deliveries = found
        if not fields:  # deleted meanwhile
            self.done(entry_id)
            return None
        return _text(entry_id), _text(fields.get(b"id", b"")), deliveries

    def keep(self, entry: str, consumer: str) -> bool:
        """Still driving this job: its entry's idle time starts again (no takeover). False:
        another driver took it over meanwhile (this one was silent too long), and keeps it."""

        def run(client: Any) -> bool:
            held = client.xpending_range(self.stream, GROUP, entry, entry, 1)
            if not held or _text(held[0]["consumer"]) != consumer:
                return False
            client.xclaim(self.stream, GROUP, consumer, 0, [entry], justid=True)
            return True

        return bool(self._do(run))

    def release(self, entry: str, consumer: str, idle_ms: int) -> None:
        """Stop driving this job now (the process stops): its entry reads as idle for
        ``idle_ms``, so the next driver takes it over at once rather than after a wait."""
        self._do(
            lambda c: c.xclaim(self.stream, GROUP, consumer, 0, [entry], idle=idle_ms, justid=True)
        )

    def backlog(self) -> int:
        """Jobs waiting for a driver or held by one (a dead driver's too, until taken over):
        the stream's entries, each deleted when its job ends."""
        return int(self._do(lambda c: c.xlen(self.stream)) or 0)

    def done(self, entry: str | bytes) -> None:
        def run(client: Any) -> None:
            client.xack(self.stream, GROUP, entry)
            client.xdel(self.stream, entry)

        self._do(run)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
