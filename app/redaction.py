"""Masking sensitive text (ID numbers, phone numbers, bank cards, e-mail) before it is cached.

A policy is applied to the engine's result, before the cache sees it (``RedactingEngine`` in
``app.engines.redacting``), so raw text of the named types never reaches Redis, L1, the answer
or the logs (``install_log_redaction``). The policy's digest is part of the engine fingerprint,
hence of every key: an entry made under one policy is never served under another.

Masking keeps the length and the separators (every letter or digit of a match becomes ``*``),
so boxes still match their text. Checksums (resident ID: ISO 7064 MOD 11-2; bank cards: Luhn)
keep ordinary numbers readable; the price is that a number the OCR misread so that its checksum
fails is not masked (docs/SECURITY.md, Redaction, says where that leaves gaps).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.vocabulary import OcrCacheError

# Bump when a built-in pattern, a check or the masking changes: it is part of the policy
# digest, so entries made under the old patterns are other keys. 2: a value glued to a label
# (``ID11010519491231002X``) is masked; version 1 required a non-letter before it (issue 25).
PATTERNS_VERSION = 2

_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_ID_CHECK = "10X98765432"


def cn_id_valid(candidate: str) -> bool:
    """Mainland China resident ID (GB 11643): 17 digits and an ISO 7064 MOD 11-2 check."""
    chars = [c for c in candidate.upper() if c.isalnum()]
    if len(chars) != 18 or not all(c.isdigit() for c in chars[:17]):
        return False
    total = sum(int(c) * w for c, w in zip(chars[:17], _ID_WEIGHTS, strict=True))
    return _ID_CHECK[total % 11] == chars[17]


def luhn_valid(candidate: str) -> bool:
    digits = [int(c) for c in candidate if c.isdigit()]
    if not 13 <= len(digits) <= 19:
        return False
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


@dataclass(frozen=True)
class FieldType:
    name: str
    pattern: re.Pattern[str]
    check: Callable[[str], bool] | None = None


# The numbers are bounded by "no digit" on either side, never by "no letter": OCR routinely
# glues a label to its value (``ID11010519491231002X``, ``Tel13812345678``, ``卡号6222...``),
# and the checksums, not the neighbours, keep ordinary numbers readable. A longer digit run is
# another number (an account, a tracking number), not an ID or card with a digit glued on.
_SEP = r"[ \-]?"
BUILTIN: dict[str, FieldType] = {
    t.name: t
    for t in (
        FieldType(
            "cn_id",
            # The check character X may be followed by letters (``...002XName``).
            re.compile(r"(?<![0-9])\d{6} ?\d{8} ?\d{3}[0-9Xx](?![0-9])"),
            cn_id_valid,
        ),
        FieldType(
            "bank_card",
            re.compile(rf"(?<![0-9])\d(?:{_SEP}\d){{12,18}}(?![0-9])"),
            luhn_valid,
        ),
        FieldType(
            "phone",
            re.compile(
                # Mainland mobile (optionally +86 / 0086), mainland landline with area code,
                # or any international number written with a leading +.
                r"(?<![0-9])(?:(?:\+|00)86[ \-]?)?1[3-9]\d(?:[ \-]?\d{4}){2}(?![0-9])"
                r"|(?<![0-9])\(?0\d{2,3}\)?[ \-]?\d{7,8}(?![0-9])"
                r"|(?<![0-9])\+\d{1,3}(?:[ \-]?\(?\d{1,4}\)?)(?:[ \-]?\d{2,4}){2,4}(?![0-9])"
            ),
        ),
        FieldType(
            "email",
            re.compile(
                # The local part starts where its characters do: after a CJK label too
                # (``邮箱alice@...``); a Latin label glued to it is masked with it.
                r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+"
                r"@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"
            ),
        ),
    )
}
_CUSTOM_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


class PolicyError(OcrCacheError, ValueError):
    """The configured policy cannot be used (unknown type, bad pattern file)."""


def _mask(match: re.Match[str]) -> str:
    return "".join("*" if c.isalnum() else c for c in match.group(0))


@dataclass(frozen=True)
class RedactionPolicy:
    types: tuple[FieldType, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.types)

    @property
    def digest(self) -> str:
        """What the policy masks, as part of the cache key: names, patterns, the version."""
        canonical = repr(
            (PATTERNS_VERSION, [(t.name, t.pattern.pattern, t.pattern.flags) for t in self.types])
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def redact(self, text: str) -> str:
        for field_type in self.types:
            if field_type.check is None:
                text = field_type.pattern.sub(_mask, text)
            else:
                text = field_type.pattern.sub(_checked(field_type.check), text)
        return text


def parse_names(raw: str) -> tuple[str, ...]:
    """``CACHE_REDACT``: comma-separated built-in type names, or ``all``."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    if names == ("all",):
        return tuple(BUILTIN)
    unknown = [n for n in names if n not in BUILTIN]
    if unknown:
        raise PolicyError(f"unknown type {unknown[0]!r} (known: all, {', '.join(BUILTIN)})")
    return names


