"""A stand-in for ``vllm serve tencent/HunyuanOCR``: vLLM and the weights cannot run here.

It speaks the OpenAI chat-completions protocol on a loopback port and validates requests as
vLLM does (served model name, well-formed messages and content parts, ``data:`` image URIs
holding a decodable image, sampling ranges, bearer key), answering refusals with vLLM's
status codes and an OpenAI-style error body. Its answers are recorded-style: written by hand
from the corpus images and their ground truth in the shapes the model card shows (spotting
in the 1.0 text form or the 1.5 JSON form, markdown, a fenced JSON object, translated text),
chosen by matching the prompt against the card's own wording (kept here independently of
the engine's table). Tests can make it fail N times (503/429), stall, or answer anything.
Nothing here measures the real model's accuracy.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from PIL import Image

SERVED_MODEL = "tencent/HunyuanOCR"
MAX_MODEL_LEN = 32768
ROLES = {"system", "user", "assistant"}

# The card's prompts (README "Application-oriented prompts" and the 1.5 task table).
SPOTTING_10 = "检测并识别图片中的文字，将文本坐标格式化输出。"
SPOTTING_15_START = "检测并识别图中所有的文字行"
PARSING_MARKERS = ("提取文档图片中正文的所有信息",)
EXTRACTION = re.compile(
    r"^Extract the content of the fields: \[(?P<fields>.*)\] from the image and return it "
    r"in JSON format\.$"
)


@dataclass
class Recording:
    """What the model answers for one image (coordinates normalised to 0..1000)."""

    lines: list[tuple[str, tuple[int, int, int, int]]] = field(default_factory=list)
    markdown: str = ""
    fields: dict[str, str] = field(default_factory=dict)
    translations: dict[str, str] = field(default_factory=dict)


def _phototest() -> Recording:
    texts = [
        "This is a lot of 12 point text to test the",
        "ocr code and see if it works on all types",
        "of file format.",
        "The quick brown dog jumped over the",
        "lazy fox. The quick brown dog jumped",
        "over the lazy fox. The quick brown dog",
        "jumped over the lazy fox. The quick",
        "brown dog jumped over the lazy fox.",
    ]
    rights = [919, 967, 394, 914, 914, 930, 878, 883]
    lines = []
    for i, (text, right) in enumerate(zip(texts, rights, strict=True)):
        top = 187 + round(i * 61.5)
        lines.append((text, (56, top, right, top + 60)))
    markdown = (
        "This is a lot of 12 point text to test the ocr code and see if it works on all "
        "types of file format.\n\nThe quick brown dog jumped over the lazy fox. The quick "
        "brown dog jumped over the lazy fox. The quick brown dog jumped over the lazy fox. "
        "The quick brown dog jumped over the lazy fox."
    )
    translations = {
        "zh": "这是一段12磅大小的文字，用来测试OCR代码是否适用于所有类型的文件格式。\n\n"
        "敏捷的棕色狗跳过了懒狐狸。敏捷的棕色狗跳过了懒狐狸。",
        "en": markdown,
    }
    return Recording(lines=lines, markdown=markdown, translations=translations)


def _passport_fin() -> Recording:
    return Recording(
        lines=[
            ("SUOMI·FINLAND·FINLAND·FINLANDE", (309, 26, 925, 61)),
            ("XP8271602", (664, 131, 800, 164)),
            ("Virtanen", (309, 197, 433, 234)),
            ("Maria Olivia", (309, 270, 478, 307)),
        ],
        fields={
            "surname": "Virtanen",
            "given names": "Maria Olivia",
            "passport number": "XP8271602",
            "date of birth": "21.12.1971",
            "date of expiry": "21.08.2011",
            "sex": "F",
            "country code": "FIN",
        },
    )


class Corpus:
    """Recordings keyed by the MD5 of the image bytes the client sent."""

    def __init__(self, corpus_dir: Path) -> None:
        self.by_md5: dict[str, Recording] = {}
        for name, recording in (
            ("tesseract_phototest.png", _phototest()),
            ("passporteye_pass_fin.png", _passport_fin()),
        ):
            data = (corpus_dir / name).read_bytes()
            self.by_md5[hashlib.md5(data).hexdigest()] = recording


def answer(recording: Recording, prompt: str) -> str:
    """The recorded-style answer to ``prompt`` in the form the card shows for it."""
    if prompt == SPOTTING_10:
        return "".join(f"{t}({x1},{y1}),({x2},{y2})\n" for t, (x1, y1, x2, y2) in recording.lines)
    if prompt.startswith(SPOTTING_15_START):
        items = [{"box": list(box), "text": text} for text, box in recording.lines]
        return json.dumps(items, ensure_ascii=False, indent=1)
    if any(prompt.startswith(marker) for marker in PARSING_MARKERS):
        return recording.markdown
    match = EXTRACTION.match(prompt)
    if match:
        names = re.findall(r"'([^']*)'", match.group("fields"))
        body = {name: recording.fields.get(name, "") for name in names}
        return "```json\n" + json.dumps(body, ensure_ascii=False, indent=4) + "\n```"
    if "翻译为英文" in prompt:
        return recording.translations.get("en", "")
    if "翻译为中文" in prompt:
        return recording.translations.get("zh", "")
    return "I can see an image."  # what a chat model says to an unknown instruction


class Refusal(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def _number(body: dict[str, Any], name: str, lo: float, hi: float, lo_open: bool = False) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Refusal(400, f"{name} must be a number")
    if value < lo or value > hi or (lo_open and value == lo):
        raise Refusal(400, f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")


def _image(url: Any) -> bytes:
    if not isinstance(url, str):
        raise Refusal(400, "image_url.url must be a string")
    head, sep, payload = url.partition(",")
    if not url.startswith("data:image/") or not sep or not head.endswith(";base64"):
        raise Refusal(400, "only data:image/...;base64 URLs are served here (no fetching)")
    try:
        data = base64.b64decode(payload, validate=True)
        with Image.open(io.BytesIO(data)) as img:
            img.load()
    except (binascii.Error, ValueError, OSError):
        raise Refusal(400, "Failed to load image: invalid base64 image data") from None
    return data


def validate(body: Any, served_model: str) -> tuple[list[bytes], str]:
    """(images, last text part) of a chat request, or a ``Refusal`` as vLLM would give."""
    if not isinstance(body, dict):
        raise Refusal(400, "request body must be a JSON object")
    if body.get("model") != served_model:
        raise Refusal(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Refusal(400, "messages must be a non-empty list")
    images, text = [], ""
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise Refusal(400, f"unknown or missing role in message {message!r:.80}")
        content = message.get("content")
        if isinstance(content, str):
            text = content if message["role"] == "user" else text
            continue
        if not isinstance(content, list) or message["role"] != "user":
            raise Refusal(400, "content must be a string or (user) a list of parts")
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                text = part["text"]
            elif kind == "image_url" and isinstance(part.get("image_url"), dict):
                images.append(_image(part["image_url"].get("url")))
            else:
                raise Refusal(400, f"unsupported content part {part!r:.80}")
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0, lo_open=True)
    _number(body, "repetition_penalty", 0.0, 2.0, lo_open=True)
    top_k = body.get("top_k")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < -1):
        raise Refusal(400, "top_k must be -1 (disable), 0 (disable) or at least 1")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise Refusal(400, "max_tokens must be at least 1")
    if isinstance(max_tokens, int) and max_tokens > MAX_MODEL_LEN:
        raise Refusal(
            400,
            f"'max_tokens' is too large: {max_tokens}. This model's maximum context length "
            f"is {MAX_MODEL_LEN} tokens",
        )
    if body.get("n", 1) != 1 or body.get("stream"):
        raise Refusal(400, "this stand-in answers n=1 without streaming")
    return images, text


class FakeVllm:
    def __init__(
        self, corpus_dir: Path, served_model: str = SERVED_MODEL, api_key: str | None = None
    ) -> None:
        self.corpus = Corpus(corpus_dir)
        self.served_model = served_model
        self.api_key = api_key
        self.lock = threading.Lock()
        self.reset()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )

    def reset(self) -> None:
        with self.lock:
            self.calls = 0  # chat completion requests received, failed ones included
            self.bodies: list[dict[str, Any]] = []  # requests that were answered
            self.refusals: list[tuple[int, str]] = []
            self.failures: list[tuple[int, dict[str, str]]] = []
            self.delay = 0.0
            self.respond: Callable[[bytes, str], str] | None = None
            self.in_flight = self.max_in_flight = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def fail_next(self, count: int, status: int = 503, retry_after: str | None = None) -> None:
        headers = {"Retry-After": retry_after} if retry_after else {}
        with self.lock:
            self.failures.extend([(status, headers)] * count)

    def start(self) -> FakeVllm:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def complete(self, body: Any) -> dict[str, Any]:
        images, prompt = validate(body, self.served_model)
        if len(images) != 1:
            raise Refusal(400, "HunyuanOCR is asked about exactly one image per request here")
        if self.respond is not None:
            content = self.respond(images[0], prompt)
        else:
            recording = self.corpus.by_md5.get(hashlib.md5(images[0]).hexdigest(), Recording())
            content = answer(recording, prompt)
        with self.lock:
            self.bodies.append(body)
        return {
            "id": f"chatcmpl-fake-{len(self.bodies)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.served_model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100},
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def _send(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for key, value in (headers or {}).items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

            def _error(self, status: int, message: str, kind: str, headers: Any = None) -> None:
                error = {"message": message, "type": kind, "param": None, "code": status}
                self._send(status, {"error": error}, headers)

            def _authorized(self) -> bool:
                if fake.api_key is None:
                    return True
                if self.headers.get("Authorization") == f"Bearer {fake.api_key}":
                    return True
                self._error(401, "Unauthorized", "AuthenticationError")
                return False

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/v1/models" and self._authorized():
                    model = {"id": fake.served_model, "object": "model", "owned_by": "vllm"}
                    self._send(200, {"object": "list", "data": [model]})
                elif self.path != "/v1/models":
                    self._error(404, "Not Found", "NotFoundError")

            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/v1/chat/completions":
                    self._error(404, "Not Found", "NotFoundError")
                    return
                with fake.lock:
                    fake.calls += 1
                    failure = fake.failures.pop(0) if fake.failures else None
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                    delay = fake.delay
                try:
                    if not self._authorized():
                        return
                    if failure is not None:
                        status, headers = failure
                        kind = "RateLimitError" if status == 429 else "ServiceUnavailableError"
                        self._error(status, "try again later", kind, headers)
                        return
                    time.sleep(delay)
                    try:
                        self._send(200, fake.complete(json.loads(raw)))
                    except json.JSONDecodeError:
                        self._error(400, "body is not JSON", "BadRequestError")
                    except Refusal as exc:
                        with fake.lock:
                            fake.refusals.append((exc.status, str(exc)))
                        self._error(exc.status, str(exc), exc.kind)
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

        return Handler
