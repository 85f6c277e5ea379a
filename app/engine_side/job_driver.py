"""The engines drive document jobs: a driver thread of an engine process takes a job from
the jobs stream (a consumer group: each job has one driver; a driver silent for
``JOBS_CLAIM_IDLE_SECONDS`` loses it to another, which resumes after the pages recorded),
renders its pages one at a time, and puts each through the cache's front door like any
request: a page already cached is a hit, a new one a ticket on the miss queue, in its
tenant's *job lane* (``<tenant>+jobs``, ``JOBS_SHARE`` of the tenant's share), so a large job
neither fills the lane of its tenant's synchronous requests nor starves another tenant.

At most ``JOBS_PAGES_IN_FLIGHT`` pages of a job are rendered and waiting at once: memory per
job stays that many page images, whatever the document's length. Engines render, not fronts
(fronts stay light). A page's answer is copied into the job as it finishes; a page that
fails for its own reason (too large, unreadable) is recorded with why and the job goes on,
ending ``failed`` with the pages that did succeed still readable; a page the engines could not
compute (timeouts, engine errors) is tried again, ``PAGE_ATTEMPTS`` times in all. A job
cancelled while pages wait withdraws their tickets: those no engine started cost nothing.

An idle driver costs Redis a blocking read every ``TAKE_BLOCK_MS`` (or a quarter of the
claim time if shorter; a new job wakes it at once), a look for a silent driver's job every
quarter of the claim time, and its consumer group made once (again after a failure: the
stream may have been evicted): about a command every 5 s, not five every 2 s as it was. A
stop does not wait for a driver blocked in that read (it holds no job; one it gets
meanwhile is released for another at once).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

from app import pdf
from app.cache.region import OcrCache
from app.config import Settings
from app.imaging import InvalidImage
from app.jobs.callback import CallbackSender, tenant_secret
from app.jobs.store import Job, JobStore, JobsUnavailable
from app.queue.requester import Withdrawn, cancellable
from app.vocabulary import (
    CacheControls,
    ClientError,
    EngineBusy,
    EngineError,
    OcrParams,
    QuotaExceeded,
)

log = logging.getLogger(__name__)

PAGE_ATTEMPTS = 3
MAX_DELIVERIES = 3  # a job whose drivers died on it this often is failed, not retaken forever
TAKE_BLOCK_MS = 10_000  # an idle driver's blocking read (within the jobs client's 30 s timeout)
EVICTED = (
    "the document was evicted from Redis before its pages were read (give jobs room: "
    "maxmemory, JOBS_TTL_SECONDS; docs/ARCHITECTURE.md#document-jobs)"
)

# What the end of a job does besides recording it: (the job, its final status, its error).
OnEnd = Callable[[Job, str, str], None]


class JobDriver:
    """``drivers`` threads of one engine process (``consumer``: its name on the stream)."""

    def __init__(
        self,
        store: JobStore,
        cache: OcrCache,
        *,
        consumer: str,
        drivers: int,
        pages_in_flight: int,
        render_scale: float,
        max_pixels: int,
        claim_idle_ms: int = 60_000,
        on_end: OnEnd = lambda job, status, error: None,
    ) -> None:
        self._store, self._cache, self._consumer, self._drivers = store, cache, consumer, drivers
        self._in_flight, self._scale = pages_in_flight, render_scale
        self._max_pixels = max_pixels
        self._on_end = on_end
        self._claim_idle_ms = claim_idle_ms  # a driver silent this long loses its job
        self._keep_every = claim_idle_ms / 4000  # seconds between its reports
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._taking: set[int] = set()  # drivers blocked in a take: holding no job

    def start(self) -> None:
        for n in range(self._drivers):
            thread = threading.Thread(target=self._run, args=(n,), name=f"job-driver-{n}")
            thread.daemon = True
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 5.0) -> None:
        """Take no more jobs; a job being driven is left to be taken over (pages recorded
        so far are kept)."""
        self._stopped.set()
        for n, thread in enumerate(self._threads):
            if n not in self._taking:
                thread.join(timeout)

    def _run(self, n: int) -> None:
        consumer = f"{self._consumer}-{n}"
        grouped, next_look = False, 0.0
        while not self._stopped.is_set():
            try:
                if not grouped:
                    self._store.ensure_group()
                    grouped = True
                if look := time.monotonic() >= next_look:  # for a silent driver's job
                    next_look = time.monotonic() + self._keep_every
                self._taking.add(n)
                if self._stopped.is_set():  # stop() may not have waited for this driver
                    break
                try:
                    block = min(TAKE_BLOCK_MS, self._claim_idle_ms // 4)
                    taken = self._store.take(consumer, self._claim_idle_ms, block, takeover=look)
                finally:
                    self._taking.discard(n)
                if taken is not None and self._stopped.is_set():
                    self._store.release(taken[0], consumer, self._claim_idle_ms)
                elif taken is not None:
                    self._drive(consumer, *taken)
            except JobsUnavailable as exc:
                grouped = False
                log.warning("job driver: %s", exc)
                self._stopped.wait(2.0)
            except Exception:  # a bug: logged, the driver goes on with the next job
                log.exception("job driver: unexpected error")
                self._stopped.wait(2.0)

    def _drive(self, consumer: str, entry: str, job_id: str, deliveries: int) -> None:
        job = self._store.get(job_id)
        if job is None:
            self._store.done(entry)  # its record expired or was evicted: nothing to do
            return
        if not job.ended and deliveries > MAX_DELIVERIES:
            error = (
                f"its driver stopped {deliveries - 1} times while driving it (an engine that "
                "died on it, or was stopped): given up"
            )
            self._store.finish(job, "failed", error)  # told below, as a job found ended
        if job.ended or self._store.start(job) != "running":
            job = self._store.get(job_id) or job  # cancelled, or ended by a driver before
            self._store.drop_document(job)
            self._end(job, job.status, job.error)
            self._store.done(entry)
            return
        log.info("job %s: driving %d page(s) for tenant %r", job.id, job.total, job.tenant or "-")
        keeping, lost = threading.Event(), threading.Event()
        keeper = threading.Thread(
            target=self._keep, args=(entry, consumer, keeping, lost), daemon=True
        )
        keeper.start()
        try:
            status, error = self._pages(job, lost)
        finally:
            keeping.set()
        if status == "stopped":  # this process stops: another driver takes it over at once
            if not lost.is_set():
                self._store.release(entry, consumer, self._claim_idle_ms)
            return
        now = self._store.finish(job, status, error)  # "cancelled" if it was meanwhile
        log.info("job %s: %s%s", job.id, now, f" ({error})" if error else "")
        self._end(job, now, error if now == status else "")
        self._store.done(entry)

    def _end(self, job: Job, status: str, error: str) -> None:
        """The job's end is told once, by whichever driver ends it or finds it ended."""
        if status in ("succeeded", "failed", "cancelled") and self._store.claim_callback(job):
            self._on_end(job, status, error)

    def _keep(
        self, entry: str, consumer: str, done: threading.Event, lost: threading.Event
    ) -> None:
        """Report while driving; ``lost`` once another driver took the job over."""
        while not done.wait(self._keep_every):
            try:
                if not self._store.keep(entry, consumer):
                    log.warning("job entry %s: taken over by another driver", entry)
                    lost.set()
                    return
            except JobsUnavailable:
                pass

    def _pages(self, job: Job, lost: threading.Event) -> tuple[str, str]:
        """(the job's end: succeeded, failed, cancelled or stopped; the error). Pages not
        recorded after a pass (a Redis failure as one was recorded, a bug) get a second."""
        document = self._store.document(job.id)
        if document is None:
            return "failed", EVICTED
        for _ in range(2):
            recorded = self._store.pages(job.id)
            missing = [n for n in range(1, job.total + 1) if n not in recorded]
            if not missing:
                break
            try:
                ended = self._pass(job, document, missing, lost)
            except InvalidImage as exc:  # checked at submit; a renderer that disagrees ends it
                return "failed", f"the document cannot be read: {exc}"
            if ended:
                return ended
        final = self._store.get(job.id)
        if final is None:
            return "failed", "the job's record was evicted from Redis while it ran"
        if final.status == "cancelled":
            return "cancelled", ""
        pages = self._store.pages(job.id)
        if len(pages) < job.total:
            return "failed", f"{job.total - len(pages)} page(s) could not be recorded"
        failed = [p for p in pages.values() if "error" in p]
        if failed:
            why = f"page {failed[0]['page']}: {failed[0]['error']['message']}"
            return "failed", f"{len(failed)} of {job.total} page(s) failed (first: {why})"
        return "succeeded", ""

    def _pass(
        self, job: Job, document: bytes, numbers: list[int], lost: threading.Event
    ) -> tuple[str, str] | None:
        """Render and compute the pages at these places of the job, at most
        ``JOBS_PAGES_IN_FLIGHT`` at once; their end if the job ends meanwhile (stopped,
        taken over, cancelled), else None."""
        params = OcrParams.from_dict(job.params)
        controls = CacheControls(namespace=job.tenant, background=True)
        cancelled = threading.Event()

        def going() -> bool:
            if self._stopped.is_set() or lost.is_set() or self._store.status(job.id) != "running":
                cancelled.set()  # its waiting pages withdraw their tickets
            return not cancelled.is_set()

        pool = ThreadPoolExecutor(self._in_flight, thread_name_prefix=f"job-{job.id[-6:]}")
        running: set[Future[None]] = set()
        try:
            with _renderer(document, job.kind, self._scale, self._max_pixels) as render:
                for number in numbers:
                    while len(running) >= self._in_flight and going():
                        _, running = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
                    if not going():
                        break
                    try:
                        image = render(job.pages[number - 1])
                    except InvalidImage as exc:
                        self._record_error(job, number, exc)
                        continue
                    running.add(
                        pool.submit(
                            _logged, self._compute, job, number, image, params, controls, cancelled
                        )  # fmt: skip
                    )
                while running:
                    going()
                    _, running = wait(running, timeout=1.0)
        finally:
            cancelled.set()
            pool.shutdown(wait=True)
        if self._stopped.is_set() or lost.is_set():
            return "stopped", ""
        return None

    def _compute(
        self,
        job: Job,
        number: int,
        image: bytes,
        params: OcrParams,
        controls: CacheControls,
        cancelled: threading.Event,
    ) -> None:
        """One page through the cache, tried again while the engines are busy or failed it
        (``PAGE_ATTEMPTS`` failures in all); its answer or its error recorded."""
        failures, delay = 0, 1.0
        while not cancelled.is_set():
            try:
                with cancellable(cancelled):
                    outcome = self._cache.get_or_compute(image, params, controls)
            except Withdrawn:
                return
            except (EngineBusy, QuotaExceeded) as exc:  # load: wait and try again
                cancelled.wait(max(delay, float(getattr(exc, "retry_after", 1))))
                delay = min(delay * 2, 30.0)
                continue
            except ClientError as exc:  # the page itself: recorded, the job goes on
                self._record_error(job, number, exc)
                return
            except EngineError as exc:
                failures += 1
                if failures >= PAGE_ATTEMPTS:
                    self._record_error(job, number, exc)
                    return
                log.info("job %s page %d: %s; trying again", job.id, number, exc)
                cancelled.wait(delay)
                continue
            answer = {
                "page": job.pages[number - 1] + 1,  # the document's page number
                "result": outcome.result.to_dict(),
                "cache": outcome.status.value,
            }
            if outcome.tier:
                answer["cache_tier"] = outcome.tier
            self._store.record_page(job, number, answer, failed=False)
            return

    def _record_error(self, job: Job, number: int, exc: Exception) -> None:
        code = getattr(exc, "code", "error")
        page = job.pages[number - 1] + 1  # the document's page number
        answer = {"page": page, "error": {"code": code, "message": str(exc)}}
        self._store.record_page(job, number, answer, failed=True)


