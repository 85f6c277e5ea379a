"""L2 hits answered by the HTTP front itself (``HTTP_FRONT_HITS``, on by default).

Behind the front (app/front.py) a hit costs a second HTTP parse, a unix-socket hop, gunicorn's
thread hand-offs and Flask, around one Redis GET: on this machine gunicorn alone adds more
latency than the whole lookup. For the commonest requests, sent without cache controls,
the front looks the entries up in Redis itself:

- REST ``POST /v1/ocr`` whose body is ``{"image": "<base64>"}`` and nothing else;
- Paddle Serving's pipeline ``POST /{PIPELINE_SERVICE_NAME}/{method}`` (what its HTTP clients
  send), without ``pipeline.profile``, every image a hit.

When every entry is there and passes every check a worker applies (the codec's: SHA-256 of
the image, envelope version, engine fingerprint, the key it was sealed for, decryption), the
front answers exactly as a worker would, through the protocol's own parse and render code:
the same body, the same ``X-Cache``/``X-Cache-Tier`` (hidden from untrusted callers), the
same metrics. Everything else goes to gunicorn as before: a miss, an unusable entry, another
body or path, a parse error, a cache control or tenant header, a chunked body, Redis slow or
down (then for ``REDIS_BREAKER_COOLDOWN_SECONDS``). The front never computes, writes or
decides.

What the key and the answer need from the engine (fingerprint, the default task's key, the
engine description) comes from the workers: each writes a ``HitSpec`` to the front's private
folder once its service is built (``publish``); until one exists, every request is forwarded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict, dataclass
from email.utils import formatdate
from typing import Any

import orjson

from app.cache import redis_client
from app.cache.codec import Codec
from app.cache.keys import KeySpace, digest_image
from app.config import Settings
from app.protocols import controls, pipeline, pipeline_http, rest, trust
from app.vocabulary import CacheControls, CacheStatus, OcrCacheError, OcrParams, Outcome

log = logging.getLogger("app.front")

PATH = b"/v1/ocr"
SPEC_ENV = "OCR_FRONT_HIT_SPEC"  # where the workers write the spec (set by ``app serve``)
_SPEC_CHECK_SECONDS = 1.0
Headers = list[tuple[bytes, bytes]]


@dataclass(frozen=True)
class HitSpec:
    """What a worker knows and the front needs to find and render the default REST entry."""

    key_prefix: str  # CACHE_KEY_PREFIX
    fingerprint: str  # the engine's (with redaction), as in every key
    task_key: str  # KeySpace.task of the default REST params
    task: str  # those params' task, as rendered
    min_score: float  # the default line filter (OCR_REC_SCORE_THRESH)
    engine: dict[str, Any]  # the rendered engine description
    pipeline_task_key: str  # KeySpace.task of the engine's default params (the pipeline's)

    @classmethod
    def of(cls, service: Any) -> HitSpec:
        """From a worker's ``OcrService``: the params a body without options gets, computed
        by the REST parser's own code."""
        params = rest.RestRequest(b"", service.min_score).params(
            service.default_params,
            service.default_task,
            service.settings.hunyuan_target_language,
        )
        engine = service.cache.engine
        engine.check_params(params)
        keys = service.cache.keys
        return cls(
            keys.base_prefix, keys.fingerprint, keys.task(params), params.task,
            service.min_score, service.engine_description, keys.task(engine.default_params),
        )  # fmt: skip

    def write(self, path: str) -> None:
        """Atomically (workers write the same spec concurrently; the front reads any time)."""
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as out:
            out.write(orjson.dumps(asdict(self)))
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: str) -> HitSpec | None:
        try:
            with open(path, "rb") as spec:
                raw = orjson.loads(spec.read())
            return cls(**raw)
        except (OSError, ValueError, TypeError):
            return None


def publish(service: Any) -> None:
    """Called in each worker once its service exists (gunicorn ``post_worker_init``)."""
    path = os.environ.get(SPEC_ENV)
    if not path or service is None or not service.cache.store.enabled:
        return
    try:
        HitSpec.of(service).write(path)
    except Exception:  # the front then forwards everything, as without this feature
        log.exception("could not publish the hit spec; the HTTP front forwards every request")


