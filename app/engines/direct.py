"""The engines' direct endpoint, both ends of the wire: a front's ``EngineProxy`` and the
format an engine process reads (``app/engine_process.py``).

A front holds no engine. Its misses go through the Redis queue to engine processes (which
may be none yet: a miss waits there for one to start); only when there is no queue to use
(Redis down, caching off; ``no-cache``/``no-store`` requests) does it call an engine process
directly, over ``POST /internal/v1/recognize`` on ``ENGINE_PORT``,
with the shared ``ENGINE_TOKEN``. The proxy carries the configured engine's identity
(fingerprint, parameters, description: computed from the model files, nothing loaded), so
a front keys and renders exactly as an engine would, and its calls are the engine's.

The body names its ``format``: an engine never misreads a request of a version it does not
know (400), so two adjacent versions of fronts and engines coexist during an update.
"""

from __future__ import annotations

import base64
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import orjson
import requests
from requests.adapters import HTTPAdapter

from app import tracing
from app.engines.base import Engine, EngineBase, OcrRequest
from app.vocabulary import (
    ClientError,
    EngineBusy,
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    OcrParams,
    OcrResult,
)

PATH = "/internal/v1/recognize"
FORMAT = 1
RETRY_SECONDS = 0.25  # between rounds over the engines while none answers


def params_from_dict(raw: dict[str, Any]) -> OcrParams:
    """Raises ``ClientError`` on a shape ``OcrParams`` does not take."""
    try:
        return OcrParams.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise ClientError(f"malformed params: {exc}") from None


def encode_request(request: OcrRequest) -> bytes:
    return orjson.dumps(
        {
            "format": FORMAT,
            "image": base64.b64encode(request.data).decode(),
            "params": request.params.to_dict(),
            "namespace": request.namespace,
        }
    )


def decode_request(body: bytes) -> tuple[bytes, OcrParams, str]:
    """(image bytes, params, namespace) of a direct call; ``ClientError`` on anything else."""
    try:
        raw = orjson.loads(body)
        if not isinstance(raw, dict):
            raise ValueError("not an object")
        if raw.get("format") != FORMAT:
            known = f"this engine reads format {FORMAT}"
            raise ClientError(f"unknown request format {raw.get('format')!r} ({known})")
        data = base64.b64decode(raw["image"], validate=True)
        namespace = raw.get("namespace", "")
        if not isinstance(namespace, str) or not isinstance(raw.get("params"), dict):
            raise ValueError("bad field types")
    except ClientError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise ClientError(f"malformed direct call: {exc}") from None
    return data, params_from_dict(raw["params"]), namespace


class EngineProxy(EngineBase):
    """A front's engine: the identity of ``engine`` (never loaded), its calls sent to the
    engine processes at ``urls`` in turn. An engine that refuses the connection is skipped;
    when none answers, ``EngineUnavailable`` (503, gRPC UNAVAILABLE) at once, or after
    ``wait_seconds`` of retries (``ENGINE_WAIT_SECONDS``): an engine Service scaled to zero
    refuses every connection."""

    def __init__(
        self,
        engine: Engine,
        urls: Sequence[str],
        token: str,
        timeout_seconds: float,
        wait_seconds: float,
        connections: int = 16,
    ) -> None:
        self._identity = engine
        self.kind = engine.kind
        self._fingerprint = engine.fingerprint
        self._default_params = engine.default_params
        self.reads_decoded_pixels = engine.reads_decoded_pixels
        self._urls = [url.rstrip("/") + PATH for url in urls]
        self._token = token
        self._timeout = timeout_seconds
        self._wait = wait_seconds
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._session = requests.Session()
        adapter = HTTPAdapter(pool_connections=max(1, len(urls)), pool_maxsize=connections)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)

    def describe(self) -> dict[str, Any]:
        return self._identity.describe()

    def check_params(self, params: OcrParams) -> None:
        self._identity.check_params(params)

    def load(self) -> None:
        """Nothing to load: the models live in the engine processes."""

    def recognize(self, request: OcrRequest) -> OcrResult:
        if not self._urls or not self._token:
            raise EngineUnavailable(
                "no engine is reachable: the queue is unavailable and ENGINE_URLS/ENGINE_TOKEN "
                "are not set",
                5,
            )
        body = encode_request(request)
        deadline = time.monotonic() + self._wait
        busy: EngineBusy | None = None
        while True:
            for url in self._order():
                try:
                    return self._call(url, body)
                except EngineBusy as exc:
                    busy = exc  # another engine may have room
                except requests.ConnectionError:
                    continue  # not running (restarting, retired, or never started)
            if busy is not None:
                raise busy
            if time.monotonic() >= deadline:
                raise EngineUnavailable(
                    f"no engine process answered within ENGINE_WAIT_SECONDS={self._wait:g}", 5
                )
            time.sleep(RETRY_SECONDS)

    def _order(self) -> list[str]:
        """Every engine, starting one further each call (spreads the calls)."""
        with self._lock:
            start = next(self._turn) % len(self._urls)
        return self._urls[start:] + self._urls[:start]

    def _call(self, url: str, body: bytes) -> OcrResult:
        headers = {"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"}
        headers.update(tracing.TRACER.current().carrier())  # the engine's span joins the trace
        try:
            response = self._session.post(
                url, data=body, headers=headers, timeout=(2.0, self._timeout)
            )
        except requests.ReadTimeout:
            raise EngineTimeout(f"the engine took longer than {self._timeout:g} s") from None
        if response.status_code == 200:
            try:
                return OcrResult.from_dict(orjson.loads(response.content)["result"])
            except (ValueError, KeyError, TypeError) as exc:
                raise EngineError(f"malformed answer from the engine: {exc}") from None
        message = _message(response)
        if response.status_code == 503:
            retry = int(response.headers.get("Retry-After", "1") or 1)
            raise EngineBusy(message, max(1, retry))
        if response.status_code == 504:
            raise EngineTimeout(message)
        if response.status_code == 400:
            raise ClientError(message)
        if response.status_code in (401, 403, 404):
            raise EngineError(f"the engine refused this front ({response.status_code}): {message}")
        raise EngineError(message)


def _message(response: requests.Response) -> str:
    try:
        error = orjson.loads(response.content)["error"]
        return str(error.get("message") or error.get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"engine answered {response.status_code}"