def _logged(compute: Callable[..., None], job: Job, number: int, *args: Any) -> None:
    """A page's computation on a pool thread: an unexpected error is logged, and the page
    left unrecorded for the job's next pass."""
    try:
        compute(job, number, *args)
    except Exception:
        log.exception("job %s page %d: unexpected error", job.id, number)


@contextmanager
def _renderer(
    document: bytes, kind: str, scale: float, max_pixels: int
) -> Iterator[Callable[[int], bytes]]:
    """A document's pages: a PDF's one at a time (open once), or the one image."""
    if kind != "pdf":
        yield lambda index: document
        return
    with pdf.pages(document, scale, max_pixels) as (_, render):
        yield render


def callbacks(sender: CallbackSender, master_secret: str) -> OnEnd:
    """What a job's end does: one signed POST to its ``callback_url`` (Standard Webhooks,
    under its tenant's secret), sent from a thread of its own (retries wait there)."""

    def on_end(job: Job, status: str, error: str) -> None:
        if not job.callback_url or not master_secret:
            return
        payload = {
            "type": f"job.{status}",
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "data": {
                "id": job.id,
                "status": status,
                "error": error or None,
                "pages_total": job.total,
            },  # fmt: skip
        }
        secret = tenant_secret(master_secret, job.tenant)
        threading.Thread(
            target=sender.deliver, args=(job.callback_url, secret, payload),
            name=f"callback-{job.id[-6:]}", daemon=True,
        ).start()  # fmt: skip

    return on_end


def start(settings: Settings, store: JobStore | None, cache: OcrCache) -> JobDriver | None:
    """This process's job drivers (an engine process, or a process that is both roles);
    None when jobs are off or there is no Redis."""
    jobs = settings.jobs
    if store is None or not jobs.drivers:
        return None
    sender = CallbackSender(jobs.callback_hosts(), jobs.callback_attempts)
    driver = JobDriver(
        store, cache, consumer=f"{socket.gethostname()}-{os.getpid()}", drivers=jobs.drivers,
        pages_in_flight=jobs.pages_in_flight, render_scale=settings.protocols.pdf_render_scale,
        max_pixels=settings.server.max_image_pixels,
        claim_idle_ms=jobs.claim_idle_seconds * 1000,
        on_end=callbacks(sender, jobs.callback_secret),
    )  # fmt: skip
    driver.start()
    return driver
