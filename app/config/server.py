"""The listeners and the front processes: ``Settings.server``."""

from __future__ import annotations

from dataclasses import dataclass

from app import env as e
from app.env import Section, env


@dataclass(frozen=True)
class ServerSettings(Section):
    TITLE = "Listeners and front processes"
    INTRO = "Where the service listens and how its fronts run; timeouts and stopping: [DEPLOYMENT.md](DEPLOYMENT.md#run)."

    host: str = env(
        "HOST",
        e.text,
        "0.0.0.0",
        "where nginx (or the front's server with `EDGE=none`) and gRPC listen",
    )
    http_port: int = env(
        "HTTP_PORT",
        e.integer(1, 65535),
        9998,
        "HTTP: nginx's port (the front server's with `EDGE=none`)",
    )
    grpc_port: int = env(
        "GRPC_PORT",
        e.integer(1, 65535),
        18091,
        "gRPC, served by every front worker (`SO_REUSEPORT`), not through nginx",
    )
    log_level: str = env(
        "LOG_LEVEL",
        e.log_level,
        "INFO",
        "`debug`, `info`, `warning`, `error`, `critical`; `debug` also turns nginx's error log to `info`",
    )
    log_format: str = env(
        "LOG_FORMAT",
        e.choice("text", "json"),
        "text",
        "the service's own log lines: `json` is one object a line, with `trace_id` and `span_id` inside a traced request ([OBSERVABILITY.md](OBSERVABILITY.md))",
    )
    web_concurrency: int = env(
        "WEB_CONCURRENCY",
        e.integer(1, 64),
        2,
        "front worker processes (granian); none holds an engine",
    )
    web_threads: int = env(
        "WEB_THREADS",
        e.integer(1, 256),
        32,
        "HTTP threads per front worker (granian's blocking threads): more than the misses one may have waiting, so hits never queue behind them",
    )
    front_max_rss_mb: int = env(
        "FRONT_MAX_RSS_MB",
        e.integer(0, 10**6),
        512,
        "a front worker over this resident memory (2 samples, 5 s apart) is replaced once its requests finish (0: never)",
    )
    front_hung_seconds: int = env(
        "FRONT_HUNG_SECONDS",
        e.integer(0, 86400),
        0,
        "a front worker whose interpreter sent no heartbeat this long is killed and replaced (0: `REQUEST_TIMEOUT_SECONDS` + 30)",
    )
    request_timeout_seconds: int = env(
        "REQUEST_TIMEOUT_SECONDS",
        e.integer(1, 3600),
        120,
        "the longest a request may take and a graceful stop may drain; the front server's and nginx's timeouts follow it",
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