class FrontHits:
    """``answer`` a complete request from Redis, or None: forward it."""

    def __init__(self, settings: Settings, spec_path: str) -> None:
        self._settings = settings
        self._spec_path = spec_path
        self._codec = Codec(settings.cache_compress_min_bytes, settings.cache_encryption_keys)
        # Any of these may change the answer or must be validated by the worker.
        self._forward_headers = frozenset(
            name.lower().encode()
            for name in (
                "Cache-Control", controls.TTL_HEADER, controls.SIMILAR_HEADER, "Transfer-Encoding",
                settings.cache_tenant_header,
            )
            if name
        )  # fmt: skip
        self._spec: HitSpec | None = None
        self._keys: KeySpace | None = None
        self._spec_mtime = 0.0
        self._spec_checked = 0.0
        self._redis: Any = None
        self._resume_at = 0.0  # after a Redis failure, forward everything until then
        self._counters: tuple[Any, ...] = ()
        self._date = (0, b"")
        self._pipeline_name = settings.pipeline_service_name.encode()

    async def answer(
        self, method: bytes, target: bytes, headers: Headers, body: bytes, client_ip: str
    ) -> tuple[int, Headers, bytes] | None:
        if method != b"POST" or (target != PATH and target != self._pipeline_path(target)):
            return None
        now = time.monotonic()
        if now < self._resume_at or not self._current_spec(now):
            return None
        if any(name in self._forward_headers for name, _ in headers):
            return None
        try:
            if target == PATH:
                return await self._rest(headers, body, client_ip, now)
            return await self._pipeline(headers, body, client_ip, now)
        except Exception:  # a bug here must cost the fast path, never the request
            log.exception("front hit path failed; forwarding")
            return None

    async def _rest(
        self, headers: Headers, body: bytes, client_ip: str, started: float
    ) -> tuple[int, Headers, bytes] | None:
        data = rest.image_only(body)
        if data is None:
            return None
        spec = self._spec
        assert spec is not None
        found = await self._lookup([data], spec.task_key, started)
        if found is None:
            return None
        shown = self._shows_cache(headers, client_ip)
        payload = rest.render(found[0], spec.engine, spec.min_score, spec.task, show_cache=shown)
        self._count("rest", found, started)
        return 200, self._headers(shown, "l2", payload), payload

    async def _pipeline(
        self, headers: Headers, body: bytes, client_ip: str, started: float
    ) -> tuple[int, Headers, bytes] | None:
        """Only an answer with every image a hit: ``pipeline.answer`` runs on the outcomes
        found here, so the body is the one a worker renders."""
        spec = self._spec
        assert spec is not None
        try:
            req = pipeline_http.parse(body)
            images = pipeline.decode_images(req, self._settings.max_images_per_request)
        except OcrCacheError:  # the worker answers it, in the protocol's error form
            return None
        if req.profile or not images:
            return None
        found = await self._lookup(images, spec.pipeline_task_key, started)
        if found is None:
            return None
        answer = pipeline.answer(_Found(found), req, spec.min_score, len(images))
        if answer.err_no != 0:
            return None
        shown = self._shows_cache(headers, client_ip)
        payload = pipeline_http.render(answer)
        self._count("pipeline_http", found, started)
        return 200, self._headers(shown, answer.cache_tier, payload), payload

    async def _lookup(self, images: list[bytes], task_key: str, now: float) -> list[Outcome] | None:
        """Every image's verified L2 entry, or None (a miss, an unusable entry, Redis)."""
        spec, keys = self._spec, self._keys
        assert spec is not None and keys is not None
        digests = [digest_image(data) for data in images]
        names = [keys.entry(digest, task_key) for digest in digests]
        try:
            if len(names) == 1:
                values = [await self._redis.get(names[0])]
            else:  # one slot per image: no MGET across a cluster's slots
                values = await asyncio.gather(*(self._redis.get(name) for name in names))
        except Exception as exc:  # noqa: BLE001 - any client failure: the worker answers
            self._resume_at = now + self._settings.redis_breaker_cooldown_seconds
            log.warning("front hits paused: Redis %s; forwarding", exc.__class__.__name__)
            return None
        outcomes = []
        for digest, name, value in zip(digests, names, values, strict=True):
            entry = self._codec.decode(value, digest.sha256, spec.fingerprint, name)
            if entry is None:
                return None
            outcomes.append(Outcome(entry.result, CacheStatus.HIT, "l2"))
        return outcomes

    def _pipeline_path(self, target: bytes) -> bytes:
        """``target`` when it is ``/{PIPELINE_SERVICE_NAME}/{method}`` (the worker's route
        takes any method name), else b"" (no match)."""
        name, _, method = target[1:].partition(b"/")
        ok = target[:1] == b"/" and name == self._pipeline_name and method and b"/" not in method
        return target if ok and b"?" not in method else b""

    def _shows_cache(self, headers: Headers, client_ip: str) -> bool:
        mapping = {}  # trust reads the headers only for the token
        if self._settings.cache_control_token:
            mapping = {name.decode("latin-1"): value.decode("latin-1") for name, value in headers}
        trusted = trust.is_trusted(client_ip, mapping, self._settings)
        return trust.shows_cache_status(trusted, self._settings)

    def _headers(self, shown: bool, tier: str, payload: bytes) -> Headers:
        answer = [(b"date", self._http_date()), (b"content-type", b"application/json")]
        if shown:
            answer += [(b"x-cache", b"HIT"), (b"x-cache-tier", tier.encode())]
        answer.append((b"content-length", str(len(payload)).encode()))
        return answer

    def _current_spec(self, now: float) -> bool:
        """Whether a spec is loaded; the file is looked at once a second at most (a worker
        restarted with other model files publishes a new fingerprint)."""
        if now - self._spec_checked < _SPEC_CHECK_SECONDS:
            return self._spec is not None
        self._spec_checked = now
        try:
            mtime = os.stat(self._spec_path).st_mtime
        except OSError:
            return self._spec is not None
        if mtime != self._spec_mtime:
            spec = HitSpec.read(self._spec_path)
            if spec is not None:
                self._spec_mtime = mtime
                self._load(spec)
        return self._spec is not None

    def _load(self, spec: HitSpec) -> None:
        if self._redis is None:
            s = self._settings
            self._redis = redis_client.connect(
                s.redis_url, s.redis_timeout_ms / 1000, s.redis_connect_timeout_ms / 1000,
                username=s.redis_username, password=s.redis_password,
                tls_ca_file=s.redis_tls_ca_file, tls_cert_file=s.redis_tls_cert_file,
                tls_key_file=s.redis_tls_key_file, asynchronous=True,
            )  # fmt: skip
            # Imported now, not at start: the metrics folder is (re)made when gunicorn starts,
            # and a spec exists only once a worker runs.
            from app import metrics

            self._counters = (
                metrics.CACHE_REQUESTS.labels(result="hit"),
                metrics.CACHE_TIER_HITS.labels(tier="l2"),
                {
                    protocol: (
                        metrics.REQUESTS.labels(protocol=protocol, status="200"),
                        metrics.REQUEST_SECONDS.labels(
                            protocol=protocol, cache=CacheStatus.HIT.value
                        ),
                    )
                    for protocol in ("rest", "pipeline_http")
                },
            )
        self._keys = KeySpace(spec.key_prefix, spec.fingerprint)
        self._spec = spec
        log.info("answering REST L2 hits in the front (engine %s)", spec.fingerprint)

    def _count(self, protocol: str, outcomes: list[Outcome], started: float) -> None:
        hits, tier, by_protocol = self._counters
        hits.inc(len(outcomes))
        tier.inc(len(outcomes))
        requests, latency = by_protocol[protocol]
        requests.inc()
        latency.observe(time.monotonic() - started)

    def _http_date(self) -> bytes:
        second = int(time.time())
        if self._date[0] != second:
            self._date = (second, formatdate(second, usegmt=True).encode())
        return self._date[1]

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()


class _Found:
    """``pipeline.Lookup`` over outcomes already found: the pipeline's own ``answer`` renders
    them (its status, tiers and line filter), as in a worker."""

    def __init__(self, outcomes: list[Outcome]) -> None:
        self._outcomes = outcomes

    def get_or_compute_many(
        self,
        images: Any,
        params: OcrParams | None = None,
        controls: CacheControls = CacheControls(),
    ) -> list[Outcome]:
        return self._outcomes
