"""How a setting is read from the environment: the field helper ``env`` (variable, parser,
default, one line of documentation), the parsers, and ``Section``, the base of every group
of settings in ``app.config``.

Every parser answers a bad value with ``ConfigError`` and a one-line message naming the
variable, which the entry point prints before exiting. A secret may come from the file named
by ``{VAR}_FILE`` (Kubernetes/Docker secrets) and is never in a section's repr.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Self, cast

from app import redis_url
from app.redaction import PolicyError, load_patterns, parse_names
from app.vocabulary import OcrCacheError

Parser = Callable[[str, str], Any]


class ConfigError(OcrCacheError, ValueError):
    """A setting has a value the service cannot run with."""


def env(var: str, parse: Parser, default: Any, doc: str, *, secret: bool = False) -> Any:
    """A section field read from environment variable ``var``; ``doc`` is its line in
    docs/CONFIGURATION.md (generated: ``python -m app config-doc``)."""
    metadata = {"env": var, "parse": parse, "doc": doc, "secret": secret}
    return field(default=default, repr=not secret, metadata=metadata)


class Section:
    """A group of settings one component takes (and only that one): fields made with
    ``env``, read by ``from_env``."""

    TITLE = ""  # its heading in docs/CONFIGURATION.md
    INTRO = ""  # a sentence under the heading

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Self:
        values: dict[str, Any] = {}
        for f in cls.variables():
            var = f.metadata["env"]
            raw = environ.get(var)
            if (raw is None or not raw.strip()) and f.metadata["secret"]:
                raw = _read_secret_file(f"{var}_FILE", environ.get(f"{var}_FILE", ""))
            if raw is not None and raw.strip() != "":
                values[f.name] = f.metadata["parse"](var, raw)
        return cls(**values)

    @classmethod
    def variables(cls) -> Iterator[Any]:
        """Its fields (each with ``metadata`` env, parse, doc, secret)."""
        yield from fields(cast(Any, cls))


def _read_secret_file(var: str, path: str) -> str | None:
    if not path.strip():
        return None
    try:
        with open(path.strip(), encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"{var}: cannot read {path.strip()!r}: {exc.strerror}") from None


# -- parsers: (variable name, raw text) -> value --------------------------------------------


def accepts(text: str) -> Callable[[Parser], Parser]:
    """What a parser accepts, in words (the "accepted" column of docs/CONFIGURATION.md)."""

    def mark(parse: Parser) -> Parser:
        parse.accepted = text  # type: ignore[attr-defined]
        return parse

    return mark


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@accepts("boolean")
def boolean(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}: expected true/false, got {raw!r}")


def integer(lo: int, hi: int) -> Parser:
    return _bounded(int, "an integer", lo, hi, f"{lo}..{hi}")


def number(lo: float, hi: float) -> Parser:
    return _bounded(float, "a number", lo, hi, f"{lo:g}..{hi:g}")


def _bounded(convert: Callable[[str], Any], noun: str, lo: Any, hi: Any, shown: str) -> Parser:
    """``convert``ed, within ``lo``..``hi`` (``shown`` in the documentation)."""

    @accepts(shown)
    def parse(name: str, raw: str) -> Any:
        try:
            value = convert(raw.strip())
        except ValueError:
            raise ConfigError(f"{name}: expected {noun}, got {raw!r}") from None
        if not lo <= value <= hi:
            raise ConfigError(f"{name}: expected {noun} in {lo}..{hi}, got {value}")
        return value

    return parse


def choice(*options: str) -> Parser:
    @accepts(", ".join(f"`{o}`" for o in options))
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in options:
            raise ConfigError(f"{name}: expected one of {'|'.join(options)}, got {raw!r}")
        return value

    return parse


def text(name: str, raw: str) -> str:
    return raw.strip()


@accepts("1..64 characters, no spaces")
def prefix(name: str, raw: str) -> str:
    value = raw.strip()
    if not value or any(c.isspace() for c in value) or len(value) > 64:
        raise ConfigError(f"{name}: expected 1..64 characters without spaces, got {raw!r}")
    return value


@accepts("a path (made absolute: nginx and the front's server run in different folders)")
def absolute_path(name: str, raw: str) -> str:
    value = raw.strip()
    return os.path.abspath(value) if value else ""


@accepts("1..64 letters, digits, `.`, `_` or `-`")
def path_segment(name: str, raw: str) -> str:
    """A name that becomes a URL path segment and an nginx ``location``: nothing nginx or a
    URL would read as syntax."""
    value = raw.strip()
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", value) or value in (".", ".."):
        raise ConfigError(f"{name}: expected 1..64 letters, digits, '.', '_' or '-', got {raw!r}")
    return value


def redis_address(name: str, raw: str) -> str:
    value = raw.strip()
    schemes = ("redis://", "rediss://", "unix://", "redis+sentinel://", "redis+cluster://")
    if value and not value.startswith(schemes):
        raise ConfigError(f"{name}: expected one of {', '.join(schemes)} URLs")
    if value.startswith(("redis+sentinel://", "redis+cluster://")):
        try:
            redis_url.parse(value)
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    return value


def serving_url(name: str, raw: str) -> str:
    value = raw.strip().rstrip("/")
    if value and not value.startswith(("grpc://", "http://", "https://")):
        raise ConfigError(f"{name}: expected grpc://host:port or http(s)://host:port")
    return value


def http_url(name: str, raw: str) -> str:
    value = raw.strip().rstrip("/")
    if value and not value.startswith(("http://", "https://")):
        raise ConfigError(f"{name}: expected http(s)://host:port")
    return value


@accepts("`s3://bucket[/prefix]`")
def s3_url(name: str, raw: str) -> str:
    """``s3://bucket[/prefix]``: a valid bucket name (3-63 of [a-z0-9.-]), an optional prefix."""
    value = raw.strip().rstrip("/")
    if not value:
        return ""
    bucket, _, rest = value.removeprefix("s3://").partition("/")
    valid = 3 <= len(bucket) <= 63 and all(c.islower() or c.isdigit() or c in ".-" for c in bucket)
    if not value.startswith("s3://") or not valid or bucket[0] in ".-" or "//" in f"/{rest}":
        raise ConfigError(f"{name}: expected s3://bucket[/prefix] (bucket: 3-63 of a-z 0-9 . -)")
    return value


