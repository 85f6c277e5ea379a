"""An engine wrapper that masks sensitive text in every result before anyone else sees it.

Wrapping the engine (rather than masking at render time) is what makes the guarantee hold
everywhere at once: the cache front door, L1, Redis, the single-flight waiters, every protocol
and the extraction index only ever receive the masked result. The policy digest joins the
inner engine's fingerprint, so entries made under another policy (or none) are other keys.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, TypeVar

from app.engines.base import Engine, OcrRequest, fingerprint_of
from app.engines.lines import LineStore
from app.redaction import RedactionPolicy, build_policy, install_log_redaction
from app.vocabulary import OcrLine, OcrParams, OcrResult


def with_redaction(engine: Engine, types: tuple[str, ...], patterns_file: str) -> Engine:
    """``engine`` itself when no policy is configured (``CACHE_REDACT`` and
    ``CACHE_REDACT_PATTERNS_FILE``); else wrapped, and the logs masked too."""
    policy = build_policy(types, patterns_file)
    if policy is None:
        return engine
    install_log_redaction(policy)
    return RedactingEngine(engine, policy)


T = TypeVar("T")


class RedactingEngine:
    """The inner engine, its results masked: its capabilities are the inner one's."""

    def __init__(self, inner: Engine, policy: RedactionPolicy) -> None:
        self._inner = inner
        self._policy = policy
        self.kind = inner.kind
        self.slots = inner.slots
        self.batching = inner.batching
        self.reads_decoded_pixels = inner.reads_decoded_pixels
        self.can_interject = inner.can_interject
        self.reuses_lines = inner.reuses_lines
        self.line_schema = inner.line_schema
        self._fingerprint = fingerprint_of({"engine": inner.fingerprint, "redact": policy.digest})

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def default_params(self) -> OcrParams:
        return self._inner.default_params

    def check_params(self, params: OcrParams) -> None:
        self._inner.check_params(params)

    def prepare(self) -> None:
        self._inner.prepare()

    def load(self) -> None:
        self._inner.load()

    def interject(self, call: Callable[[], T]) -> Future[T]:
        return self._inner.interject(call)

    def describe(self) -> dict[str, Any]:
        described = dict(self._inner.describe())
        described["fingerprint"] = self._fingerprint
        described["redaction"] = {"types": list(self._policy.names), "digest": self._policy.digest}
        return described

    def use_line_store(
        self, store: LineStore | None, storable: Callable[[str], bool] = lambda text: True
    ) -> None:
        """Line reuse for the inner engine (if it has it), keeping no text this policy would
        mask: such a crop is recognised every time (exact: its reading is then always the
        recognizer's own, masked here like any other), and its raw text never stored."""
        policy = self._policy
        self._inner.use_line_store(
            store, lambda text: policy.redact(text) == text and storable(text)
        )

    def recognize(self, request: OcrRequest) -> OcrResult:
        return redact_result(self._inner.recognize(request), self._policy)

    def recognize_many(self, requests: list[OcrRequest]) -> list[OcrResult]:
        """The inner engine's batch (or one call per image), each result masked."""
        results = self._inner.recognize_many(requests)
        return [redact_result(result, self._policy) for result in results]


def redact_result(result: OcrResult, policy: RedactionPolicy) -> OcrResult:
    lines = tuple(_redact_line(line, policy) for line in result.lines)
    text = policy.redact(result.text) if result.text is not None else None
    return replace(result, lines=lines, text=text)


def _redact_line(line: OcrLine, policy: RedactionPolicy) -> OcrLine:
    """The line's text masked, and its word tokens (``returnWordBox``) masked the same way:
    a card number split into four-digit words matches no pattern alone, so each word takes
    its slice of the masked line. A word not found in the line is masked whole when the
    line had anything to mask (fail closed)."""
    masked = policy.redact(line.text)
    if not line.words:
        return replace(line, text=masked)
    words, offset = [], 0
    for word, box in line.words:
        at = line.text.find(word, offset)
        if at < 0:
            hidden = masked != line.text
            word = "".join("*" if hidden and c.isalnum() else c for c in policy.redact(word))
        else:
            word, offset = masked[at : at + len(word)], at + len(word)
        words.append((word, box))
    return replace(line, text=masked, words=tuple(words))
