"""The cold tier (L3): cache entries archived to S3-compatible object storage.

Redis (L2) evicts under ``maxmemory``; every eviction used to mean a new engine call. L3 keeps
the same envelope (``codec``: verified, compressed, encrypted when keys are set) for
``CACHE_L3_TTL_SECONDS`` in a bucket, at a fraction of Redis's price per byte:

- read-through: on an L2 miss one GET, short timeouts, its own circuit breaker; the object is
  verified like an L2 entry (SHA-256, engine fingerprint, version, AES-GCM bound to the L2
  key) and refused when older than ``CACHE_L3_TTL_SECONDS`` (its creation time is in it);
- write-behind: a computed entry is queued (bounded, never blocking the answer; full: dropped
  and counted) and one background thread per process PUTs it;
- purge: list + delete by prefix (``KeySpace.object_prefix``).

Every method answers, whatever the store does: reads report a miss, writes are dropped, so
an outage of the object store costs engine calls, never requests. Works with AWS S3, MinIO,
Ceph RGW and SeaweedFS through boto3, configured by the standard AWS variables
(``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, ``AWS_REGION``, credentials or
``AWS_SHARED_CREDENTIALS_FILE``) plus ``CACHE_L3_*``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from botocore.exceptions import BotoCoreError, ClientError

from app import metrics
from app.cache.breaker import CircuitBreaker
from app.cache.codec import Codec
from app.cache.keys import KeySpace
from app.cache.l2 import sealed
from app.cache.purging import PurgeUnconfirmed
from app.cache.tier import ENGINE, Probe, Tier
from app.vocabulary import OcrResult

log = logging.getLogger(__name__)

MAX_OBJECT_BYTES = 64 << 20  # larger objects are not ours (the codec's own bound)
_MISSING = ("NoSuchKey", "404", "NotFound")
_RECENT_PURGES = 64


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, ``prefix/``); the prefix may be empty."""
    bucket, _, prefix = url.removeprefix("s3://").strip("/").partition("/")
    return bucket, f"{prefix.strip('/')}/" if prefix.strip("/") else ""


@dataclass(frozen=True)
class Recalled:
    """A verified L3 entry: the result and how long L3 still keeps it."""

    result: OcrResult
    remaining_seconds: float


if TYPE_CHECKING:
    from app.config import L3Settings


