"""The wire protocols and their input limits: ``Settings.grpc``, ``Settings.protocols``."""

from __future__ import annotations

from dataclasses import dataclass

from app import env as e
from app.env import Section, env


@dataclass(frozen=True)
class GrpcSettings(Section):
    TITLE = "gRPC"

    enabled: bool = env("GRPC_ENABLED", e.boolean, True, "the gRPC server in every worker")
    max_message_bytes: int = env(
        "GRPC_MAX_MESSAGE_BYTES",
        e.integer(0, (1 << 31) - 1),
        0,
        "the largest gRPC request (the serving engine's client: both ways) (0: `MAX_REQUEST_BYTES`); answers up to 2 GiB",
    )
    threads: int = env(
        "GRPC_THREADS",
        e.integer(1, 256),
        32,
        "gRPC's threads per front worker: RPCs served at once, a miss waiting for an engine holding one",
    )
    max_concurrent_rpcs: int = env(
        "GRPC_MAX_CONCURRENT_RPCS",
        e.integer(0, 100_000),
        0,
        "RPCs in progress or queued per worker before `RESOURCE_EXHAUSTED` (0: 4 x `GRPC_THREADS`)",
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
