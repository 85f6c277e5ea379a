"""Job-end callbacks (app/jobs/callback.py): Standard Webhooks signatures checked by our
reference receiver and by the spec's own library, per-tenant secrets that cannot sign for one
another, the URL refused under the same SSRF rules as URL input, and deliveries to a real HTTP
server on loopback: retries with one ``webhook-id``, redirects not followed, 4xx final."""

from __future__ import annotations

import doctest
import http.server
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from standardwebhooks import Webhook

from app.jobs import callback
from app.jobs.callback import CallbackSender, check_url, sign, tenant_secret, verify
from app.ports import free_port
from app.protocols.errors import BadRequest

pytestmark = pytest.mark.unit

MASTER = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
BODY = b'{"job_id":"j1","status":"succeeded"}'
NOW = 1_700_000_000


def _headers(secret: str, body: bytes = BODY, timestamp: int = NOW) -> dict[str, str]:
    return {
        "webhook-id": "msg_test",
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, "msg_test", timestamp, body),
    }


# --- signatures -------------------------------------------------------------------------


def test_sign_verify_round_trip() -> None:
    assert verify(MASTER, _headers(MASTER), BODY, now=NOW)
    assert sign(MASTER, "msg_test", NOW, BODY).startswith("v1,")
    # Header names are case-insensitive, as HTTP's are.
    upper = {k.upper(): v for k, v in _headers(MASTER).items()}
    assert verify(MASTER, upper, BODY, now=NOW)


def test_verify_rejects_tampering_wrong_secret_and_stale_or_future_timestamps() -> None:
    headers = _headers(MASTER)
    assert not verify(MASTER, headers, BODY.replace(b"succeeded", b"failed"), now=NOW)
    assert not verify(tenant_secret(MASTER, "other"), headers, BODY, now=NOW)
    assert not verify(MASTER, headers, BODY, now=NOW + 360)  # 6 minutes old
    assert not verify(MASTER, headers, BODY, now=NOW - 360)  # 6 minutes in the future
    assert verify(MASTER, headers, BODY, now=NOW + 299)
    # The timestamp is signed: moving it forward to look fresh breaks the signature.
    moved = dict(headers, **{"webhook-timestamp": str(NOW + 360)})
    assert not verify(MASTER, moved, BODY, now=NOW + 360)


def test_verify_rejects_missing_or_malformed_headers() -> None:
    headers = _headers(MASTER)
    for name in headers:
        assert not verify(MASTER, {k: v for k, v in headers.items() if k != name}, BODY, now=NOW)
    for stamp in ("", "-1", "1.5e9", "abc", "9" * 5000):
        assert not verify(MASTER, dict(headers, **{"webhook-timestamp": stamp}), BODY, now=NOW)
    assert not verify(MASTER, dict(headers, **{"webhook-signature": "v1,"}), BODY, now=NOW)


def test_verify_accepts_one_matching_signature_in_a_list() -> None:
    """Secret rotation: the sender may send signatures under the old and the new key."""
    headers = _headers(MASTER)
    other = sign(tenant_secret(MASTER, "x"), "msg_test", NOW, BODY)
    listed = dict(
        headers, **{"webhook-signature": f"v2,abc {other} {headers['webhook-signature']}"}
    )
    assert verify(MASTER, listed, BODY, now=NOW)
    assert not verify(
        MASTER, dict(headers, **{"webhook-signature": f"v2,abc {other}"}), BODY, now=NOW
    )


def test_replay_check_in_the_docstring() -> None:
    """verify's docstring shows a receiver dropping a replayed (or retried) delivery: run it."""
    finder = doctest.DocTestFinder()
    tests = [t for t in finder.find(callback) if t.examples]
    assert [t.name for t in tests] == ["app.jobs.callback.verify"]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0


def test_standardwebhooks_library_verifies_our_signature() -> None:
    secret = tenant_secret(MASTER, "acme")
    headers = _headers(secret, timestamp=int(time.time()))
    assert Webhook(secret).verify(BODY, headers) == orjson.loads(BODY)


# --- secrets ----------------------------------------------------------------------------


