"""The global miss queue, the engines' side: one feeder thread per engine slot takes the next
job only when its engine is free, so a miss goes to whichever engine of any worker or
replica frees up first (``jobs.py`` is the requester's side).

- **Which job next: deficit round robin over engine time**, across the tenants' lanes, in
  one script (``queue_take.lua``) so every worker and replica shares one schedule. The ring
  holds the lanes with waiting jobs (a lane that becomes active joins at its head, with one
  quantum times its share of credit); the lane with the most credit left (a deficit above 0;
  ties: ring order) is served, each job charged its lane's mean engine time (learnt from the
  lane's finished jobs), and goes to the ring's tail once its credit is spent. When no lane
  has credit, each gets as many rounds of a quantum (the cheapest lane's job) times its
  tenant's ``share`` as it takes for one to have some, in one step. A finished job corrects
  its lane's deficit to the engine time it really took. A lane with nothing waiting leaves
  the ring and forgets its deficit (no banked credit, no debt). So a tenant that floods gets
  the engines only while nobody else waits, and a tenant that sends one page is served by
  the next engine that frees up. Work-conserving: whoever waits is served. With
  ``DISPATCH_FAIRNESS=fifo`` there is one lane.
- **Interjection** (``DISPATCH_INTERJECT``, an engine that can pause its call: the
  in-process one, between recognition batches): no order of the queue shortens the wait for
  an engine to *finish* a page, and a back-fill's long pages keep every engine for seconds.
  So while its engine computes, each slot's interjector waits on a second doorbell for the
  job the round robin would take next; when that job's tenant has nothing running (but the
  very call it would pause, while other tenants hold the other engines: its short page need
  not wait for its own long one, and takes no engine time from anyone else; a tenant alone
  keeps its own order) and every live engine is busy, it takes the job and the
  engine runs it at the next pause of its page, which then resumes
  (``app/engines/engine_thread.py``). Another goes into the same call only once that call
  has run on its own at least as long as it was paused for the ones before, so a paused
  page keeps at least half its engine and always ends; none goes into a call whose
  requesters' time is nearly up; a tenant with a job running elsewhere waits its turn as
  before, so a flood gains nothing; an idle engine anywhere takes the job instead.
  Each call is charged its own engine time.
- An idle feeder waits on the queue's doorbell (``BLPOP``), rung by every submission, and
  looks again at least every ``BLOCK_MS``.
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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import redis

from app import metrics
from app.cache.jobs import DEFAULT_LANE, ERROR_TTL_S, GROUP, Job, JobQueue, as_text
from app.cache.keys import KeySpace
from app.cache.scripts import (
    QUEUE_FINISH,
    QUEUE_HEARTBEAT,
    QUEUE_RELEASE,
    QUEUE_STALE,
    QUEUE_TAKE,
)
from app.cache.store import REDIS_ERRORS, RedisStore
from app.vocabulary import EngineError, OcrParams

log = logging.getLogger(__name__)

BLOCK_MS = 1000  # a feeder's longest wait for the doorbell: how stale its report may get idle
UNHEALTHY_PAUSE_SECONDS = 5.0

# The scripts (app/cache/scripts/): queue_heartbeat.lua, queue_take.lua (the round robin),
# queue_stale.lua, queue_finish.lua, queue_release.lua.

# Computes jobs and stores them (all of it inside the engine's call in progress when told
# so: interjected); answers the engine seconds each job's call took (by id).
Serve = Callable[[Sequence[Job], bool], Mapping[str, float]]


class _Call(NamedTuple):
    """The call a slot's engine runs: what its interjector decides by."""

    number: int  # this process's count of calls begun (0: none running)
    deadline: float  # when its first requester stops waiting (wall clock)
    began: float  # when it began (monotonic)
    lane: str  # the lane of its jobs ("": several)


_NO_CALL = _Call(0, 0.0, 0.0, "")


