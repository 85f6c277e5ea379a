"""Every setting, in sections: each component takes only its own section (``Settings.cache``,
``Settings.redis``, ``Settings.paddle``, ...), parsed once from the environment with the
names in this package's modules, a module per section or per few related ones
(``app/env.py``: parsers, secrets from ``{VAR}_FILE``, one-line errors). Imported by every
process.

docs/CONFIGURATION.md is generated from these declarations (``python -m app config-doc``;
``tests/test_config.py`` fails when it is stale). A removed setting that is still set stops
start-up with one line naming what replaces it (``REMOVED``).
"""

from __future__ import annotations

from app.config.access import ControlSettings, TenantSettings
from app.config.cache import CacheSettings, RedactionSettings
from app.config.doc import READ_ELSEWHERE, markdown
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
from app.config.settings import SECTIONS, Settings
from app.env import ConfigError, RateLimit

__all__ = [
    "ConfigError",
    "RateLimit",
    "Settings",
    "REMOVED",
    "SECTIONS",
    "READ_ELSEWHERE",
    "markdown",
    "CacheSettings",
    "ControlSettings",
    "DispatchSettings",
    "EdgeSettings",
    "EngineSettings",
    "GrpcSettings",
    "HunyuanSettings",
    "JobsSettings",
    "L3Settings",
    "LinesSettings",
    "OcrSettings",
    "PaddleSettings",
    "ProcessSettings",
    "ProtocolSettings",
    "RedactionSettings",
    "RedisSettings",
    "ServerSettings",
    "ServingSettings",
    "SimilarSettings",
    "TenantSettings",
]
