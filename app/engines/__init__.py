"""OCR engines behind one small interface (``base.Engine``), imported by every process: the
interface, the redaction wrapper (``redacting``), line reuse's interface (``lines``), the task
set (``tasks``), the direct endpoint's two ends (``direct``: a front's ``EngineProxy``, the
format an engine process reads) and ``build_engine``, which imports the configured
implementation (``paddle``, ``serving``, ``hunyuan`` and their helpers) lazily. An engine
process, and the combined role, loads it (``prepare``/``load`` import Paddle and PaddleOCR);
a front builds it for its identity only (the fingerprint from the model files, the default
parameters, the description, the parameter checks), wraps it in the proxy and never loads
it, so no engine runtime is imported in a front (``tests/test_layers.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.config import Settings
    from app.engines.base import Engine


def build_engine(settings: Settings) -> Engine:
    """The engine named by ``OCR_ENGINE``; models are located now, loaded by ``load()``."""
    if settings.engine.kind == "paddle":
        from app.engines.paddle import PaddleOcrEngine

        return PaddleOcrEngine.from_settings(settings)
    if settings.engine.kind == "serving":
        from app.engines.serving import ServingEngine

        return ServingEngine.from_settings(settings)
    if settings.engine.kind == "hunyuan":
        from app.engines.hunyuan import HunyuanEngine

        return HunyuanEngine.from_settings(settings)
    raise ValueError(f"unknown engine {settings.engine.kind!r}")
