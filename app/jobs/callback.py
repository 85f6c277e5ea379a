"""The job-end callback: a POST to the job's ``callback_url``, signed per Standard Webhooks
(https://www.standardwebhooks.com/), so a receiver can check that it came from this service
and is fresh before acting on it.

Headers: ``webhook-id`` (one per delivery, the same on every retry, so a receiver that
remembers ids handles a retried delivery once), ``webhook-timestamp`` (Unix seconds, new on
each attempt) and ``webhook-signature`` (``v1,`` + base64 of HMAC-SHA256 over
``{id}.{timestamp}.{body}``). Secrets are written ``whsec_`` + base64 of the key bytes. Each
tenant's secret is derived from the master (``JOBS_CALLBACK_SECRET``), so no tenant can sign
as another.

The URL follows the same SSRF rules as URL input (``app.protocols.fetch``): parsed once,
allow-listed hosts only (``JOBS_CALLBACK_ALLOWED_HOSTS``), resolved once per attempt with
private/loopback/link-local addresses refused unless listed as IP literals, the connection
pinned to the checked address (HTTPS still verifies the certificate for the name), no
redirects, one deadline per attempt.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import secrets
import time
from collections.abc import Callable, Mapping
from http.client import HTTPException
from typing import Any

import orjson
from urllib3.exceptions import HTTPError

from app.protocols import fetch
from app.protocols.errors import BadRequest
from app.vocabulary import OcrCacheError

log = logging.getLogger(__name__)

_PREFIX = "whsec_"
# Domain separation: a tenant's key is never a key used for anything else.
_TENANT_CONTEXT = b"ocr-cache callback tenant:"
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
MAX_DELAY_S = 60.0
# Statuses worth another attempt: the receiver is overloaded, down or timed us out.
_RETRY_4XX = frozenset({408, 429})


def _key(secret: str) -> bytes:
    """The key bytes of a ``whsec_`` secret (the prefix optional, as the reference library
    reads it). Errors never include the secret."""
    text = secret[len(_PREFIX) :] if secret.startswith(_PREFIX) else secret
    try:
        key = base64.b64decode(text + "==")  # tolerate unpadded base64, as the spec's libraries
    except ValueError:
        raise ValueError("the callback secret is not valid base64") from None
    if not key:
        raise ValueError("the callback secret is empty")
    return key


def _whsec(key: bytes) -> str:
    return _PREFIX + base64.b64encode(key).decode("ascii")


def tenant_secret(master: str, tenant: str) -> str:
    """The ``whsec_`` secret that signs ``tenant``'s callbacks: HMAC-SHA256 of the tenant's
    name under the master key, so a tenant who knows its own secret learns nothing of
    another's, nor of the master. The default tenant (``""``, and every caller when no
    tenants are configured) has one derived the same way. A master written ``whsec_...`` is
    its decoded bytes; any other string, its UTF-8 bytes. An empty master is refused: a key
    anyone knows would sign nothing."""
    if not master:
        raise ValueError("no callback secret: set JOBS_CALLBACK_SECRET")
    key = _key(master) if master.startswith(_PREFIX) else master.encode()
    return _whsec(hmac.new(key, _TENANT_CONTEXT + tenant.encode(), hashlib.sha256).digest())


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value of one attempt: ``v1,`` + base64(HMAC-SHA256)."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    tolerance_s: int = 300,
    now: float | None = None,
) -> bool:
    """A reference receiver's check (tests and docs): the headers are present, the timestamp
    within ``tolerance_s`` of ``now`` either way, and one of the space-separated signatures
    matches (compared in constant time). ``body`` is the raw request body, as received.

    A receiver also drops replays: within the tolerance window a captured request verifies
    again, so it remembers the ``webhook-id`` values it has handled (a retry of a delivery
    carries the same id, so this also makes retries harmless):

    >>> secret = tenant_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "acme")
    >>> body = b'{"job_id":"j1","status":"succeeded"}'
    >>> headers = {"webhook-id": "msg_1", "webhook-timestamp": "1700000000",
    ...            "webhook-signature": sign(secret, "msg_1", 1700000000, body)}
    >>> seen: set[str] = set()
    >>> def receive(headers: dict[str, str], body: bytes) -> bool:
    ...     if not verify(secret, headers, body, now=1700000010):
    ...         return False  # forged, altered or stale: 400
    ...     if headers["webhook-id"] in seen:
    ...         return False  # a replay or a retry already handled: 200, do nothing
    ...     seen.add(headers["webhook-id"])
    ...     return True
    >>> receive(headers, body), receive(headers, body)
    (True, False)
    """
    lower = {k.lower(): v for k, v in headers.items()}
    message_id = lower.get("webhook-id", "")
    stamp = lower.get("webhook-timestamp", "")
    signatures = lower.get("webhook-signature", "")
    if not (message_id and signatures and _TIMESTAMP.fullmatch(stamp)):
        return False
    timestamp = int(stamp)
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance_s:
        return False
    try:
        expected = sign(secret, message_id, timestamp, body).encode()
    except ValueError:
        return False
    matches = [hmac.compare_digest(expected, s.encode()) for s in signatures.split(" ")]
    return any(matches)


def _target(url: str, allowed_hosts: frozenset[str]) -> fetch.Target:
    if not allowed_hosts:
        raise BadRequest(
            "callbacks are off on this service: set JOBS_CALLBACK_ALLOWED_HOSTS",
            code="callback_not_allowed",
        )
    try:
        return fetch.parse(url, allowed_hosts)
    except BadRequest as exc:
        raise BadRequest(f"callback_url refused: {exc}", code="callback_not_allowed") from None


def check_url(url: str, allowed_hosts: frozenset[str]) -> None:
    """Refuse a ``callback_url`` when the job is submitted (``BadRequest``, code
    ``callback_not_allowed``), rather than fail silently when it ends. Its address is
    checked at delivery, when it is resolved."""
    _target(url, allowed_hosts)


class _Failure(OcrCacheError):
    """One failed attempt; ``retry`` says whether another one may succeed."""

    def __init__(self, reason: str, retry: bool) -> None:
        super().__init__(reason)
        self.retry = retry


class CallbackSender:
    """Delivers job-end callbacks: at most ``attempts`` POSTs, ``first_delay_s`` apart and
    doubling (at most ``MAX_DELAY_S``), each within ``timeout_s``. Retried: connection
    errors, timeouts, failed name lookups, 5xx, 408 and 429. Not retried: other 4xx and
    redirects (never followed). ``sleep`` is injectable so tests need not wait."""

    def __init__(
        self,
        allowed_hosts: frozenset[str],
        attempts: int = 5,
        first_delay_s: float = 1.0,
        timeout_s: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.allowed_hosts = allowed_hosts
        self.attempts = attempts
        self.first_delay_s = first_delay_s
        self.timeout_s = timeout_s
        self.sleep = sleep

    def deliver(self, url: str, secret: str, payload: dict[str, Any]) -> bool:
        """POST ``payload`` as JSON to ``url``, signed with ``secret``; whether a 2xx came
        back. A URL the allow-list no longer admits fails without a connection."""
        body = orjson.dumps(payload)
        message_id = "msg_" + secrets.token_urlsafe(16)  # 22 url-safe characters
        _key(secret)  # a bad secret is the caller's error, not a failed delivery
        try:
            target = _target(url, self.allowed_hosts)
        except BadRequest as exc:
            log.warning("callback %s not sent: %s", message_id, exc)
            return False
        where = f"{target.scheme}://{target.host_header}"  # no path or query: they may hold tokens
        for attempt in range(1, self.attempts + 1):
            try:
                self._post(target, secret, message_id, body)
                return True
            except _Failure as failure:
                last = attempt == self.attempts or not failure.retry
                delay = min(self.first_delay_s * 2 ** (attempt - 1), MAX_DELAY_S)
                log.warning(
                    "callback %s to %s: attempt %d/%d failed (%s); %s",
                    message_id,
                    where,
                    attempt,
                    self.attempts,
                    failure,
                    "giving up" if last else f"retrying in {delay:g} s",
                )
                if last:
                    return False
                self.sleep(delay)
        return False  # not reached: the last attempt returns

    def _post(self, target: fetch.Target, secret: str, message_id: str, body: bytes) -> None:
        """One attempt, within ``timeout_s`` overall; returns on a 2xx, else ``_Failure``."""
        deadline = time.monotonic() + self.timeout_s
        try:
            address = fetch.resolve(target, self.allowed_hosts, self.timeout_s)
        except BadRequest as exc:
            raise _Failure(str(exc), retry=True) from None  # DNS may answer differently later
        timestamp = int(time.time())
        headers = {
            "Host": target.host_header,
            "Content-Type": "application/json",
            "Content-Length": str(len(body)),
            "Accept-Encoding": "identity",
            "User-Agent": "ocr-cache-callback",
            "Connection": "close",
            "webhook-id": message_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(secret, message_id, timestamp, body),
        }
        remaining = max(0.1, deadline - time.monotonic())
        with fetch.pinned(target, address, remaining) as (conn, expired):
            try:
                # The body is never read: the status is the answer, and a huge one costs nothing.
                conn.request(
                    "POST", target.request_uri, body=body, headers=headers, preload_content=False
                )
                status = conn.getresponse().status
            except (HTTPError, HTTPException, OSError, ValueError) as exc:
                if expired.is_set():
                    raise _Failure(f"no answer within {self.timeout_s:g} s", retry=True) from None
                raise _Failure(exc.__class__.__name__, retry=True) from None
        if 200 <= status < 300:
            return
        retry = status >= 500 or status in _RETRY_4XX
        raise _Failure(f"HTTP {status}", retry=retry)
