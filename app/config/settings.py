"""The whole configuration: ``Settings``, one field per section, read from the environment
by ``Settings.from_env()`` and checked as a whole."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from app.config.access import ControlSettings, TenantSettings
from app.config.cache import CacheSettings, RedactionSettings
from app.config.edge import EdgeSettings
from app.config.engine import DispatchSettings, EngineSettings
from app.config.engines import HunyuanSettings, PaddleSettings, ServingSettings
from app.config.jobs import JobsSettings
from app.config.l3 import L3Settings
from app.config.ocr import OcrSettings
from app.config.processes import ProcessSettings
from app.config.protocols import GrpcSettings, ProtocolSettings
from app.config.redis import RedisSettings
from app.config.removed import REMOVED
from app.config.reuse import LinesSettings, SimilarSettings
from app.config.server import ServerSettings
from app.env import ConfigError, Section

# The sections, in the order docs/CONFIGURATION.md lists them.
SECTIONS: dict[str, type[Section]] = {
    "server": ServerSettings,
    "processes": ProcessSettings,
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
    "jobs": JobsSettings,
}


@dataclass(frozen=True)
class Settings:
    """The service's configuration: one section per component (``Settings.from_env()``)."""

    server: ServerSettings = field(default_factory=ServerSettings)
    processes: ProcessSettings = field(default_factory=ProcessSettings)
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
    jobs: JobsSettings = field(default_factory=JobsSettings)

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
        if self.protocols.pipeline_service_name == "v2":
            raise ConfigError(
                "PIPELINE_SERVICE_NAME: v2 is the Open Inference Protocol's (/v2/...)"
            )
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
        dispatch = self.dispatch
        if dispatch.shard >= dispatch.shards:
            raise ConfigError(
                f"DISPATCH_SHARD: {dispatch.shard} is not a shard of DISPATCH_SHARDS="
                f"{dispatch.shards} (0 to {dispatch.shards - 1})"
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
        return self.server.web_threads + (self.grpc.threads if self.grpc.enabled else 0)

    def grpc_message_limit(self) -> int:
        """gRPC message limit (a server's requests; the serving engine's client, both ways):
        ``GRPC_MAX_MESSAGE_BYTES`` or ``MAX_REQUEST_BYTES``."""
        return self.grpc.max_message_bytes or self.server.max_request_bytes


def _locate(name: str) -> tuple[str, str]:
    """(section, attribute) of the setting read from variable ``name.upper()``."""
    var = name.upper()
    for section_name, section in SECTIONS.items():
        for f in section.variables():
            if f.metadata["env"] == var:
                return section_name, f.name
    raise TypeError(f"no setting is read from {var}")
