"""All settings, read from the environment in one place.

Every variable is parsed and validated here; a bad value raises ``ConfigError`` with a
one-line message naming the variable, which the entry point prints before exiting.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from app import redis_url
from app.redaction import PolicyError, load_patterns, parse_names
from app.vocabulary import DETECTION_PARAMS, OcrCacheError, OcrParams

T = TypeVar("T")


# The detection parameters' defaults are OcrParams' (one source; vocabulary.DETECTION_PARAMS).
_PARAMS = OcrParams()


class ConfigError(OcrCacheError, ValueError):
    """A setting has a value the service cannot run with."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}: expected true/false, got {raw!r}")


def _int(lo: int, hi: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None
        if not lo <= value <= hi:
            raise ConfigError(f"{name}: expected an integer in {lo}..{hi}, got {value}")
        return value

    return parse


def _float(lo: float, hi: float) -> Callable[[str, str], float]:
    def parse(name: str, raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise ConfigError(f"{name}: expected a number, got {raw!r}") from None
        if not lo <= value <= hi:
            raise ConfigError(f"{name}: expected a number in {lo}..{hi}, got {value}")
        return value

    return parse


def _choice(*options: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in options:
            raise ConfigError(f"{name}: expected one of {'|'.join(options)}, got {raw!r}")
        return value

    return parse


def _text(name: str, raw: str) -> str:
    return raw.strip()


def _prefix(name: str, raw: str) -> str:
    value = raw.strip()
    if not value or any(c.isspace() for c in value) or len(value) > 64:
        raise ConfigError(f"{name}: expected 1..64 characters without spaces, got {raw!r}")
    return value


def _redis_url(name: str, raw: str) -> str:
    value = raw.strip()
    schemes = ("redis://", "rediss://", "unix://", "redis+sentinel://", "redis+cluster://")
    if value and not value.startswith(schemes):
        raise ConfigError(f"{name}: expected one of {', '.join(schemes)} URLs")
    if value.startswith(("redis+sentinel://", "redis+cluster://")):
        try:
            redis_url.parse(value)
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    return value


def _serving_url(name: str, raw: str) -> str:
    value = raw.strip().rstrip("/")
    if value and not value.startswith(("grpc://", "http://", "https://")):
        raise ConfigError(f"{name}: expected grpc://host:port or http(s)://host:port")
    return value


def _http_url(name: str, raw: str) -> str:
    value = raw.strip().rstrip("/")
    if value and not value.startswith(("http://", "https://")):
        raise ConfigError(f"{name}: expected http(s)://host:port")
    return value


def _s3_url(name: str, raw: str) -> str:
    """``s3://bucket[/prefix]``: a valid bucket name (3-63 of [a-z0-9.-]), an optional prefix."""
    value = raw.strip().rstrip("/")
    if not value:
        return ""
    bucket, _, prefix = value.removeprefix("s3://").partition("/")
    valid = 3 <= len(bucket) <= 63 and all(c.islower() or c.isdigit() or c in ".-" for c in bucket)
    if not value.startswith("s3://") or not valid or bucket[0] in ".-" or "//" in f"/{prefix}":
        raise ConfigError(f"{name}: expected s3://bucket[/prefix] (bucket: 3-63 of a-z 0-9 . -)")
    return value


def _commit(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value and (len(value) != 40 or any(c not in "0123456789abcdef" for c in value)):
        raise ConfigError(
            f"{name}: expected a 40-character commit hash (a branch or tag can move), got {raw!r}"
        )
    return value


def _redact_types(name: str, raw: str) -> tuple[str, ...]:
    try:
        return parse_names(raw)
    except PolicyError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _redact_patterns_file(name: str, raw: str) -> str:
    try:
        load_patterns(raw.strip())
    except PolicyError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    return raw.strip()


def _log_level(name: str, raw: str) -> str:
    return _choice("debug", "info", "warning", "error", "critical")(name, raw).upper()


@dataclass(frozen=True)
class RateLimit:
    """``RATE_LIMIT=RPS[:BURST]``: a client may send ``rate`` requests per second on average
    and ``burst`` more at once (nginx's ``limit_req ... burst=N nodelay``)."""

    rate: float
    burst: int

    def retry_after(self) -> int:
        """Whole seconds until one more request is allowed (``Retry-After``)."""
        return max(1, math.ceil(1 / self.rate))

    def __str__(self) -> str:
        return f"{self.rate:g}:{self.burst}"


def _rate_limit(name: str, raw: str) -> RateLimit:
    rate_text, _, burst_text = raw.strip().partition(":")
    try:
        rate = float(rate_text)
        burst = int(burst_text) if burst_text else 0
    except ValueError:
        raise ConfigError(f"{name}: expected RPS[:BURST], e.g. 20:40, got {raw!r}") from None
    if not 1 / 60 <= rate <= 100_000 or not 0 <= burst <= 1_000_000:
        raise ConfigError(f"{name}: RPS must be in 1/60..100000 and BURST in 0..1000000")
    return RateLimit(rate, burst)


# Settings that are gone, and what to do instead: still set, they stop start-up.
REMOVED = {
    "HTTP_FRONT": "nginx is the edge now (EDGE=nginx); behind another buffering proxy set "
    "EDGE=none",
    "HTTP_FRONT_HITS": "hits are answered by the workers' one hit path behind nginx; unset it",
    "HTTP_FRONT_PROCESSES": "the edge's processes are EDGE_WORKERS (nginx worker_processes)",
}


def env(var: str, parse: Callable[[str, str], Any], default: Any) -> Any:
    """A dataclass field read from environment variable ``var``."""
    return field(default=default, metadata={"env": var, "parse": parse})


def secret(var: str, parse: Callable[[str, str], Any], default: Any) -> Any:
    """A secret: from ``var`` or from the file named by ``{var}_FILE`` (Kubernetes/Docker
    secrets); never in the settings' repr, never printed."""
    return field(default=default, repr=False, metadata={"env": var, "parse": parse, "secret": True})


def _encryption_keys(name: str, raw: str) -> tuple[tuple[str, bytes], ...]:
    """``kid:base64key[,kid:base64key...]``; AES key sizes only; the first one encrypts."""
    keys = []
    for item in raw.split(","):
        kid, sep, encoded = item.strip().partition(":")
        if not sep or not kid or len(kid) > 32 or not all(c.isalnum() or c in "-_" for c in kid):
            raise ConfigError(f"{name}: expected kid:base64key items (kid: 1-32 of [A-Za-z0-9_-])")
        try:
            key = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"{name}: key {kid!r} is not valid base64") from None
        if len(key) not in (16, 24, 32):
            raise ConfigError(f"{name}: key {kid!r} must be 16, 24 or 32 bytes (AES)")
        if any(kid == existing for existing, _ in keys):
            raise ConfigError(f"{name}: key id {kid!r} appears twice")
        keys.append((kid, key))
    return tuple(keys)


def _token(name: str, raw: str) -> str:
    value = raw.strip()
    if len(value) < 16:
        raise ConfigError(f"{name}: must be at least 16 characters")
    return value


def _header_name(name: str, raw: str) -> str:
    value = raw.strip()
    if value and not all(c.isalnum() or c == "-" for c in value):
        raise ConfigError(f"{name}: expected an HTTP header name, got {raw!r}")
    return value


def _networks(name: str, raw: str) -> tuple[Any, ...]:
    """Comma-separated CIDRs or addresses (``10.0.0.0/8, 192.168.1.7, fd00::/8``)."""
    import ipaddress

    try:
        return tuple(
            ipaddress.ip_network(item.strip(), strict=False)
            for item in raw.split(",")
            if item.strip()
        )
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _existing_file(name: str, raw: str) -> str:
    value = raw.strip()
    if value and not os.path.isfile(value):
        raise ConfigError(f"{name}: no such file {value!r}")
    return value


def _read_secret_file(var: str, path: str) -> str | None:
    if not path.strip():
        return None
    try:
        with open(path.strip(), encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"{var}: cannot read {path.strip()!r}: {exc.strerror}") from None


@dataclass(frozen=True)
class Settings:
    """The service's configuration; build it with ``Settings.from_env()``."""

    host: str = env("HOST", _text, "0.0.0.0")
    http_port: int = env("HTTP_PORT", _int(1, 65535), 9998)
    grpc_port: int = env("GRPC_PORT", _int(1, 65535), 18091)
    log_level: str = env("LOG_LEVEL", _log_level, "INFO")
    web_concurrency: int = env("WEB_CONCURRENCY", _int(1, 64), 2)
    web_threads: int = env("WEB_THREADS", _int(1, 256), 8)
    request_timeout_seconds: int = env("REQUEST_TIMEOUT_SECONDS", _int(1, 3600), 120)
    max_request_bytes: int = env("MAX_REQUEST_BYTES", _int(1024, 1 << 30), 20 * 1024 * 1024)
    max_image_pixels: int = env("MAX_IMAGE_PIXELS", _int(1, 1 << 31), 60_000_000)
    pipeline_service_name: str = env("PIPELINE_SERVICE_NAME", _prefix, "ocr")
    # The edge (app/edge.py): nginx on HOST:HTTP_PORT in front of gunicorn's unix socket.
    # nginx: `python -m app serve` starts it; external: gunicorn listens on EDGE_SOCKET for an
    # nginx run elsewhere (`python -m app edge`, the pod's edge container); none: gunicorn on
    # HOST:HTTP_PORT itself, behind another buffering proxy.
    edge: str = env("EDGE", _choice("nginx", "external", "none"), "nginx")
    edge_socket: str = env("EDGE_SOCKET", _text, "")  # empty: a private folder (EDGE=nginx)
    edge_nginx: str = env("EDGE_NGINX", _text, "")  # the nginx binary; empty: found (app/edge.py)
    edge_workers: int = env("EDGE_WORKERS", _int(1, 64), 1)  # nginx worker processes
    edge_access_log: bool = env("EDGE_ACCESS_LOG", _bool, True)  # JSON lines on stdout
    # A request's head must arrive within the first, each read of its body within the second.
    http_header_timeout_seconds: float = env(
        "HTTP_HEADER_TIMEOUT_SECONDS", _float(0.1, 3600.0), 10.0
    )
    http_body_timeout_seconds: float = env("HTTP_BODY_TIMEOUT_SECONDS", _float(0.1, 3600.0), 60.0)
    # Requests per second per client address, with a burst (nginx limit_req; gRPC counts in
    # Redis across workers and replicas). Unset: no limit.
    rate_limit: RateLimit | None = env("RATE_LIMIT", _rate_limit, None)
    # TLS at the edge (and HTTP/2 to clients): both files, or neither.
    tls_cert_file: str = env("TLS_CERT_FILE", _existing_file, "")
    tls_key_file: str = env("TLS_KEY_FILE", _existing_file, "")

    # Cache (L2 = Redis).
    redis_url: str = field(
        default="", repr=False, metadata={"env": "REDIS_URL", "parse": _redis_url}
    )  # may carry a password
    redis_username: str = env("REDIS_USERNAME", _text, "")
    redis_password: str = secret("REDIS_PASSWORD", _text, "")
    redis_tls_ca_file: str = env("REDIS_TLS_CA_FILE", _existing_file, "")
    redis_tls_cert_file: str = env("REDIS_TLS_CERT_FILE", _existing_file, "")
    redis_tls_key_file: str = env("REDIS_TLS_KEY_FILE", _existing_file, "")
    redis_timeout_ms: int = env("REDIS_TIMEOUT_MS", _int(1, 60_000), 50)
    redis_connect_timeout_ms: int = env("REDIS_CONNECT_TIMEOUT_MS", _int(1, 60_000), 50)
    redis_breaker_failures: int = env("REDIS_BREAKER_FAILURES", _int(1, 1000), 3)
    redis_breaker_cooldown_seconds: float = env(
        "REDIS_BREAKER_COOLDOWN_SECONDS", _float(0.0, 3600.0), 2.0
    )
    cache_enabled: bool = env("CACHE_ENABLED", _bool, True)
    cache_ttl_seconds: int = env("CACHE_TTL_SECONDS", _int(1, 10 * 365 * 86400), 86400)
    cache_ttl_jitter: float = env("CACHE_TTL_JITTER", _float(0.0, 0.5), 0.1)
    cache_key_prefix: str = env("CACHE_KEY_PREFIX", _prefix, "ocr")
    cache_ttl_max_seconds: int = env("CACHE_TTL_MAX_SECONDS", _int(1, 10 * 365 * 86400), 2_592_000)
    cache_tenant_header: str = env("CACHE_TENANT_HEADER", _header_name, "")
    cache_encryption_keys: tuple[tuple[str, bytes], ...] = secret(
        "CACHE_ENCRYPTION_KEYS", _encryption_keys, ()
    )
    admin_token: str = secret("ADMIN_TOKEN", _token, "")
    # Redaction (app/redaction.py): types masked in every answer and everything stored.
    cache_redact: tuple[str, ...] = env("CACHE_REDACT", _redact_types, ())
    cache_redact_patterns_file: str = env("CACHE_REDACT_PATTERNS_FILE", _redact_patterns_file, "")
    # Who may use the shared-state controls (app/protocols/trust.py); unset: everyone.
    trusted_networks: tuple[Any, ...] = env("TRUSTED_NETWORKS", _networks, ())
    cache_control_token: str = secret("CACHE_CONTROL_TOKEN", _token, "")
    cache_status_visible: str = env("CACHE_STATUS_VISIBLE", _choice("all", "trusted"), "all")
    cache_compress_min_bytes: int = env("CACHE_COMPRESS_MIN_BYTES", _int(0, 1 << 30), 256)
    # Near-duplicates (app/cache/near_dup.py): the similarity tier and its thresholds.
    cache_similar: bool = env("CACHE_SIMILAR", _bool, False)
    cache_similar_max_distance: int = env("CACHE_SIMILAR_MAX_DISTANCE", _int(0, 256), 40)
    cache_similar_max_aspect: float = env("CACHE_SIMILAR_MAX_ASPECT", _float(0.0, 100.0), 0.6)
    cache_similar_max_block: float = env("CACHE_SIMILAR_MAX_BLOCK", _float(0.0, 255.0), 12.0)
    cache_similar_max_line: float = env("CACHE_SIMILAR_MAX_LINE", _float(0.0, 100.0), 12.0)
    cache_l1_bytes: int = env("CACHE_L1_BYTES", _int(0, 1 << 40), 32 * 1024 * 1024)
    cache_l1_max_age_seconds: float = env("CACHE_L1_MAX_AGE_SECONDS", _float(0.0, 86400.0), 300.0)
    # Cross-process single-flight (a Redis lease per key being computed).
    singleflight_lease_ms: int = env("SINGLEFLIGHT_LEASE_MS", _int(100, 3_600_000), 10_000)
    singleflight_wait_seconds: float = env("SINGLEFLIGHT_WAIT_SECONDS", _float(0.0, 3600.0), 60.0)
    # Cold tier (L3, app/cache/l3.py): S3-compatible object storage, off when unset. Endpoint,
    # region and credentials come from the standard AWS variables (AWS_ENDPOINT_URL_S3, ...).
    cache_l3_url: str = env("CACHE_L3_URL", _s3_url, "")
    cache_l3_ttl_seconds: int = env("CACHE_L3_TTL_SECONDS", _int(1, 10 * 365 * 86400), 2_592_000)
    cache_l3_addressing: str = env(
        "CACHE_L3_ADDRESSING", _choice("auto", "path", "virtual"), "auto"
    )
    cache_l3_connect_timeout_ms: int = env("CACHE_L3_CONNECT_TIMEOUT_MS", _int(1, 60_000), 500)
    cache_l3_timeout_ms: int = env("CACHE_L3_TIMEOUT_MS", _int(1, 600_000), 1000)
    cache_l3_retries: int = env("CACHE_L3_RETRIES", _int(0, 10), 1)
    cache_l3_queue_max: int = env("CACHE_L3_QUEUE_MAX", _int(1, 1_000_000), 1000)
    cache_l3_breaker_failures: int = env("CACHE_L3_BREAKER_FAILURES", _int(1, 1000), 3)
    cache_l3_breaker_cooldown_seconds: float = env(
        "CACHE_L3_BREAKER_COOLDOWN_SECONDS", _float(0.0, 3600.0), 10.0
    )

    # Engine.
    ocr_engine: str = env("OCR_ENGINE", _choice("paddle", "serving", "hunyuan"), "paddle")
    ocr_device: str = env("OCR_DEVICE", _choice("cpu", "gpu"), "cpu")
    ocr_cpu_threads: int = env("OCR_CPU_THREADS", _int(1, 64), 1)
    ocr_timeout_seconds: float = env("OCR_TIMEOUT_SECONDS", _float(0.001, 3600.0), 60.0)
    engine_unready_after_failures: int = env("ENGINE_UNREADY_AFTER_FAILURES", _int(1, 1000), 5)
    # Engine calls waiting to start, per worker, before new ones get 503 (0: WEB_THREADS).
    engine_queue_max: int = env("ENGINE_QUEUE_MAX", _int(0, 100_000), 0)
    # Global miss dispatch (app/cache/dispatch.py): misses go to one Redis stream that every
    # idle engine pulls from. The queue holds DISPATCH_QUEUE_MAX waiting jobs per live engine
    # (0: ENGINE_QUEUE_MAX's bound); a job its consumer stopped touching for DISPATCH_CLAIM_MS
    # is reclaimed, at most DISPATCH_MAX_DELIVERIES times. ENGINE_BATCH_MAX: jobs per call.
    dispatch_enabled: bool = env("DISPATCH_ENABLED", _bool, True)
    dispatch_queue_max: int = env("DISPATCH_QUEUE_MAX", _int(0, 100_000), 0)
    dispatch_claim_ms: int = env("DISPATCH_CLAIM_MS", _int(100, 3_600_000), 10_000)
    dispatch_max_deliveries: int = env("DISPATCH_MAX_DELIVERIES", _int(1, 100), 3)
    engine_batch_max: int = env("ENGINE_BATCH_MAX", _int(1, 64), 1)
    ocr_model_dir: str = env("OCR_MODEL_DIR", _text, "")
    ocr_work_dir: str = env("OCR_WORK_DIR", _text, "")
    ocr_det_limit_side_len: int = env(
        "OCR_DET_LIMIT_SIDE_LEN", _int(32, 8192), _PARAMS.det_limit_side_len
    )
    ocr_det_limit_type: str = env(
        "OCR_DET_LIMIT_TYPE", _choice("max", "min"), _PARAMS.det_limit_type
    )
    ocr_det_thresh: float = env("OCR_DET_THRESH", _float(0.0, 1.0), _PARAMS.det_thresh)
    ocr_det_box_thresh: float = env("OCR_DET_BOX_THRESH", _float(0.0, 1.0), _PARAMS.det_box_thresh)
    ocr_det_unclip_ratio: float = env(
        "OCR_DET_UNCLIP_RATIO", _float(0.1, 10.0), _PARAMS.det_unclip_ratio
    )
    ocr_rec_score_thresh: float = env("OCR_REC_SCORE_THRESH", _float(0.0, 1.0), 0.5)
    ocr_textline_orientation: bool = env(
        "OCR_TEXTLINE_ORIENTATION", _bool, _PARAMS.textline_orientation
    )

    # Remote Paddle Serving pipeline (OCR_ENGINE=serving).
    serving_url: str = env("SERVING_URL", _serving_url, "")
    serving_service_name: str = env("SERVING_SERVICE_NAME", _prefix, "ocr")
    serving_model_version: str = env("SERVING_MODEL_VERSION", _text, "")
    serving_timeout_seconds: float = env("SERVING_TIMEOUT_SECONDS", _float(0.1, 3600.0), 60.0)
    serving_retries: int = env("SERVING_RETRIES", _int(0, 10), 2)

    # HunyuanOCR behind vLLM's OpenAI-compatible server (OCR_ENGINE=hunyuan).
    hunyuan_base_url: str = env("HUNYUAN_BASE_URL", _http_url, "")
    hunyuan_model: str = env("HUNYUAN_MODEL", _text, "tencent/HunyuanOCR")
    hunyuan_model_revision: str = env("HUNYUAN_MODEL_REVISION", _commit, "")
    # Which weights the revision holds: selects the prompt table and sampling settings.
    hunyuan_model_generation: str = env("HUNYUAN_MODEL_GENERATION", _choice("1.0", "1.5"), "1.5")
    hunyuan_task: str = env(
        "HUNYUAN_TASK", _choice("spotting", "parsing", "extraction", "translation"), "spotting"
    )
    hunyuan_target_language: str = env("HUNYUAN_TARGET_LANGUAGE", _choice("en", "zh"), "en")
    hunyuan_api_key: str = secret("HUNYUAN_API_KEY", _text, "")
    hunyuan_timeout_seconds: float = env("HUNYUAN_TIMEOUT_SECONDS", _float(0.1, 3600.0), 120.0)
    hunyuan_connect_timeout_seconds: float = env(
        "HUNYUAN_CONNECT_TIMEOUT_SECONDS", _float(0.1, 600.0), 5.0
    )
    hunyuan_retries: int = env("HUNYUAN_RETRIES", _int(0, 10), 2)
    hunyuan_max_tokens: int = env("HUNYUAN_MAX_TOKENS", _int(16, 131072), 16384)
    # How long /readyz waits at start-up for vLLM to list the model (it loads for minutes).
    hunyuan_startup_wait_seconds: float = env(
        "HUNYUAN_STARTUP_WAIT_SECONDS", _float(0.0, 3600.0), 900.0
    )

    # gRPC PipelineService.
    grpc_enabled: bool = env("GRPC_ENABLED", _bool, True)
    # 0: MAX_REQUEST_BYTES (the HTTP body limit; a gRPC message carries the same base64).
    grpc_max_message_bytes: int = env("GRPC_MAX_MESSAGE_BYTES", _int(0, (1 << 31) - 1), 0)
    # RPCs in progress or queued per worker before RESOURCE_EXHAUSTED (0: 4 x WEB_THREADS).
    grpc_max_concurrent_rpcs: int = env("GRPC_MAX_CONCURRENT_RPCS", _int(0, 100_000), 0)

    # PaddleX-style /ocr and multi-image requests.
    max_images_per_request: int = env("MAX_IMAGES_PER_REQUEST", _int(1, 1000), 16)
    pdf_max_pages: int = env("PDF_MAX_PAGES", _int(1, 1000), 10)
    pdf_render_scale: float = env("PDF_RENDER_SCALE", _float(0.5, 8.0), 2.0)
    url_input_allowed_hosts: str = env("URL_INPUT_ALLOWED_HOSTS", _text, "")
    # One deadline for a whole URL download (connect, headers, body): slow hosts cannot hold
    # a request thread.
    url_input_timeout_seconds: float = env("URL_INPUT_TIMEOUT_SECONDS", _float(0.1, 300.0), 10.0)
    # Upstream PaddleX keeps every line by default (0.0); pdserving drops below 0.5.
    paddlex_rec_score_thresh: float = env("PADDLEX_REC_SCORE_THRESH", _float(0.0, 1.0), 0.0)
    # Upstream's `Serving: visualize` (default true): ocrImage and inputImage unless a
    # request says "visualize": false. False turns them off unless a request asks.
    paddlex_visualize: bool = env("PADDLEX_VISUALIZE", _bool, True)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read every field from ``environ`` (default ``os.environ``); unset means default."""
        environ = os.environ if environ is None else environ
        for var, instead in REMOVED.items():
            if environ.get(var, "").strip():
                raise ConfigError(f"{var}: removed; {instead}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = f.metadata["env"]
            raw = environ.get(var)
            if (raw is None or not raw.strip()) and f.metadata.get("secret"):
                raw = _read_secret_file(f"{var}_FILE", environ.get(f"{var}_FILE", ""))
            if raw is not None and raw.strip() != "":
                values[f.name] = f.metadata["parse"](var, raw)
        return cls(**values)

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("TLS_CERT_FILE, TLS_KEY_FILE: set both or neither")
        if self.edge == "external" and not self.edge_socket:
            raise ConfigError("EDGE_SOCKET: required when EDGE=external (the socket nginx uses)")
        if self.tls_cert_file and self.edge == "none":
            raise ConfigError("TLS_CERT_FILE: TLS is served by the nginx edge, and EDGE=none")
        if self.ocr_engine == "serving" and not self.serving_url:
            raise ConfigError("SERVING_URL: required when OCR_ENGINE=serving")
        if self.ocr_engine == "hunyuan":
            if not self.hunyuan_base_url:
                raise ConfigError("HUNYUAN_BASE_URL: required when OCR_ENGINE=hunyuan")
            if not self.hunyuan_model:
                raise ConfigError("HUNYUAN_MODEL: required when OCR_ENGINE=hunyuan")
            if not self.hunyuan_model_revision:
                raise ConfigError(
                    "HUNYUAN_MODEL_REVISION: required when OCR_ENGINE=hunyuan (the hub name "
                    "points at newer weights over time; pin the commit vLLM serves)"
                )

    def default_task(self) -> str:
        """The task of a ``/v1/ocr`` request that names none."""
        return self.hunyuan_task if self.ocr_engine == "hunyuan" else "ocr"

    def is_secret(self, field_name: str) -> bool:
        return field_name == "redis_url" or any(
            f.name == field_name and f.metadata.get("secret") for f in fields(self)
        )

    def default_params(self) -> OcrParams:
        return OcrParams(**{name: getattr(self, f"ocr_{name}") for name in DETECTION_PARAMS})

    def engine_callers(self) -> int:
        """Threads of one worker that may call the engine at once: HTTP's, and gRPC's too."""
        return self.web_threads * (2 if self.grpc_enabled else 1)

    def grpc_message_limit(self) -> int:
        """gRPC message limit, both ways: ``GRPC_MAX_MESSAGE_BYTES`` or ``MAX_REQUEST_BYTES``."""
        return self.grpc_max_message_bytes or self.max_request_bytes

    def url_hosts(self) -> frozenset[str]:
        return frozenset(
            h.strip().lower() for h in self.url_input_allowed_hosts.split(",") if h.strip()
        )

    def with_overrides(self, **changes: Any) -> Settings:
        return replace(self, **changes)

    def env_name(self, field_name: str) -> str:
        return next(f.metadata["env"] for f in fields(self) if f.name == field_name)
