"""Tenants: who may call (their API keys) and what each may cost (its quotas and queue share).

The tenants file (``API_KEYS_FILE``, JSON; a Kubernetes secret mounted as a file works) is
read at start-up and again whenever it changes, checked at most every
``API_KEYS_RELOAD_SECONDS`` (its content compared): a key is added, rotated or revoked
without a restart. It holds
the SHA-256 of each key, never the key, so the file itself grants nothing::

    {"tenants": [{"name": "expenses", "key_sha256": ["<hex>", "<next hex>"],
                  "rate": "20:40", "misses_in_flight": 4,
                  "engine_seconds_per_minute": 60, "share": 1}]}

Every limit is optional (absent: unlimited); ``key_sha256`` is one digest or a list (two at
once while a key rotates). A presented key is hashed and compared with every digest in
constant time (``hmac.compare_digest``, no early exit), so the time taken tells nothing about
which digest came close. A file that no longer parses is not taken: the tenants already
loaded stay, and the reload is counted as an error. Names follow ``TENANT_NAME`` and are the
tenants' key namespaces; ``default`` (the namespace-less tenant) and ``other`` (every tenant
the file does not name) are the metrics' own labels and cannot be configured.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from app import metrics
from app.env import ConfigError, RateLimit, rate_limit
from app.vocabulary import TENANT_NAME

log = logging.getLogger(__name__)

DEFAULT_LABEL = "default"  # the tenant of requests with no namespace
OTHER_LABEL = "other"  # every tenant the file does not name (bounded metric labels)
_RESERVED = {DEFAULT_LABEL, OTHER_LABEL}
_HEX64 = "^[0-9a-fA-F]{64}$"


@dataclass(frozen=True)
class Tenant:
    """One configured tenant: its keys' digests, its limits (None: unlimited), its share of
    the engines when misses queue up."""

    name: str
    digests: tuple[bytes, ...] = ()
    rate: RateLimit | None = None
    misses_in_flight: int | None = None
    engine_seconds_per_minute: float | None = None
    share: float = 1.0


class _TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=f"^{TENANT_NAME.pattern}$")
    key_sha256: list[str] = Field(default_factory=list)
    rate: str | None = None
    misses_in_flight: int | None = Field(default=None, ge=1, le=1_000_000)
    engine_seconds_per_minute: float | None = Field(default=None, gt=0, le=1e9)
    share: float = Field(default=1.0, gt=0, le=1000)

    @field_validator("key_sha256", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("key_sha256")
    @classmethod
    def _hex(cls, value: list[str]) -> list[str]:
        for digest in value:
            if not re.fullmatch(_HEX64, digest):
                raise ValueError("each key_sha256 is 64 hex digits (the SHA-256 of the key)")
        return value


class _TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: list[_TenantEntry]


def parse(text: bytes | str) -> dict[str, Tenant]:
    """The tenants of a file's text, by name; ``ConfigError`` naming what is wrong."""
    try:
        document = _TenantsFile.model_validate(orjson.loads(text))
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"API_KEYS_FILE: not JSON ({exc})") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ConfigError(f"API_KEYS_FILE: {where}: {first['msg']}") from None
    tenants: dict[str, Tenant] = {}
    owners: dict[str, str] = {}
    for entry in document.tenants:
        if entry.name in _RESERVED:
            raise ConfigError(f"API_KEYS_FILE: {entry.name!r} is reserved (a metrics label)")
        if entry.name in tenants:
            raise ConfigError(f"API_KEYS_FILE: tenant {entry.name!r} appears twice")
        for digest in entry.key_sha256:
            other = owners.setdefault(digest.lower(), entry.name)
            if other != entry.name:
                raise ConfigError(f"API_KEYS_FILE: one key belongs to {other!r} and {entry.name!r}")
        tenants[entry.name] = Tenant(
            name=entry.name,
            digests=tuple(bytes.fromhex(d) for d in entry.key_sha256),
            rate=rate_limit(f"API_KEYS_FILE: {entry.name}.rate", entry.rate)
            if entry.rate
            else None,
            misses_in_flight=entry.misses_in_flight,
            engine_seconds_per_minute=entry.engine_seconds_per_minute,
            share=entry.share,
        )
    return tenants


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The API key a request carries: ``Authorization: Bearer <key>``, else ``X-Api-Key``
    (HTTP headers, or gRPC metadata, whose keys are lower-case)."""

    def get(name: str) -> str | None:
        return headers.get(name) or headers.get(name.lower())

    authorization = (get("Authorization") or "").strip()
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    key = (get("X-Api-Key") or "").strip()
    return key or None


class TenantBook:
    """The configured tenants, kept current with their file (none: an empty book)."""

    def __init__(
        self,
        path: str = "",
        reload_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Reads ``path`` now: a missing or invalid file is a ``ConfigError`` at start-up."""
        self._path = path
        self._reload_seconds = reload_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._tenants: dict[str, Tenant] = {}
        self._stamp: bytes | None = None
        self._checked = clock()
        self.generation = 0  # grows with every reload taken (labels may have changed)
        if path:
            try:
                text = _read(path)
                self._tenants, self._stamp = parse(text), _stamp(text)
            except OSError as exc:
                raise ConfigError(f"API_KEYS_FILE: cannot read {path} ({exc.strerror})") from None

    @classmethod
    def of(cls, tenants: list[Tenant]) -> TenantBook:
        """A book of these tenants, with no file (tests, benchmarks)."""
        book = cls()
        book._tenants = {tenant.name: tenant for tenant in tenants}
        return book

    def identify(self, key: str) -> Tenant | None:
        """The tenant holding ``key``, compared with every digest in constant time."""
        presented = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found: Tenant | None = None
        for tenant in self._current().values():
            for digest in tenant.digests:
                if hmac.compare_digest(presented, digest):
                    found = tenant
        return found

    def get(self, name: str) -> Tenant | None:
        return self._current().get(name)

    def share(self, name: str) -> float:
        tenant = self.get(name)
        return tenant.share if tenant is not None else 1.0

    def label(self, namespace: str) -> str:
        """The metrics label of a namespace: ``default``, a configured name, or ``other``."""
        if not namespace:
            return DEFAULT_LABEL
        return namespace if namespace in self._current() else OTHER_LABEL

    def labels(self) -> list[str]:
        """Every label the metrics may carry now."""
        return [DEFAULT_LABEL, *sorted(self._current()), OTHER_LABEL]

    def _current(self) -> dict[str, Tenant]:
        if self._path and self._clock() - self._checked >= self._reload_seconds:
            self._reload()
        return self._tenants

    def _reload(self) -> None:
        """Read the file again if it changed (one thread reads; the others keep the
        tenants they have meanwhile)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._checked = self._clock()
            try:
                text = _read(self._path)
            except OSError as exc:
                _refused(exc)
                return
            stamp = _stamp(text)
            if stamp == self._stamp:
                return
            self._stamp = stamp  # each version of the file is looked at once, taken or not
            try:
                tenants = parse(text)
            except ConfigError as exc:
                _refused(exc)
                return
            self._tenants = tenants
            self.generation += 1
            metrics.API_KEYS_RELOADS.labels(result="ok").inc()
            log.info("API_KEYS_FILE reloaded: %d tenants", len(tenants))
        finally:
            self._lock.release()


def _refused(exc: Exception) -> None:
    log.error("API_KEYS_FILE not reloaded, the tenants already loaded stay: %s", exc)
    metrics.API_KEYS_RELOADS.labels(result="error").inc()


def _stamp(text: bytes) -> bytes:
    """What changes when the file does: its content's digest (at most 1 MiB, read every
    ``API_KEYS_RELOAD_SECONDS``), so a key swapped in place at the same size and time, or a
    Kubernetes secret's symlink swap, is seen either way."""
    return hashlib.sha256(text).digest()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(1 << 20)
