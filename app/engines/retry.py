"""One retry policy for the remote engines (tenacity): only what ``Transient`` marks is
retried (a transport error, HTTP 429 or 503, gRPC UNAVAILABLE), a bounded number of times,
with capped exponential backoff that honours a server's ``Retry-After`` up to the cap.
Timeouts and refusals are never retried: they reach the caller as they were raised."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import tenacity

from app.vocabulary import EngineError, OcrCacheError

T = TypeVar("T")


class Transient(OcrCacheError):
    """A failure worth retrying; ``retry_after`` is the server's hint in seconds, if any."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


@dataclass(frozen=True)
class RetryPolicy:
    retries: int  # after the first attempt (SERVING_RETRIES, HUNYUAN_RETRIES)
    first_backoff: float  # seconds before the first retry; doubles each time
    max_backoff: float  # cap on every wait, Retry-After included
    jitter: float = 0.0  # each wait is shortened by up to this fraction, at random
    what: str = "engine backend unavailable"  # the EngineError's and the logs' words
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False, compare=False)

    def call(self, fn: Callable[[], T], log: logging.Logger) -> T:
        attempts = self.retries + 1

        def wait(state: tenacity.RetryCallState) -> float:
            backoff = min(self.first_backoff * 2 ** (state.attempt_number - 1), self.max_backoff)
            backoff *= random.uniform(1 - self.jitter, 1) if self.jitter else 1
            exc = state.outcome.exception() if state.outcome else None
            hint = (exc.retry_after if isinstance(exc, Transient) else None) or 0.0
            return min(max(backoff, hint), self.max_backoff)

        def warn(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("%s (attempt %d/%d): %s", self.what, state.attempt_number, attempts, exc)

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(attempts),
            wait=wait,
            retry=tenacity.retry_if_exception_type(Transient),
            after=warn,
            reraise=True,
            sleep=self.sleep,
        )
        try:
            return retrying(fn)
        except Transient as exc:
            raise EngineError(f"{self.what}: {exc}") from None
