"""A remote Paddle Serving OCR pipeline as the engine (``OCR_ENGINE=serving``).

The miss path sends the original image bytes to ``SERVING_URL`` (``grpc://host:port`` or
``http://host:port``) in the pdserving form and parses the answer's string with
``ast.literal_eval`` (never ``eval``). Transport errors are retried a bounded number of
times; timeouts and application errors are not. The backend's identity (URL, service name,
configured model version) is the engine fingerprint, so pointing at another backend or
model version never serves the old entries.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from typing import TYPE_CHECKING, Any

import requests
from requests.adapters import HTTPAdapter

from app.engines.base import EngineBase, OcrRequest, fingerprint_of
from app.engines.retry import RetryPolicy, Transient
from app.engines.tasks import require_ocr
from app.protocols.pdserving import parse_result_string
from app.vocabulary import (
    RESULT_SCHEMA_VERSION,
    EngineError,
    EngineTimeout,
    OcrParams,
    OcrResult,
    UnsupportedParams,
)

log = logging.getLogger(__name__)


if TYPE_CHECKING:
    from app.config import ServingSettings, Settings


class ServingEngine(EngineBase):
    kind = "serving"

    @classmethod
    def from_settings(cls, settings: Settings) -> ServingEngine:
        """As ``OCR_ENGINE=serving`` configures it (the wiring's and the tests' way in)."""
        return cls(
            settings.serving, settings.ocr.params(),
            message_limit=settings.grpc_message_limit(), pool_size=settings.server.web_threads,
        )  # fmt: skip

    def __init__(
        self,
        section: ServingSettings,
        default_params: OcrParams,
        message_limit: int,
        pool_size: int,
    ) -> None:
        """``message_limit``: the gRPC message size both ways; ``pool_size``: HTTP connections."""
        self._options = section
        self._message_limit = message_limit
        self._pool_size = pool_size
        self._url = section.url
        self._grpc = self._url.startswith("grpc://")
        identity = {
            "kind": self.kind,
            "schema": RESULT_SCHEMA_VERSION,
            "url": self._url,
            "service": section.service_name,
            "model_version": section.model_version,
        }
        self._fingerprint = fingerprint_of(identity)
        self._default_params = default_params
        # Connection refused/reset and UNAVAILABLE only: 50 ms, doubling, at most 1 s apart.
        self._retry = RetryPolicy(section.retries, 0.05, 1.0, what="serving backend unreachable")
        self._lock = threading.Lock()
        self._stub: Any = None
        self._session: requests.Session | None = None

    def check_params(self, params: OcrParams) -> None:
        require_ocr(params, self.kind)
        if params != self._default_params:
            raise UnsupportedParams(
                "the remote Paddle Serving pipeline runs with its own configuration; "
                "per-request OCR options are not supported by OCR_ENGINE=serving"
            )

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "fingerprint": self._fingerprint,
            "url": self._url,
            "service": self._options.service_name,
            "model_version": self._options.model_version,
        }

    def load(self) -> None:
        """Open the connection pool (a gRPC channel, or a pooled HTTP session)."""
        with self._lock:
            if self._grpc and self._stub is None:
                import grpc

                from app.protocols.pipeline_stubs import message_size_options, pb2_grpc

                size = self._message_limit
                channel = grpc.insecure_channel(
                    self._url.removeprefix("grpc://"),
                    options=message_size_options(size),
                )
                self._stub = pb2_grpc.PipelineServiceStub(channel)
            elif not self._grpc and self._session is None:
                session = requests.Session()
                adapter = HTTPAdapter(pool_maxsize=self._pool_size, max_retries=0)
                session.mount("http://", adapter)
                session.mount("https://", adapter)
                self._session = session

    def recognize(self, request: OcrRequest) -> OcrResult:
        if self._stub is None and self._session is None:
            self.load()
        payload = base64.b64encode(request.data).decode()
        call = self._call_grpc if self._grpc else self._call_http
        key, value = self._retry.call(lambda: call(payload), log)
        try:
            lines = parse_result_string(value, key)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise EngineError("serving backend answered an unparseable result") from None
        image = request.image
        return OcrResult(width=image.width, height=image.height, lines=tuple(lines))

    def _call_grpc(self, payload: str) -> tuple[str, str]:
        import grpc

        from app.protocols.pipeline_stubs import pb2

        message = pb2.Request(key=["image"], value=[payload])
        try:
            reply = self._stub.inference(message, timeout=self._options.timeout_seconds)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                raise Transient(code.name) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise EngineTimeout("serving backend timed out") from None
            raise EngineError(f"serving backend failed: {code.name}") from None
        return _pick(reply.err_no, reply.err_msg, list(reply.key), list(reply.value))

    def _call_http(self, payload: str) -> tuple[str, str]:
        assert self._session is not None
        url = f"{self._url}/{self._options.service_name}/prediction"
        body = json.dumps({"key": ["image"], "value": [payload]})
        try:
            resp = self._session.post(url, data=body, timeout=self._options.timeout_seconds)
        except requests.ConnectionError as exc:
            if isinstance(exc, requests.ReadTimeout):
                raise EngineTimeout("serving backend timed out") from None
            raise Transient(exc.__class__.__name__) from None
        except requests.Timeout:
            raise EngineTimeout("serving backend timed out") from None
        if resp.status_code != 200:
            raise EngineError(f"serving backend answered HTTP {resp.status_code}")
        try:
            data = resp.json()
            return _pick(data["err_no"], data["err_msg"], data["key"], data["value"])
        except (ValueError, KeyError, TypeError):
            raise EngineError("serving backend answered malformed JSON") from None


def _pick(err_no: int, err_msg: str, keys: list[str], values: list[str]) -> tuple[str, str]:
    """The (key, value) holding the OCR result: ``result`` (text+box) or older ``res``."""
    if err_no != 0:
        raise EngineError(f"serving backend err_no {err_no}: {err_msg[:200]}")
    for wanted in ("result", "res"):
        if wanted in keys and keys.index(wanted) < len(values):
            return wanted, values[keys.index(wanted)]
    raise EngineError("serving backend answered no 'result' or 'res' key")