def test_tenant_secrets_differ_and_do_not_verify_for_one_another() -> None:
    a, b = tenant_secret(MASTER, "acme"), tenant_secret(MASTER, "globex")
    assert a.startswith("whsec_") and b.startswith("whsec_")
    assert len({a, b, MASTER}) == 3
    assert a == tenant_secret(MASTER, "acme")  # derived, not random: every process agrees
    assert verify(a, _headers(a), BODY, now=NOW)
    assert not verify(b, _headers(a), BODY, now=NOW)
    assert not verify(a, _headers(b), BODY, now=NOW)
    assert not verify(MASTER, _headers(a), BODY, now=NOW)
    # Another master gives another secret for the same tenant.
    assert tenant_secret("whsec_" + "QUJD" * 8, "acme") != a


def test_the_default_tenant_has_a_derived_secret_too() -> None:
    """Not the master: whoever holds the default tenant's secret cannot derive another's."""
    default = tenant_secret(MASTER, "")
    assert default != MASTER and default.startswith("whsec_")
    assert verify(default, _headers(default), BODY, now=NOW)
    assert not verify(tenant_secret(MASTER, "acme"), _headers(default), BODY, now=NOW)
    # A raw master is its UTF-8 bytes: the same keys as its whsec_ form.
    raw = "whsec_YSBwbGFpbiBtYXN0ZXIgc3RyaW5n"  # base64 of "a plain master string"
    for tenant in ("", "acme"):
        assert tenant_secret("a plain master string", tenant) == tenant_secret(raw, tenant)


def test_empty_or_malformed_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="JOBS_CALLBACK_SECRET"):
        tenant_secret("", "acme")
    with pytest.raises(ValueError) as caught:
        sign("whsec_", "msg_1", NOW, BODY)
    assert "whsec_" not in str(caught.value)
    assert not verify("whsec_", _headers(MASTER), BODY, now=NOW)


# --- the URL ----------------------------------------------------------------------------

HOSTS = frozenset({"hooks.example.com"})


@pytest.mark.parametrize(
    ("url", "allowed", "says"),
    [
        ("https://hooks.example.com/x", frozenset(), "set JOBS_CALLBACK_ALLOWED_HOSTS"),
        ("https://evil.example.com/x", HOSTS, "not allowed"),
        ("https://user:pw@hooks.example.com/x", HOSTS, "user information"),
        ("https://hooks.example.com@evil.example.com/x", HOSTS, "user information"),
        ("ftp://hooks.example.com/x", HOSTS, "only http and https"),
        ("file:///etc/passwd", HOSTS, "only http and https"),
        ("http://hooks.example.com\\@evil.example.com/", HOSTS, "backslash"),
    ],
)
def test_check_url_refusals(url: str, allowed: frozenset[str], says: str) -> None:
    with pytest.raises(BadRequest, match=says) as caught:
        check_url(url, allowed)
    assert caught.value.code == "callback_not_allowed"


def test_check_url_accepts_an_allowed_host() -> None:
    check_url("https://hooks.example.com/ocr/done?job=1", HOSTS)
    check_url("http://127.0.0.1:8080/done", frozenset({"127.0.0.1:8080"}))


# --- deliveries to a real server --------------------------------------------------------


class Receiver:
    """A real HTTP server on a free loopback port: answers POSTs with the statuses queued in
    ``script`` (then 200), records each request, and records any request to ``/elsewhere``
    (where its redirects point: it must never be reached)."""

    def __init__(self) -> None:
        self.script: list[int] = []
        self.posts: list[tuple[str, dict[str, str], bytes]] = []
        self.elsewhere = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.startswith("/elsewhere"):
                    owner.elsewhere += 1
                owner.posts.append((self.path, dict(self.headers), body))
                status = owner.script.pop(0) if owner.script else 200
                self.send_response(status)
                if status in (301, 302, 307, 308):
                    self.send_header("Location", f"http://{owner.host}/elsewhere")
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_port
        self.host = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.host}/hooks/job?token=t0ps3cret"
        self.allowed = frozenset({self.host})  # an IP literal: loopback allowed as listed
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def _sender(allowed: frozenset[str], delays: list[float] | None = None, **kw: Any) -> Any:
    sleep = (lambda s: None) if delays is None else delays.append
    return CallbackSender(allowed, sleep=sleep, **kw)