@accepts("a 40-character commit hash")
def commit(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value and (len(value) != 40 or any(c not in "0123456789abcdef" for c in value)):
        raise ConfigError(
            f"{name}: expected a 40-character commit hash (a branch or tag can move), got {raw!r}"
        )
    return value


def redact_types(name: str, raw: str) -> tuple[str, ...]:
    try:
        return parse_names(raw)
    except PolicyError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def redact_patterns_file(name: str, raw: str) -> str:
    try:
        load_patterns(raw.strip())
    except PolicyError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    return raw.strip()


@accepts("`debug`, `info`, `warning`, `error`, `critical`")
def log_level(name: str, raw: str) -> str:
    return choice("debug", "info", "warning", "error", "critical")(name, raw).upper()


@accepts("`kid:base64key[,...]`: 16, 24 or 32-byte keys")
def encryption_keys(name: str, raw: str) -> tuple[tuple[str, bytes], ...]:
    """``kid:base64key[,kid:base64key...]``; AES key sizes only; the first one encrypts."""
    keys: list[tuple[str, bytes]] = []
    for item in raw.split(","):
        kid, sep, encoded = item.strip().partition(":")
        if not sep or not kid or len(kid) > 32 or not all(c.isalnum() or c in "-_" for c in kid):
            raise ConfigError(f"{name}: expected kid:base64key items (kid: 1-32 of [A-Za-z0-9_-])")
        try:
            key = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"{name}: key {kid!r} is not valid base64") from None
        if len(key) not in (16, 24, 32):
            raise ConfigError(f"{name}: key {kid!r} must be 16, 24 or 32 bytes (AES)")
        if any(kid == existing for existing, _ in keys):
            raise ConfigError(f"{name}: key id {kid!r} appears twice")
        keys.append((kid, key))
    return tuple(keys)


@accepts("at least 16 characters")
def token(name: str, raw: str) -> str:
    value = raw.strip()
    if len(value) < 16:
        raise ConfigError(f"{name}: must be at least 16 characters")
    return value


def header_name(name: str, raw: str) -> str:
    value = raw.strip()
    if value and not all(c.isalnum() or c == "-" for c in value):
        raise ConfigError(f"{name}: expected an HTTP header name, got {raw!r}")
    return value


@accepts("comma-separated CIDRs or addresses")
def networks(name: str, raw: str) -> tuple[Any, ...]:
    """Comma-separated CIDRs or addresses (``10.0.0.0/8, 192.168.1.7, fd00::/8``)."""
    try:
        return tuple(
            ipaddress.ip_network(item.strip(), strict=False)
            for item in raw.split(",")
            if item.strip()
        )
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


@accepts("an existing file")
def existing_file(name: str, raw: str) -> str:
    value = raw.strip()
    if value and not os.path.isfile(value):
        raise ConfigError(f"{name}: no such file {value!r}")
    return value


@dataclass(frozen=True)
class RateLimit:
    """``RATE_LIMIT=RPS[:BURST]``: a client may send ``rate`` requests per second on average
    and ``burst`` more at once (nginx's ``limit_req ... burst=N nodelay``)."""

    rate: float
    burst: int

    def retry_after(self) -> int:
        """Whole seconds until one more request is allowed (``Retry-After``)."""
        return max(1, math.ceil(1 / self.rate))

    def __str__(self) -> str:
        return f"{self.rate:g}:{self.burst}"


@accepts("`RPS[:BURST]`, RPS 1/60..100000, BURST 0..1000000")
def rate_limit(name: str, raw: str) -> RateLimit:
    rate_text, _, burst_text = raw.strip().partition(":")
    try:
        rate = float(rate_text)
        burst = int(burst_text) if burst_text else 0
    except ValueError:
        raise ConfigError(f"{name}: expected RPS[:BURST], e.g. 20:40, got {raw!r}") from None
    if not 1 / 60 <= rate <= 100_000 or not 0 <= burst <= 1_000_000:
        raise ConfigError(f"{name}: RPS must be in 1/60..100000 and BURST in 0..1000000")
    return RateLimit(rate, burst)