class Feeders:
    """This process's engine slots, feeding on the queue of ``queue``. ``mean_seconds``: an
    engine call's mean here (the round robin's quantum and a job's cost when taken);
    ``label``: a tenant's metrics label (``labels``: all of them now); ``hold_seconds``:
    when one tenant's hold on the queue is alerted on (``TENANT_QUEUE_HOLD_SECONDS``);
    ``interjecting``: the engine can run a job inside the call in progress (``interject``),
    so each slot also has an interjector (the module's docstring)."""

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
        mean_seconds: Callable[[], float] = lambda: 1.0,
        label: Callable[[str], str] = lambda namespace: namespace or "default",
        labels: Callable[[], list[str]] = lambda: ["default"],
        hold_seconds: float = 300.0,
        interjecting: bool = False,
    ) -> None:
        self._store = store
        self._keys = keys
        self._queue = queue
        self._names = queue.names
        self._slots = slots
        self._claim_ms = claim_ms
        self._max_deliveries = max_deliveries
        self._batch_max = batch_max
        self._mean_seconds = mean_seconds
        self._label = label
        self._labels = labels  # every tenant label there is now: each reported, 0 or not
        self._stopped = threading.Event()
        self.reported = threading.Event()  # a feeder has reported in: jobs can be taken
        self._threads: list[threading.Thread] = []
        self._client_ids: dict[int, int] = {}
        self._name = f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self._holds: dict[str, float] = {}  # tenant label -> since when it holds the queue
        self._hold_labels: set[str] = set()
        self._interjecting = interjecting
        self._computing = threading.Condition()
        self._running = [_NO_CALL] * slots  # the call each slot's engine runs now
        self._calls = 0
        metrics.TENANT_QUEUE_HOLD_LIMIT.set(hold_seconds)
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
            if self._interjecting:
                thread = threading.Thread(
                    target=self._interject, args=(slot, serve, healthy),
                    name=f"dispatch-interject-{slot}", daemon=True,
                )  # fmt: skip
                thread.start()
                self._threads.append(thread)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop reading new jobs (jobs being computed finish); wakes blocked reads."""
        self._stopped.set()
        with self._computing:
            self._computing.notify_all()
        for client_id in list(self._client_ids.values()):
            self._store.run("dispatch", lambda c, i=client_id: c.client_unblock(i))
        for thread in self._threads:
            thread.join(timeout)
        _live.discard(self)

    def _feed(
        self, slot: int, wait_ready: Callable[[], None], serve: Serve, healthy: Callable[[], bool]
    ) -> None:
        self._store.pooled_reads()  # its one connection of its own is ``client`` below
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
                    client = self._connect(slot)
                try:
                    self._heartbeat(client, consumer, report=slot == 0)
                except redis.ResponseError:  # Redis answered (out of memory under noeviction):
                    pass  # the jobs already queued are still read
                jobs: list[Job] = []
                if time.monotonic() >= next_reclaim:
                    jobs = self._reclaim(client, consumer)
                    next_reclaim = time.monotonic() + self._claim_ms / 2000
                cost = 0.0
                if not jobs and not self._stopped.is_set():
                    jobs, cost = self._read(client, consumer)
                backoff = 0.1
            except REDIS_ERRORS as exc:
                log.debug("dispatch feeder: %s; retrying", exc.__class__.__name__)
                self._client_ids.pop(slot, None)
                _close(client)
                client = None
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            if jobs:
                lanes = {job.lane for job in jobs}
                lane = lanes.pop() if len(lanes) == 1 else ""
                self._computes(slot, True, min(job.deadline for job in jobs), lane)
                try:
                    self._run(client, consumer, jobs, cost, lambda jobs: serve(jobs, False))
                finally:
                    self._computes(slot, False)
        self._client_ids.pop(slot, None)
        if client is not None:  # stopped between jobs: nothing of ours is pending
            self._forget_consumer(client, consumer)
            try:  # no longer a live engine (an idle one would hold interjection back)
                client.zrem(self._names.engines, consumer)
            except REDIS_ERRORS:
                pass  # it ages out of the register
        _close(client)

    def _connect(self, key: int) -> Any:
        """A connection of the thread's own for blocking reads, registered under ``key`` so
        ``stop`` can unblock it."""
        client = self._store.pubsub_client(BLOCK_MS / 1000 + 5, dedicated=True)
        if getattr(client, "_single_connection_client", False):
            self._client_ids[key] = client.client_id()
        return client

    def _computes(self, slot: int, busy: bool, deadline: float = 0.0, lane: str = "") -> None:
        """The slot's engine starts (or ends) a call (of ``lane``'s jobs): its interjector's
        cue."""
        with self._computing:
            self._calls += 1
            self._running[slot] = (
                _Call(self._calls, deadline, time.monotonic(), lane) if busy else _NO_CALL
            )
            self._computing.notify_all()

    def _may_pause(self, slot: int) -> bool:
        """The slot's call has time to be paused for one more call (two of this engine's
        mean) before its first requester stops waiting."""
        return self._running[slot].deadline - time.time() > 2 * self._mean_seconds()

    def _next_call(self, slot: int, last: int) -> int:
        """The call the slot's engine runs now, once it is not ``last`` (0: stopped)."""
        with self._computing:
            while not self._stopped.is_set() and self._running[slot].number in (0, last):
                self._computing.wait()
            return 0 if self._stopped.is_set() else self._running[slot].number

    def _lane_while(self, slot: int, call: int) -> str | None:
        """The lane of the slot's ``call`` ("": several) while it runs; None once it ended."""
        with self._computing:
            if self._stopped.is_set() or self._running[slot].number != call:
                return None
            return self._running[slot].lane

    def _on_its_own(self, slot: int, call: int, lent: float) -> bool:
        """Wait until the slot's ``call`` has run on its own (its time less the ``lent``
        seconds it was paused for) at least ``lent`` seconds; False: it ended first."""
        with self._computing:
            while not self._stopped.is_set() and self._running[slot].number == call:
                short = 2 * lent - (time.monotonic() - self._running[slot].began)
                if short <= 0:
                    return True
                self._computing.wait(short)
            return False

    def _interject(self, slot: int, serve: Serve, healthy: Callable[[], bool]) -> None:
        """While the slot's engine computes a call: the job the round robin takes next, if
        its tenant has nothing running (but this call, while another tenant runs) and every
        engine is busy, interjected into that call; another once the call has run on its own
        as long as it was paused (so it keeps at least half its engine and always ends); none
        into a call whose requesters' time is nearly up."""
        engine = f"{self._name}-{slot}"  # the consumer of the slot's engine: what it holds
        consumer, key = f"{engine}-interject", self._slots + slot
        client: Any = None
        call = 0
        while (call := self._next_call(slot, call)) and not self._stopped.is_set():
            lent = 0.0  # seconds this call was paused for (each job's whole serving)
            while self._on_its_own(slot, call, lent):
                if not healthy() or not self._may_pause(slot):
                    break
                try:
                    if client is None:
                        client = self._connect(key)
                    jobs, cost = list[Job](), 0.0
                    while (lane := self._lane_while(slot, call)) is not None:
                        jobs, cost = self._take(client, consumer, True, (lane, engine))
                        if jobs:
                            break
                        client.blpop([self._names.interject_bell], timeout=BLOCK_MS / 1000)
                except REDIS_ERRORS as exc:
                    log.debug("dispatch interjector: %s", exc.__class__.__name__)
                    self._client_ids.pop(key, None)
                    _close(client)
                    client = None
                    break  # this call goes without: the next one may have one
                if not jobs:
                    break  # the call ended
                metrics.DISPATCH_JOBS.labels(outcome="interjected").inc(len(jobs))
                began = time.monotonic()
                self._run(
                    client, consumer, jobs, cost, lambda jobs: serve(jobs, True), report=False
                )
                lent += time.monotonic() - began
        self._client_ids.pop(key, None)
        if client is not None:
            self._forget_consumer(client, consumer)
        _close(client)

    def _forget_consumer(self, client: Any, consumer: str) -> None:
        """Leave the consumer group of every lane, except where this consumer still holds
        jobs (a finish that failed): deleting it would drop them from the pending list
        unacknowledged, never delivered or reclaimed again, yet still counted as waiting.
        Kept, they are reclaimed once idle, like a dead consumer's."""
        try:
            for lane in client.smembers(self._names.lanes):
                stream = self._names.stream(as_text(lane))
                try:
                    if not client.xpending_range(
                        stream, GROUP, min="-", max="+", count=1, consumername=consumer
                    ):
                        client.xgroup_delconsumer(stream, GROUP, consumer)
                except redis.ResponseError:
                    pass  # that lane's stream or group is gone
        except REDIS_ERRORS:
            pass

    def _heartbeat(self, client: Any, consumer: str, report: bool) -> None:
        names = self._names
        answer = QUEUE_HEARTBEAT(
            client, [names.engines, names.lanes, names.ring, names.stream_prefix],
            [consumer, self._claim_ms * 4, GROUP],
        )  # fmt: skip
        self.reported.set()
        if report:
            lanes = {as_text(answer[i]): int(answer[i + 1]) for i in range(0, len(answer), 2)}
            self._report(lanes)

    def _report(self, lanes: dict[str, int]) -> None:
        """The queue's depth, per tenant too, and how long one tenant has held at least
        half of it while others wait as well (the ``OcrTenantHoldsQueue`` alert: a tenant
        alone in the queue holds nobody up)."""
        total = sum(max(0, waiting) for waiting in lanes.values())
        metrics.DISPATCH_QUEUE_DEPTH.set(total)
        per_label: dict[str, int] = {}
        for lane, waiting in lanes.items():
            label = self._label("" if lane == DEFAULT_LANE else lane)
            per_label[label] = per_label.get(label, 0) + max(0, waiting)
        now = time.monotonic()
        for label in self._hold_labels | per_label.keys() | set(self._labels()):
            waiting = per_label.get(label, 0)
            metrics.TENANT_QUEUE_WAITING.labels(tenant=label).set(waiting)
            if 0 < waiting < total and 2 * waiting >= total:  # and another tenant waits
                held = now - self._holds.setdefault(label, now)
            else:
                self._holds.pop(label, None)
                held = 0.0
            metrics.TENANT_QUEUE_HOLD.labels(tenant=label).set(held)
        self._hold_labels |= per_label.keys()

    def _read(self, client: Any, consumer: str) -> tuple[list[Job], float]:
        """The next jobs by the round robin (and what each was charged), waiting on the
        doorbell for at most ``BLOCK_MS`` when there are none."""
        jobs, cost = self._take(client, consumer)
        if not jobs and not self._stopped.is_set():
            client.blpop([self._names.bell], timeout=BLOCK_MS / 1000)
            jobs, cost = self._take(client, consumer)
        return jobs, cost

    def _take(
        self,
        client: Any,
        consumer: str,
        interject: bool = False,
        paused: tuple[str, str] = ("", ""),
    ) -> tuple[list[Job], float]:
        """The next jobs by the round robin, and what each was charged (seconds);
        ``interject``: one job to run inside this engine's call, if one may (``queue_take.lua``);
        ``paused``: that call's lane ("": several) and its engine's consumer."""
        names, quantum = self._names, max(0.001, self._mean_seconds())  # a lane's first cost
        count, window = (1, str(self._queue.live_ms)) if interject else (self._batch_max, "")
        answer = QUEUE_TAKE(
            client, [names.ring, names.deficits, names.shares, names.costs, names.engines,
                     names.lanes, names.stream_prefix],
            [GROUP, consumer, count, f"{quantum:.6f}", window, *paused],
        )  # fmt: skip
        if not answer:
            return [], 0.0
        lane, entries, cost = as_text(answer[0]), answer[1], float(answer[2])
        jobs, malformed = [], []
        for entry_id, flat in entries:
            raw = dict(zip(flat[::2], flat[1::2], strict=True))
            job = _decode(entry_id, raw, lane=lane)
            if job is None:
                blank = Job("", "", OcrParams(), "", 0, 0.0, b"", id=as_text(entry_id), lane=lane)
                malformed.append(blank)
            else:
                jobs.append(job)
        if malformed:
            self._finish(client, malformed, {})
        return jobs, cost

    def _reclaim(self, client: Any, consumer: str) -> list[Job]:
        """Jobs idle longer than ``DISPATCH_CLAIM_MS`` in any lane: their consumer died."""
        names = self._names
        stale = QUEUE_STALE(
            client, [names.lanes, names.stream_prefix], [GROUP, self._claim_ms, self._batch_max]
        )
        jobs: list[Job] = []
        for i in range(0, len(stale), 4):
            lane, entry_id = as_text(stale[i]), as_text(stale[i + 1])
            owner, delivered = as_text(stale[i + 2]), int(stale[i + 3])
            stream = names.stream(lane)
            claimed = client.xclaim(stream, GROUP, consumer, self._claim_ms, [entry_id])
            if not claimed or claimed[0][1] is None:
                continue  # someone else claimed it first, or it was deleted
            deliveries = delivered + 1
            job = _decode(entry_id, claimed[0][1], deliveries, lane)
            if job is None:
                continue
            metrics.DISPATCH_JOBS.labels(outcome="reclaimed").inc()
            log.warning("reclaimed job %s of %s (delivery %d)", entry_id, owner, deliveries)
            if deliveries > self._max_deliveries:
                metrics.DISPATCH_JOBS.labels(outcome="abandoned").inc()
                self.fail(job, f"error:no engine survived this image ({deliveries - 1} deliveries)")
                self._finish(client, [job], {})
                continue
            jobs.append(job)
        return jobs

    def _run(
        self,
        client: Any,
        consumer: str,
        jobs: list[Job],
        cost: float,
        serve: Callable[[Sequence[Job]], Mapping[str, float]],
        report: bool = True,
    ) -> None:
        """Serve the jobs (each charged ``cost`` when taken), then finish them with their
        lanes' deficits corrected by the engine time they really took; ``report``: the
        consumer is an engine (an interjector is not: its engine reports itself)."""
        try:
            wanted = self._wanted(client, jobs)
        except REDIS_ERRORS:  # unsure whether anyone waits: compute (reclaimed otherwise)
            wanted = [job for job in jobs if job.deadline > time.time()]
        stop = threading.Event()
        toucher = threading.Thread(
            target=self._touch, args=(consumer, wanted, stop, report),
            name="dispatch-touch", daemon=True,
        )  # fmt: skip
        toucher.start()
        seconds: Mapping[str, float] = {}
        try:
            if wanted:
                seconds = serve(wanted) or {}
        except Exception:  # serve reports per job; never let a feeder die
            log.exception("dispatch: serving %d jobs failed", len(wanted))
        finally:
            stop.set()
            toucher.join()
            try:
                self._finish(client, jobs, seconds, cost)
            except REDIS_ERRORS:
                pass  # the jobs stay pending and are reclaimed, then dropped as done

    def _wanted(self, client: Any, jobs: list[Job]) -> list[Job]:
        """Jobs someone may still wait for: before their deadline, and their marker (when
        it survives) still naming them."""
        now = time.time()
        # One MGET on the feeder's own connection (the markers share the queue's slot): a
        # pipeline would take a second connection from that client's pool and keep it.
        markers = client.mget([self._queue.marker(job) for job in jobs])
        wanted = []
        for job, marker in zip(jobs, markers, strict=True):
            if job.deadline > now and (marker is None or as_text(marker) == job.id):
                wanted.append(job)
            else:
                metrics.DISPATCH_JOBS.labels(outcome="caller_gone").inc()
                metrics.ENGINE_QUEUE_DROPPED.labels(reason="caller_gone").inc()
        return wanted

    def _touch(self, consumer: str, jobs: list[Job], stop: threading.Event, report: bool) -> None:
        """While computing: keep the jobs ours (reset their idle time) and, ``report``,
        this engine live."""
        by_lane = _by_lane(jobs)
        names = self._names
        while by_lane and not stop.wait(self._claim_ms / 3000):

            def run(client: Any) -> Any:
                for lane, members in by_lane.items():
                    ids = [job.id for job in members]
                    client.xclaim(names.stream(lane), GROUP, consumer, 0, ids, justid=True)
                if not report:
                    return None
                return QUEUE_HEARTBEAT(
                    client, [names.engines, names.lanes, names.ring, names.stream_prefix],
                    [consumer, self._claim_ms * 4, GROUP],
                )  # fmt: skip

            self._store.run("dispatch", run)

    def _finish(
        self, client: Any, jobs: list[Job], seconds: Mapping[str, float], charged: float = 0.0
    ) -> None:
        """Acknowledge and delete ``jobs`` (per lane), each lane's deficit corrected from
        ``charged`` per job to the engine seconds they took (``seconds``, by job id)."""
        names = self._names
        for lane, members in _by_lane(jobs).items():
            spent = [seconds.get(job.id, 0.0) for job in members]
            markers = [self._queue.marker(job) for job in members]
            QUEUE_FINISH(
                client, [names.stream(lane), names.deficits, names.costs, *markers],
                [GROUP, lane, f"{charged * len(members):.6f}", f"{sum(spent):.6f}",
                 sum(1 for s in spent if s > 0), *[job.id for job in members]],
            )  # fmt: skip

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
        # The key is free before anyone hears: a request made on hearing it (a retry) queues
        # a new job rather than join this failed one until its entry is deleted (``_finish``).
        marker_key = self._queue.marker(job)
        self._store.run("dispatch", lambda c: QUEUE_RELEASE(c, [marker_key], [job.id]))
        self._store.publish(channel, f"error:{job.id}:{marker}")


# Every started set of feeders, so tests (and shutdown) can stop them all.
_live: set[Feeders] = set()


def stop_all() -> None:
    for feeders in list(_live):
        feeders.stop()


def _by_lane(jobs: Sequence[Job]) -> dict[str, list[Job]]:
    lanes: dict[str, list[Job]] = {}
    for job in jobs:
        lanes.setdefault(job.lane, []).append(job)
    return lanes


def _decode(
    entry_id: bytes | str, raw: dict[bytes, bytes], deliveries: int = 1, lane: str = DEFAULT_LANE
) -> Job | None:
    try:
        return Job.from_fields(as_text(entry_id), raw, deliveries, lane)
    except (KeyError, TypeError, ValueError):
        log.warning("dropping a malformed dispatch job %s", as_text(entry_id))
        return None


def _close(client: Any) -> None:
    if client is not None:
        try:
            client.close()
        except Exception:  # noqa: S110 - closing a broken client
            pass
