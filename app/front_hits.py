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

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from email.utils import formatdate
from typing import Any

import orjson
from redis.exceptions import RedisError

from app.cache import redis_client
from app.cache.breaker import CircuitBreaker
from app.cache.codec import Codec
from app.cache.keys import KeySpace, digest_image
from app.config import Settings
from app.protocols import controls, pipeline, pipeline_http, rest, trust
from app.vocabulary import CacheStatus, OcrCacheError, Outcome

log = logging.getLogger("app.front")

PATH = b"/v1/ocr"
SPEC_ENV = "OCR_FRONT_HIT_SPEC"  # where the workers write the spec (set by ``app serve``)
_SPEC_CHECK_SECONDS = 1.0
# gunicorn's own request limits (limit_request_fields, _field_size): past them it answers 400,
# so the front must not answer 200.
_MAX_FIELDS, _MAX_FIELD_BYTES, _MAX_TARGET_BYTES = 100, 8190, 2048
Headers = list[tuple[bytes, bytes]]


@dataclass(frozen=True)
class HitSpec:
    """What a worker knows and the front needs to find and render the default entries."""

    key_prefix: str  # CACHE_KEY_PREFIX
    fingerprint: str  # the engine's (with redaction), as in every key
    task_key: str  # KeySpace.task of the default REST params
    task: str  # those params' task, as rendered
    min_score: float  # the default line filter (OCR_REC_SCORE_THRESH)
    engine: dict[str, Any]  # the rendered engine description
    pipeline_task_key: str  # KeySpace.task of the engine's default params (the pipeline's)
    pipeline_name: str  # PIPELINE_SERVICE_NAME; "" when another route shares /{name}/...

    @classmethod
    def of(cls, service: Any, routes: Iterable[str]) -> HitSpec:
        """From a worker's ``OcrService`` and its app's URL rules: the params a body without
        options gets, computed by the REST parser's own code."""
        params = rest.RestRequest(b"", service.min_score).params(
            service.default_params,
            service.default_task,
            service.settings.hunyuan_target_language,
        )
        engine = service.cache.engine
        engine.check_params(params)
        keys = service.cache.keys
        name = service.settings.pipeline_service_name
        shared = any(rule.startswith(f"/{name}/") for rule in routes)  # e.g. a name "admin"
        return cls(
            keys.base_prefix, keys.fingerprint, keys.task(params), params.task,
            service.min_score, service.engine_description, keys.task(engine.default_params),
            "" if shared else name,
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


def publish(service: Any, app: Any) -> None:
    """Called in each worker once its service exists (gunicorn ``post_worker_init``)."""
    path = os.environ.get(SPEC_ENV)
    if not path or service is None or not service.cache.store.enabled:
        return
    try:
        HitSpec.of(service, (rule.rule for rule in app.url_map.iter_rules())).write(path)
    except Exception:  # the front then forwards everything, as without this feature
        log.exception("could not publish the hit spec; the HTTP front forwards every request")


@dataclass(frozen=True)
class _Counters:
    """The metrics a front hit moves, bound once (as a worker's are)."""

    hits: Any
    l2: Any
    by_protocol: dict[str, tuple[Any, Any, Any]]  # front hits, requests, request seconds
    redis_errors: Any  # the metric; labelled per failure

    @classmethod
    def bind(cls) -> _Counters:
        from prometheus_client import multiprocess

        from app import metrics

        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # Importing app.metrics made this process's copies of the unlabelled "live"
            # gauges (engine ready, breaker open) at 0; the front never sets them, so its
            # copies must not count in the service's values.
            multiprocess.mark_process_dead(os.getpid())
        return cls(
            metrics.CACHE_REQUESTS.labels(result="hit"),
            metrics.CACHE_TIER_HITS.labels(tier="l2"),
            {
                protocol: (
                    metrics.FRONT_HITS.labels(protocol=protocol),
                    metrics.REQUESTS.labels(protocol=protocol, status="200"),
                    metrics.REQUEST_SECONDS.labels(protocol=protocol, cache=CacheStatus.HIT.value),
                )
                for protocol in ("rest", "pipeline_http")
            },
            metrics.REDIS_ERRORS,
        )


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
        self._token_header = trust.TOKEN_HEADER.lower().encode()
        self._breaker = CircuitBreaker(
            settings.redis_breaker_failures, settings.redis_breaker_cooldown_seconds
        )
        self._spec: HitSpec | None = None
        self._keys: KeySpace | None = None
        self._redis: Any = None
        self._counters: _Counters | None = None
        self._spec_mtime = 0.0
        self._spec_checked = 0.0
        self._date = (0, b"")

    async def answer(
        self, method: bytes, target: bytes, headers: Headers, body: bytes, client_ip: str
    ) -> tuple[int, Headers, bytes] | None:
        """(status, headers, body) for a request answered here; None: forward it."""
        try:
            if not self._current_spec(time.monotonic()):
                return None
            protocol = self.screen(method, target, headers)
            if protocol == "rest":
                return await self._rest(headers, body, client_ip)
            if protocol == "pipeline_http":
                return await self._pipeline(headers, body, client_ip)
            return None
        except Exception:  # a bug here must cost the fast path, never the request
            log.exception("front hit path failed; forwarding")
            return None

    def screen(self, method: bytes, target: bytes, headers: Headers) -> str | None:
        """The protocol of a request the front may answer ("rest", "pipeline_http"), or None
        for one only a worker may: any cache control or tenant header, a chunked or
        multipart body, a repeated token header, what gunicorn would refuse, a path that
        Flask could route elsewhere (percent-encoded, a query)."""
        if method != b"POST" or len(headers) > _MAX_FIELDS or len(target) > _MAX_TARGET_BYTES:
            return None
        if target == PATH:
            protocol = "rest"
        elif self._is_pipeline(target):
            protocol = "pipeline_http"
        else:
            return None
        tokens = 0
        for name, value in headers:
            if name in self._forward_headers or len(name) + len(value) > _MAX_FIELD_BYTES:
                return None
            if name == b"content-type" and value.lower().lstrip().startswith(b"multipart/"):
                return None
            tokens += name == self._token_header
        return protocol if tokens <= 1 else None

    def _is_pipeline(self, target: bytes) -> bool:
        """``/{PIPELINE_SERVICE_NAME}/{method}``: the worker's route takes any method name."""
        spec = self._spec
        if spec is None or not spec.pipeline_name or b"%" in target or b"?" in target:
            return False
        name, _, method = target[1:].partition(b"/")
        return target[:1] == b"/" and name == spec.pipeline_name.encode() and method.isalnum()

    async def _rest(
        self, headers: Headers, body: bytes, client_ip: str
    ) -> tuple[int, Headers, bytes] | None:
        started = time.monotonic()
        data = rest.image_only(body)
        spec = self._spec
        if data is None or spec is None:
            return None
        found = await self._lookup([data], spec.task_key)
        if found is None:
            return None
        shown = self._shows_cache(headers, client_ip)
        payload = rest.render(found[0], spec.engine, spec.min_score, spec.task, show_cache=shown)
        self._count("rest", len(found), started)
        return 200, self._headers(shown, "l2", payload), payload

    async def _pipeline(
        self, headers: Headers, body: bytes, client_ip: str
    ) -> tuple[int, Headers, bytes] | None:
        """Only an answer with every image a hit, rendered by the pipeline's own code."""
        started = time.monotonic()
        spec = self._spec
        assert spec is not None
        try:
            req = pipeline_http.parse(body)
            images = pipeline.decode_images(req, self._settings.max_images_per_request)
        except OcrCacheError:  # the worker answers it, in the protocol's error form
            return None
        if req.profile or not images:
            return None
        found = await self._lookup(images, spec.pipeline_task_key)
        if found is None:
            return None
        answer = pipeline.render(req, found, spec.min_score, time.perf_counter())
        shown = self._shows_cache(headers, client_ip)
        payload = pipeline_http.render(answer)
        self._count("pipeline_http", len(found), started)
        return 200, self._headers(shown, answer.cache_tier, payload), payload

    async def _lookup(self, images: list[bytes], task_key: str) -> list[Outcome] | None:
        """Every image's verified L2 entry, or None (a miss, an unusable entry, Redis down):
        one MGET, the workers' breaker settings, their error counter."""
        spec, keys, counters = self._spec, self._keys, self._counters
        assert spec is not None and keys is not None and counters is not None
        if not self._breaker.allow():
            return None
        digests = [digest_image(data) for data in images]
        names = [keys.entry(digest, task_key) for digest in digests]
        try:
            if redis_client.is_cluster(self._redis):
                values = await self._redis.mget_nonatomic(names)
            else:
                values = await self._redis.mget(names)
        except (RedisError, OSError) as exc:
            if redis_client.server_answered(exc):  # as in app/cache/store.py
                self._breaker.success()
            else:
                self._breaker.failure()
            counters.redis_errors.labels(op="front_get", reason=exc.__class__.__name__).inc()
            log.warning("front Redis GET failed (%s); forwarding", exc.__class__.__name__)
            return None
        self._breaker.success()
        outcomes = []
        for digest, name, value in zip(digests, names, values, strict=True):
            entry = self._codec.decode(value, digest.sha256, spec.fingerprint, name)
            if entry is None:
                return None
            outcomes.append(Outcome(entry.result, CacheStatus.HIT, "l2"))
        return outcomes

    def _shows_cache(self, headers: Headers, client_ip: str) -> bool:
        """Whether this caller sees the cache status (app/protocols/trust.py)."""
        mapping = {}  # trust reads the headers only for the token
        if self._settings.cache_control_token:
            mapping = {name.decode("latin-1"): value.decode("latin-1") for name, value in headers}
        trusted = trust.is_trusted(client_ip, mapping, self._settings)
        return trust.shows_cache_status(trusted, self._settings)

    def _headers(self, shown: bool, tier: str, payload: bytes) -> Headers:
        """A worker's headers for the same answer (the front drops gunicorn's ``Server``)."""
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
                self._spec_mtime = mtime  # a spec that fails to load is not retried
                self._load(spec)
        return self._spec is not None

    def _load(self, spec: HitSpec) -> None:
        """The Redis client and the metrics on first use (the metrics folder is remade when
        gunicorn starts, and a spec exists only once a worker runs); all or nothing."""
        if self._redis is None:
            s = self._settings
            client = redis_client.connect(
                s.redis_url, s.redis_timeout_ms / 1000, s.redis_connect_timeout_ms / 1000,
                username=s.redis_username, password=s.redis_password,
                tls_ca_file=s.redis_tls_ca_file, tls_cert_file=s.redis_tls_cert_file,
                tls_key_file=s.redis_tls_key_file, asynchronous=True,
            )  # fmt: skip
            self._counters = _Counters.bind()
            self._redis = client
        self._keys = KeySpace(spec.key_prefix, spec.fingerprint)
        self._spec = spec
        log.info("answering L2 hits in the front (engine %s)", spec.fingerprint)

    def _count(self, protocol: str, images: int, started: float) -> None:
        counters = self._counters
        assert counters is not None
        counters.hits.inc(images)
        counters.l2.inc(images)
        front, requests, latency = counters.by_protocol[protocol]
        front.inc()
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
