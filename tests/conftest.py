"""Shared fixtures: a private Redis server per session, one real PaddleOCR engine per
session, and apps built with the factory against them. Nothing here is a fake."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from app.config import Settings
from app.embedded_redis import EmbeddedRedis
from app.engines.paddle import PaddleOcrEngine

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("OCR_SHARED_DIR", ROOT.parent / "shared"))
CORPUS = SHARED / "corpus"

# Small real images that keep the suite fast (word crops and one text page).
PHOTOTEST = CORPUS / "tesseract_phototest.png"
WORD_EN = CORPUS / "paddleocr_word_en_1.png"
WORD_CH = CORPUS / "paddleocr_word_ch_4.jpg"
SHORT = CORPUS / "rapidocr_short.png"


def corpus_bytes(path: Path) -> bytes:
    return path.read_bytes()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture()
def redis_client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def base_settings(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Settings:
    return Settings.from_env({}).with_overrides(
        redis_url=redis_server.url,
        ocr_work_dir=str(tmp_path_factory.mktemp("models")),
        request_timeout_seconds=120,
    )


@pytest.fixture(scope="session")
def engine(base_settings: Settings) -> PaddleOcrEngine:
    eng = PaddleOcrEngine(base_settings)
    eng.load()
    return eng


@pytest.fixture()
def make_app(
    base_settings: Settings, engine: PaddleOcrEngine, redis_client: redis.Redis
) -> Callable[..., object]:
    from app.web import create_app

    def factory(engine_override: object | None = None, **overrides: object):  # type: ignore[no-untyped-def]
        app = create_app(
            base_settings.with_overrides(**overrides), engine=engine_override or engine
        )
        app.testing = True
        return app

    return factory


@pytest.fixture()
def client(make_app: Callable[..., object]):  # type: ignore[no-untyped-def]
    return make_app().test_client()  # type: ignore[attr-defined]