def load_patterns(path: str) -> tuple[FieldType, ...]:
    """``CACHE_REDACT_PATTERNS_FILE``: one ``name = regex`` per line, ``#`` comments."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"cannot read {path!r}: {exc}") from None
    types = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, regex = (part.strip() for part in line.partition("="))
        if not sep or not _CUSTOM_NAME.fullmatch(name) or name in BUILTIN:
            raise PolicyError(f"line {number}: expected `name = regex` with a new lowercase name")
        try:
            pattern = re.compile(regex)
        except re.error as exc:
            raise PolicyError(f"line {number}: bad regex for {name}: {exc}") from None
        if pattern.fullmatch(""):
            raise PolicyError(f"line {number}: the pattern for {name} matches empty text")
        types.append(FieldType(name, pattern))
    return tuple(types)


def build_policy(names: tuple[str, ...], patterns_file: str) -> RedactionPolicy | None:
    """None when nothing is to be masked (the default)."""
    types = tuple(BUILTIN[n] for n in names)
    if patterns_file:
        types += load_patterns(patterns_file)
    return RedactionPolicy(types) if types else None


_FORMATTER = logging.Formatter()


def install_log_redaction(policy: RedactionPolicy) -> None:
    """Every log record of this process is masked when it is made, whoever logs it (our code,
    granian, Paddle, libraries): a raw ID in a message, an argument or a traceback never
    reaches a log line. Wraps the current record factory; a second call only swaps the policy.

    String arguments are masked *before* the inner factory sees them: ``app.logsafe`` escapes
    control characters there, and an ID after an escaped newline (``\\n1101...``) would no
    longer stand alone for the patterns. The formatted message is masked again (a match may
    span the template), and the traceback is formatted, masked, and ``exc_info`` dropped so
    no handler can format the raw one."""
    factory = logging.getLogRecordFactory()
    if hasattr(factory, "redaction_policy"):
        factory.redaction_policy = policy
        return

    def make(*args: Any, **kwargs: Any) -> logging.LogRecord:
        active: RedactionPolicy = make.redaction_policy  # type: ignore[attr-defined]
        if len(args) > 5:
            args = (*args[:5], _masked_args(args[5], active), *args[6:])
        elif "args" in kwargs:
            kwargs["args"] = _masked_args(kwargs["args"], active)
        record = factory(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: keep the template, drop the arguments
            message = f"{record.msg} (arguments not shown: they did not format)"
        record.msg, record.args = active.redact(message), None
        if record.exc_info:
            record.exc_text = active.redact(_FORMATTER.formatException(record.exc_info))
            record.exc_info = None
        if record.stack_info:
            record.stack_info = active.redact(record.stack_info)
        return record

    make.redaction_policy = policy  # type: ignore[attr-defined]
    # app.logsafe.install() looks for this mark; the escaping it adds runs inside.
    make.escapes_control_characters = getattr(  # type: ignore[attr-defined]
        factory, "escapes_control_characters", False
    )
    logging.setLogRecordFactory(make)


def _masked_args(args: Any, policy: RedactionPolicy) -> Any:
    """String arguments masked; ``log.info("%(a)s", {"a": ...})`` arrives as a 1-tuple of a
    mapping, whose string values are masked too."""
    if isinstance(args, tuple):
        return tuple(
            _masked_args(a, policy) if isinstance(a, dict) else _masked(a, policy) for a in args
        )
    if isinstance(args, dict):
        return {k: _masked(v, policy) for k, v in args.items()}
    return args


def _masked(value: Any, policy: RedactionPolicy) -> Any:
    return policy.redact(value) if isinstance(value, str) else value


def _checked(check: Callable[[str], bool]) -> Callable[[re.Match[str]], str]:
    """A match masked only when its checksum holds (ordinary numbers stay readable)."""

    def replace(match: re.Match[str]) -> str:
        return _mask(match) if check(match.group(0)) else match.group(0)

    return replace