def test_delivery_is_signed_and_verifies(receiver: Receiver) -> None:
    secret = tenant_secret(MASTER, "acme")
    payload = {"job_id": "j1", "status": "succeeded", "pages": 3}
    assert _sender(receiver.allowed).deliver(receiver.url, secret, payload)
    [(path, headers, body)] = receiver.posts
    assert path == "/hooks/job?token=t0ps3cret"
    assert orjson.loads(body) == payload
    assert headers["Content-Type"] == "application/json"
    assert headers["Host"] == receiver.host
    message_id = headers["webhook-id"]
    assert message_id.startswith("msg_") and len(message_id) == 4 + 22
    assert verify(secret, headers, body)
    assert not verify(tenant_secret(MASTER, "globex"), headers, body)
    assert Webhook(secret).verify(body, headers) == payload  # the spec's own library agrees


def test_retries_keep_the_webhook_id(receiver: Receiver, caplog: pytest.LogCaptureFixture) -> None:
    receiver.script = [500, 500]
    delays: list[float] = []
    secret = tenant_secret(MASTER, "acme")
    with caplog.at_level(logging.WARNING, logger="app.jobs.callback"):
        assert _sender(receiver.allowed, delays).deliver(receiver.url, secret, {"a": 1})
    assert len(receiver.posts) == 3
    assert len({h["webhook-id"] for _, h, _ in receiver.posts}) == 1
    assert all(verify(secret, h, b) for _, h, b in receiver.posts)  # each attempt signed anew
    assert delays == [1.0, 2.0]
    failed = [r for r in caplog.records if r.name == "app.jobs.callback"]
    assert len(failed) == 2  # one line per failed attempt
    text = caplog.text
    assert "HTTP 500" in text and secret not in text and "t0ps3cret" not in text


def test_429_and_408_are_retried(receiver: Receiver) -> None:
    receiver.script = [429, 408]
    assert _sender(receiver.allowed).deliver(receiver.url, MASTER, {})
    assert len(receiver.posts) == 3


def test_redirect_is_not_followed(receiver: Receiver) -> None:
    receiver.script = [302]
    assert not _sender(receiver.allowed).deliver(receiver.url, MASTER, {})
    assert len(receiver.posts) == 1 and receiver.elsewhere == 0


def test_400_stops_at_once(receiver: Receiver) -> None:
    receiver.script = [400, 200]
    delays: list[float] = []
    assert not _sender(receiver.allowed, delays).deliver(receiver.url, MASTER, {})
    assert len(receiver.posts) == 1 and delays == []


def test_gives_up_after_attempts_on_persistent_5xx(receiver: Receiver) -> None:
    receiver.script = [503] * 10
    assert not _sender(receiver.allowed, attempts=4).deliver(receiver.url, MASTER, {})
    assert len(receiver.posts) == 4


def test_unreachable_port_fails_after_all_attempts(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    delays: list[float] = []
    sender = _sender(frozenset({f"127.0.0.1:{port}"}), delays, attempts=3)
    with caplog.at_level(logging.WARNING, logger="app.jobs.callback"):
        assert not sender.deliver(f"http://127.0.0.1:{port}/", MASTER, {})
    assert delays == [1.0, 2.0]
    assert len([r for r in caplog.records if r.name == "app.jobs.callback"]) == 3
    assert "giving up" in caplog.records[-1].getMessage()


def test_backoff_doubles_up_to_a_minute() -> None:
    port = free_port()
    delays: list[float] = []
    sender = _sender(frozenset({f"127.0.0.1:{port}"}), delays, attempts=9)
    assert not sender.deliver(f"http://127.0.0.1:{port}/", MASTER, {})
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60]


def test_a_silent_receiver_costs_one_timeout_per_attempt() -> None:
    with socket.socket() as listener:  # accepts (the kernel's backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        sender = _sender(frozenset({f"127.0.0.1:{port}"}), attempts=2, timeout_s=0.3)
        started = time.monotonic()
        assert not sender.deliver(f"http://127.0.0.1:{port}/", MASTER, {})
        assert time.monotonic() - started < 3


def test_loopback_name_and_unlisted_urls_are_not_contacted(receiver: Receiver) -> None:
    """``localhost`` resolves to loopback: refused unless the address is listed as a literal;
    a URL outside the allow-list is never sent."""
    allowed = frozenset({f"localhost:{receiver.port}"})
    url = f"http://localhost:{receiver.port}/"
    assert not _sender(allowed, attempts=2).deliver(url, MASTER, {})
    assert not _sender(frozenset({"hooks.example.com"})).deliver(receiver.url, MASTER, {})
    assert not _sender(frozenset()).deliver(receiver.url, MASTER, {})
    assert receiver.posts == []
