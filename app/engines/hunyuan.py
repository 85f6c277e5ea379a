"""HunyuanOCR served by vLLM's OpenAI-compatible API as the engine (``OCR_ENGINE=hunyuan``).

The miss path sends one chat completion per image, shaped as the model card prescribes: an
empty system message, then one user message holding the image as a ``data:`` URI and the
task's fixed prompt, greedy sampling. Prompts and sampling come from a versioned table (one
per model generation); the fingerprint covers engine kind, model name, pinned revision,
generation and that table, so a new revision or a prompt edit never serves old entries.

Calls go through the official ``openai`` client over one pooled HTTP client per worker,
sized to the threads that can call the engine at once. The client's own retries are off:
its policy also retries timeouts and every 5xx, which would multiply a slow generation's
wait past the request deadline. We retry transport errors, 429 and 503 a bounded number of
times with exponential backoff (honouring a short ``Retry-After``); a timeout is reported at
once (``EngineTimeout``); any other refusal is an ``EngineError``. Nothing failed is cached.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import httpx2
import openai
from PIL import Image

from app.engines import hunyuan_output as output
from app.engines.base import EngineBase, OcrRequest, fingerprint_of
from app.engines.retry import RetryPolicy, Transient
from app.engines.tasks import (
    EXTRACTION,
    FIELD_ARG,
    LANGUAGE_ARG,
    PARSING,
    SPOTTING,
    TRANSLATION,
    check_args,
)
from app.imaging import FORMATS
from app.vocabulary import (
    RESULT_SCHEMA_VERSION,
    EngineError,
    EngineTimeout,
    OcrParams,
    OcrResult,
    UnsupportedParams,
)

log = logging.getLogger(__name__)

# Bump when a prompt or a sampling setting changes (the table's digest is keyed too).
PROMPT_TABLE_VERSION = 1
TASKS = (SPOTTING, PARSING, EXTRACTION, TRANSLATION)

_TRANSLATE_10 = (
    "先提取文字，再将文字内容翻译为{language}。若是文档，则其中页眉、页脚忽略。"
    "公式用latex格式表示，表格用html格式表示。"
)
_TRANSLATE_15 = (
    "按照阅读顺序，提取图中文字，公式用latex格式表示，表格用markdown格式表示，"
    "再将文字内容翻译为{language}。"
)
# The card's worked extraction example uses this English wording; 1.5's table has no
# extraction entry, so both generations use it.
_EXTRACT = (
    "Extract the content of the fields: {fields} from the image and return it in JSON format."
)

# Official prompts. 1.0: the model card's application-oriented prompts (Chinese column);
# the card words translation into English, the Chinese target swaps the language name as
# 1.5's pair does. 1.5: the repository's fixed task table (spotting_json, doc_parse,
# trans_other2en / trans_other2zh).
PROMPTS: dict[str, dict[str, str]] = {
    "1.0": {
        SPOTTING: "检测并识别图片中的文字，将文本坐标格式化输出。",
        PARSING: (
            "提取文档图片中正文的所有信息用 markdown 格式表示，其中页眉、页脚部分忽略，"
            "表格用 html 格式表达，文档中公式用 latex 格式表示，按照阅读顺序组织进行解析。"
        ),
        EXTRACTION: _EXTRACT,
        f"{TRANSLATION}:en": _TRANSLATE_10.format(language="英文"),
        f"{TRANSLATION}:zh": _TRANSLATE_10.format(language="中文"),
    },
    "1.5": {
        SPOTTING: (
            "检测并识别图中所有的文字行，请按从上到下、从左到右的阅读顺序进行识别。 "
            "输出格式为 JSON 数组，每个元素必须包含："
            '"box": [xmin, ymin, xmax, ymax]（坐标需归一化到 [0, 1000] 范围内）；'
            '"text": "识别出的文字内容"。 '
            "注意：请直接输出 JSON 数组，不要包含任何多余的描述性文字。"
        ),
        PARSING: (
            "提取文档图片中正文的所有信息用markdown格式表示，其中页眉、页脚部分忽略，"
            "表格用html格式表达，文档中公式用latex格式表示，按照阅读顺序组织进行解析。"
        ),
        EXTRACTION: _EXTRACT,
        f"{TRANSLATION}:en": _TRANSLATE_15.format(language="英文"),
        f"{TRANSLATION}:zh": _TRANSLATE_15.format(language="中文"),
    },
}
# Sampling as each generation's card sets it: greedy (temperature 0). 1.0 (vLLM recipe):
# top_k 1, repetition_penalty 1.0. 1.5 (official client): top_p 1, top_k -1,
# repetition_penalty 1.08. vLLM-specific fields travel in extra_body.
SAMPLING: dict[str, dict[str, Any]] = {
    "1.0": {"temperature": 0.0, "extra_body": {"top_k": 1, "repetition_penalty": 1.0}},
    "1.5": {
        "temperature": 0.0,
        "top_p": 1.0,
        "extra_body": {"top_k": -1, "repetition_penalty": 1.08, "skip_special_tokens": True},
    },
}
# Formats sent as they came; anything else (and EXIF-rotated images) is sent as PNG of the
# decoded pixels, so the model sees exactly the image whose size converts its coordinates.
_MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}
_RETRY_STATUS = frozenset({429, 503})
_MAX_BACKOFF_SECONDS = 4.0


if TYPE_CHECKING:
    from app.config import HunyuanSettings, Settings


class HunyuanEngine(EngineBase):
    kind = "hunyuan"

    @classmethod
    def from_settings(cls, settings: Settings) -> HunyuanEngine:
        """As ``OCR_ENGINE=hunyuan`` configures it; every HTTP and gRPC thread of a worker
        may be waiting on the model at once (the connection pool's size)."""
        return cls(settings.hunyuan, pool_size=settings.engine_callers())

    def __init__(self, section: HunyuanSettings, pool_size: int) -> None:
        self._options = section
        generation = section.model_generation
        self._prompts = PROMPTS[generation]
        self._sampling = SAMPLING[generation]
        table = json.dumps([self._prompts, self._sampling], sort_keys=True, ensure_ascii=False)
        self._prompt_table = f"{generation}.{PROMPT_TABLE_VERSION}"
        identity = {
            "kind": self.kind,
            "schema": RESULT_SCHEMA_VERSION,
            "model": section.model,
            "revision": section.model_revision,
            "prompt_table": self._prompt_table,
            "prompt_table_digest": hashlib.sha256(table.encode()).hexdigest(),
            "max_tokens": section.max_tokens,
        }
        self._fingerprint = fingerprint_of(identity)
        # Spotting: what the line protocols (pdserving, PaddleX, gRPC) render.
        self._default_params = OcrParams(task=SPOTTING)
        self._api_key = section.api_key or "EMPTY"  # vLLM without --api-key: any key
        self.pool_size = pool_size
        # Transport errors, 429 and 503: 250 ms, doubling, jittered, Retry-After honoured.
        self._retry = RetryPolicy(
            section.retries, 0.25, _MAX_BACKOFF_SECONDS, jitter=0.25,
            what="vLLM unavailable",
        )  # fmt: skip
        self._client: openai.OpenAI | None = None
        self._model_checked = False
        self._lock = threading.Lock()

    def check_params(self, params: OcrParams) -> None:
        if params.task not in TASKS:
            raise UnsupportedParams(
                f"task {params.task!r} is not offered by OCR_ENGINE=hunyuan; "
                f"tasks: {', '.join(TASKS)}"
            )
        if replace(params, task=SPOTTING, task_args=()) != self._default_params:
            raise UnsupportedParams(
                "HunyuanOCR has no detection options; per-request OCR options are not "
                "supported by OCR_ENGINE=hunyuan"
            )
        check_args(params)

    def describe(self) -> dict[str, Any]:
        s = self._options
        return {
            "kind": self.kind,
            "fingerprint": self._fingerprint,
            "model": s.model,
            "revision": s.model_revision,
            "prompt_table": self._prompt_table,
            "url": s.base_url,
            "max_tokens": s.max_tokens,
            "tasks": list(TASKS),
        }

    def load(self) -> None:
        """Open the pool, then wait (up to HUNYUAN_STARTUP_WAIT_SECONDS) for vLLM to serve the
        configured model, so /readyz stays 503 while a fresh deployment downloads weights.

        A vLLM still unreachable after the wait does not fail the load: the front then serves
        cache hits and answers misses with an engine error until vLLM is back. A vLLM that
        serves another model, or refuses the key, does fail it (a configuration error).
        """
        client = self._ensure_client()
        if self._model_checked:
            return
        deadline = time.monotonic() + self._options.startup_wait_seconds
        while True:
            try:
                served = [m.id for m in client.models.list()]
                break
            except (openai.APIConnectionError, openai.InternalServerError) as exc:
                if time.monotonic() >= deadline:
                    log.warning(
                        "vLLM did not answer /v1/models (%s); misses fail until it does", exc
                    )
                    return
                time.sleep(max(0.01, min(2.0, deadline - time.monotonic())))
            except openai.APIStatusError as exc:
                raise EngineError(f"vLLM refused /v1/models: HTTP {exc.status_code}") from None
        if self._options.model not in served:
            raise EngineError(f"vLLM serves {served}, not HUNYUAN_MODEL={self._options.model!r}")
        self._model_checked = True

    def _ensure_client(self) -> openai.OpenAI:
        with self._lock:
            if self._client is None:
                s = self._options
                timeout = openai.Timeout(s.timeout_seconds, connect=s.connect_timeout_seconds)
                limits = httpx2.Limits(
                    max_connections=self.pool_size, max_keepalive_connections=self.pool_size
                )
                self._client = openai.OpenAI(
                    base_url=f"{s.base_url}/v1",
                    api_key=self._api_key,
                    timeout=timeout,
                    max_retries=0,  # see the module docstring
                    http_client=openai.DefaultHttpxClient(limits=limits, timeout=timeout),
                )
            return self._client

    def prompt(self, params: OcrParams) -> str:
        if params.task == EXTRACTION:
            quoted = ", ".join(f"'{name}'" for name in params.arg_values(FIELD_ARG))
            return self._prompts[EXTRACTION].format(fields=f"[{quoted}]")
        if params.task == TRANSLATION:
            (language,) = params.arg_values(LANGUAGE_ARG)
            return self._prompts[f"{TRANSLATION}:{language}"]
        return self._prompts[params.task]

    def recognize(self, request: OcrRequest) -> OcrResult:
        params = request.params
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": ""},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": _data_uri(request)}},
                    {"type": "text", "text": self.prompt(params)},
                ],
            },
        ]
        content = self._complete(messages)
        image = request.image
        try:
            if params.task == SPOTTING:
                lines = output.parse_spotting(content, image.width, image.height)
                return OcrResult(width=image.width, height=image.height, lines=lines)
            if params.task == EXTRACTION:
                text = output.parse_extraction(content, params.arg_values(FIELD_ARG))
            else:
                text = output.parse_text(content)
        except output.UnparseableOutput as exc:
            raise EngineError(
                f"HunyuanOCR answered an unusable {params.task} result: {exc}"
            ) from None
        return OcrResult(width=image.width, height=image.height, text=text)

    def _complete(self, messages: list[dict[str, Any]]) -> str:
        client = self._ensure_client()
        return self._retry.call(lambda: self._call(client, messages), log)

    def _call(self, client: openai.OpenAI, messages: list[dict[str, Any]]) -> str:
        try:
            response = client.chat.completions.create(
                model=self._options.model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=self._options.max_tokens,
                **self._sampling,
            )
        except openai.APITimeoutError:
            raise EngineTimeout("vLLM did not answer in time") from None
        except openai.APIConnectionError as exc:
            raise Transient(f"connection failed: {exc}") from None
        except openai.APIStatusError as exc:
            if exc.status_code in _RETRY_STATUS:
                raise Transient(f"HTTP {exc.status_code}", _retry_after(exc)) from None
            raise EngineError(f"vLLM refused the request: HTTP {exc.status_code}") from None
        if not response.choices:
            raise EngineError("vLLM answered no choices")
        choice = response.choices[0]
        if choice.finish_reason == "length":
            log.warning("HunyuanOCR stopped at HUNYUAN_MAX_TOKENS; the answer may be cut")
        return choice.message.content or ""


def _retry_after(exc: openai.APIStatusError) -> float | None:
    try:
        return float(exc.response.headers.get("retry-after", ""))
    except ValueError:
        return None


def _data_uri(request: OcrRequest) -> str:
    data, mime = request.data, None
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as img:
            rotated = img.getexif().get(0x0112, 1) not in (0, 1)  # EXIF orientation
            mime = None if rotated else _MIME.get(img.format or "")
    except Exception:  # malformed metadata raises anything: send the decoded pixels instead
        mime = None
    if mime is None:
        buf = io.BytesIO()
        Image.fromarray(request.image.pixels).save(buf, format="PNG")
        data, mime = buf.getvalue(), "image/png"
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
