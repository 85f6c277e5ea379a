"""An engine wrapper that masks sensitive text in every result before anyone else sees it.

Wrapping the engine (rather than masking at render time) is what makes the guarantee hold
everywhere at once: the cache front door, L1, Redis, the single-flight waiters, every protocol
and the extraction index only ever receive the masked result. The policy digest joins the
inner engine's fingerprint, so entries made under another policy (or none) are other keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from app.engines.base import Engine, OcrRequest, fingerprint_of
from app.engines.lines import LineStore
from app.redaction import RedactionPolicy, build_policy, install_log_redaction
from app.vocabulary import OcrLine, OcrResult


def with_redaction(engine: Engine, types: tuple[str, ...], patterns_file: str) -> Engine:
    """``engine`` itself when no policy is configured (``CACHE_REDACT`` and
    ``CACHE_REDACT_PATTERNS_FILE``); else wrapped, and the logs masked too."""
    policy = build_policy(types, patterns_file)
    if policy is None:
        return engine
    install_log_redaction(policy)
    return RedactingEngine(engine, policy)


class RedactingEngine:
    def __init__(self, inner: Engine, policy: RedactionPolicy) -> None:
        self._inner = inner
        self._policy = policy
        self.kind = inner.kind
        self._fingerprint = fingerprint_of({"engine": inner.fingerprint, "redact": policy.digest})

    def __getattr__(self, name: str) -> Any:
        """Everything else (params, prepare, load, engine-specific helpers) is the inner one's."""
        return getattr(self._inner, name)

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

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
        attach = getattr(self._inner, "use_line_store", None)
        if attach is None:
            return
        policy = self._policy
        attach(store, lambda text: policy.redact(text) == text and storable(text))

    def recognize(self, request: OcrRequest) -> OcrResult:
        return redact_result(self._inner.recognize(request), self._policy)

    def recognize_many(self, requests: list[OcrRequest]) -> list[OcrResult]:
        """The inner engine's batch (or one call per image), each result masked."""
        many = getattr(self._inner, "recognize_many", None)
        results = many(requests) if many else [self._inner.recognize(r) for r in requests]
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