class ColdTier:
    """The object store client: recall, archive (write-behind), purge."""

    def __init__(
        self,
        settings: L3Settings,
        codec: Codec,
        pool_size: int = 10,
        client_factory: Callable[[], Any] | None = None,
    ) -> None:
        """``pool_size``: connections (every HTTP and gRPC thread of a worker may read);
        ``client_factory``: a boto3 S3 client maker (default: from ``settings`` and the
        standard AWS environment); called once per process (clients do not survive fork)."""
        self.bucket, self.prefix = parse_url(settings.url)
        self._codec = codec
        self._ttl = settings.ttl_seconds
        self._factory = client_factory or partial_client(settings, pool_size)
        # A read's whole time, name resolution included: botocore's timeouts bound the
        # connection and each read, not getaddrinfo (10 s when the store's name stops
        # resolving, measured by `make chaos` with SeaweedFS stopped).
        attempts = 1 + settings.retries
        self._read_bound = (settings.connect_timeout_ms + settings.timeout_ms) * attempts / 1000
        self._readers: ThreadPoolExecutor | None = None
        self._readers_pid = 0
        self._pool_size = pool_size
        self._breaker = CircuitBreaker(
            settings.breaker_failures,
            settings.breaker_cooldown_seconds,
            on_change=metrics.L3_BREAKER_OPEN.set,
        )
        self._queue: queue.Queue[tuple[str, bytes, float] | None] = queue.Queue(settings.queue_max)
        self._lock = threading.Lock()
        self._pid = 0
        self._client: Any = None
        self._writer: threading.Thread | None = None
        self._writer_pid = 0
        self._purges: list[tuple[str, float]] = []

    @property
    def breaker_state(self) -> str:
        return self._breaker.state

    def name(self, object_name: str) -> str:
        """The object key in the bucket: the URL's prefix + the ``KeySpace`` name."""
        return f"{self.prefix}{object_name}"

    # Read-through --------------------------------------------------------------------

    def recall(self, object_name: str, key: str, sha256: str, fingerprint: str) -> Recalled | None:
        """The verified entry stored under ``object_name`` for this input, or None."""
        outcome, body = self._get(self.name(object_name))
        if body is None:
            metrics.L3_READS.labels(result=outcome).inc()
            return None
        entry = self._codec.decode(body, sha256, fingerprint, key)
        remaining = entry.created + self._ttl - time.time() if entry is not None else 0.0
        if entry is None or remaining <= 0:
            # Forged, foreign (another image, engine or key), or past its L3 retention.
            metrics.L3_READS.labels(result="rejected").inc()
            log.info("L3 object %s is unusable or expired; treating as a miss", object_name)
            return None
        metrics.L3_READS.labels(result="hit").inc()
        return Recalled(entry.result, remaining)

    def _get(self, name: str) -> tuple[str, bytes | None]:
        def fetch() -> bytes | None:
            try:
                answer = self._s3().get_object(Bucket=self.bucket, Key=name)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in _MISSING:
                    return None
                raise
            body = answer["Body"]
            try:
                if int(answer.get("ContentLength") or 0) > MAX_OBJECT_BYTES:
                    return b""  # not one of ours: rejected by the codec
                return body.read(MAX_OBJECT_BYTES + 1)
            finally:
                body.close()

        ok, value = self._call("get", partial(self._bounded, fetch))
        if not ok:
            return value, None
        return ("hit", value) if value is not None else ("miss", None)

    def _bounded(self, fetch: Callable[[], bytes | None]) -> bytes | None:
        """``fetch()`` on a reader thread, waited for at most the read's bound; past it a
        ``TimeoutError`` (a transport failure: the breaker counts it) and the thread is left
        to finish on its own."""
        if self._readers is None or self._readers_pid != os.getpid():
            with self._lock:
                if self._readers is None or self._readers_pid != os.getpid():
                    self._readers = ThreadPoolExecutor(self._pool_size, "l3-read")
                    self._readers_pid = os.getpid()
        future = self._readers.submit(fetch)
        try:
            return future.result(timeout=self._read_bound)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"no answer within {self._read_bound:g} s") from None

    # Write-behind --------------------------------------------------------------------

    def archive(self, object_name: str, value: bytes) -> None:
        """Queue ``value`` for a PUT; never blocks: a full queue drops it (counted)."""
        self._start_writer()
        try:
            self._queue.put_nowait((self.name(object_name), value, time.monotonic()))
        except queue.Full:
            metrics.L3_WRITES.labels(result="dropped").inc()
            return
        metrics.L3_WRITES.labels(result="queued").inc()
        metrics.L3_QUEUE_DEPTH.inc()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued write is done (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0 or not self._queue.all_tasks_done.wait(left):
                    return not self._queue.unfinished_tasks
        return True

    def close(self) -> None:
        """Stop the writer after the writes already queued (a daemon thread otherwise)."""
        writer = self._writer
        if writer is not None and writer.is_alive():
            self._queue.put(None)
            writer.join(timeout=30)

    def _start_writer(self) -> None:
        """One writer thread per process, started on first use (after a fork, too, and
        again should it ever have died)."""
        if self._writer_pid == os.getpid() and self._writer is not None and self._writer.is_alive():
            return
        with self._lock:
            writer = self._writer
            if self._writer_pid != os.getpid() or writer is None or not writer.is_alive():
                self._writer = threading.Thread(target=self._write_loop, name="l3-writer")
                self._writer.daemon = True
                self._writer.start()
                self._writer_pid = os.getpid()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                metrics.L3_QUEUE_DEPTH.dec()
                name, value, queued_at = item
                if self._purged_since(name, queued_at):
                    metrics.L3_WRITES.labels(result="purged").inc()
                    continue
                ok, _ = self._call("put", partial(self._put, name, value))
                metrics.L3_WRITES.labels(result="stored" if ok else "error").inc()
            finally:
                self._queue.task_done()

    def _put(self, name: str, value: bytes) -> None:
        self._s3().put_object(
            Bucket=self.bucket, Key=name, Body=value, ContentType="application/octet-stream"
        )

    # Purge ---------------------------------------------------------------------------

    def purge(self, object_prefix: str) -> int | None:
        """Delete every object under ``object_prefix`` (list + batched delete); writes of
        those objects still queued here are dropped. None when the store failed."""
        prefix = self.name(object_prefix)
        with self._lock:
            self._purges = [*self._purges[-_RECENT_PURGES + 1 :], (prefix, time.monotonic())]

        def run() -> int:
            removed = 0
            pages = self._s3().get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=self.bucket, Prefix=prefix):
                batch = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                if batch:
                    answer = self._s3().delete_objects(
                        Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                    )
                    removed += len(batch) - len(answer.get("Errors", []))
            return removed

        ok, removed = self._call("purge", run)
        return removed if ok else None

    def _purged_since(self, name: str, queued_at: float) -> bool:
        with self._lock:
            return any(name.startswith(p) and queued_at <= at for p, at in self._purges)

    # The client ----------------------------------------------------------------------

    def _s3(self) -> Any:
        if self._client is None or self._pid != os.getpid():
            with self._lock:
                if self._client is None or self._pid != os.getpid():
                    self._client = self._factory()
                    self._pid = os.getpid()
        return self._client

    def _call(self, op: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """(True, value), or (False, "error" | "circuit_open"); never raises. Only
        transport failures (timeouts, refused connections) open the circuit: a store that
        answers with an error (403, 5xx) is up."""
        if not self._breaker.allow():
            return False, "circuit_open"
        try:
            value = fn()
        except ClientError as exc:
            self._breaker.success()
            code = exc.response.get("Error", {}).get("Code", "?")
            log.warning("L3 %s failed: %s %s", op, exc.__class__.__name__, code)
            return False, "error"
        except (BotoCoreError, OSError) as exc:
            self._breaker.failure()
            log.warning("L3 %s failed: %s", op, exc.__class__.__name__)
            return False, "error"
        except Exception as exc:  # e.g. boto3's ValueError for a malformed endpoint URL
            self._breaker.failure()
            log.warning("L3 %s failed: %s: %s", op, exc.__class__.__name__, exc)
            return False, "error"
        self._breaker.success()
        return True, value


def partial_client(settings: L3Settings, pool_size: int) -> Callable[[], Any]:
    """A maker of the boto3 S3 client: short connect/read timeouts, limited retries,
    addressing style from ``CACHE_L3_ADDRESSING``; endpoint and credentials from the
    standard AWS environment (boto3's own chain)."""

    def make() -> Any:
        import boto3
        from botocore.config import Config

        config = Config(
            connect_timeout=settings.connect_timeout_ms / 1000,
            read_timeout=settings.timeout_ms / 1000,
            retries={"total_max_attempts": 1 + settings.retries, "mode": "standard"},
            max_pool_connections=max(10, pool_size + 2),
            s3={"addressing_style": settings.addressing},
            # Checksums only where the API requires them: S3-compatible stores (older MinIO,
            # Ceph RGW) refuse the newer default trailing checksums.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        return boto3.session.Session().client(
            "s3", region_name=region or "us-east-1", config=config
        )

    return make


class L3Tier(Tier):
    """The cold tier in the chain: an L3 hit refills L2 (a fresh envelope for the rest of
    its L3 retention, at most ``CACHE_TTL_SECONDS`` or the request's own TTL) and L1; a
    computed result is archived (write-behind) unless its caller chose its own TTL."""

    name = "l3"

    def __init__(self, cold: ColdTier, keys: KeySpace, codec: Codec, refill_ttl: int) -> None:
        self.cold = cold
        self._keys = keys
        self._codec = codec
        self._refill_ttl = refill_ttl

    def _object(self, probe: Probe) -> str:
        return self._keys.object(probe.digest, probe.task, probe.controls.namespace)

    def lookup(self, probes: Sequence[Probe]) -> None:
        for probe in probes:  # one GET per image (the front door's single-flight)
            found = self.cold.recall(
                self._object(probe), probe.entry_key(self._keys), probe.digest.sha256,
                self._keys.fingerprint,
            )  # fmt: skip
            if found is not None:
                bound = probe.controls.ttl or self._refill_ttl
                probe.answer(
                    found.result, self.name, max(1, int(min(found.remaining_seconds, bound)))
                )

    def record(self, probe: Probe, result: OcrResult, ttl: float, source: str) -> bool:
        if source == ENGINE and not probe.controls.ttl:  # a caller's own TTL stays off L3
            value = sealed(probe, result, max(1, int(ttl)), self._codec, self._keys)
            self.cold.archive(self._object(probe), value)  # write-behind, never blocks
        return True

    def purge(self, namespace: str, md5: str | None) -> int:
        """``PurgeUnconfirmed`` when the store failed: an object left behind would be recalled
        on the next L2 miss."""
        removed = self.cold.purge(self._keys.object_prefix(namespace, md5))
        if removed is None:
            raise PurgeUnconfirmed(0, "the cold tier (L3) failed during the purge")
        return removed
