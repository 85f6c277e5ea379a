"""OCR engines behind one small interface (see ``base.Engine``)."""

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
