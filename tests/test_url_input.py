"""``file`` as a URL on PaddleX ``/ocr`` (issue 11 §2), against real HTTP servers on loopback:
an allowed one serving an image, a "secret" one that must never be reached, and hosts that
trickle bytes, redirect, compress or send too much. URLs are also generated (hypothesis) from
hostile pieces: every answer is 200 or 422, and no request ever reaches the secret server."""

from __future__ import annotations

import gzip
import http.server
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from app.protocols import fetch
from app.protocols.errors import BadRequest
from tests.conftest import WORD_EN

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IMAGE = WORD_EN.read_bytes()


class Server:
    """A real HTTP server on a free loopback port; records every request it gets."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                owner.requests.append((self.path, dict(self.headers)))
                owner.respond(self)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_port
        self.host = f"127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def respond(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        path = handler.path
        if path.startswith("/redirect"):
            handler.send_response(302)
            handler.send_header("Location", f"http://{self.host}/word.png")
            handler.send_header("Content-Length", "0")
            handler.end_headers()
        elif path.startswith("/gzip"):
            body = gzip.compress(b"\0" * 10_000_000)  # a 10 MB bomb in 10 KB
            handler.send_response(200)
            handler.send_header("Content-Encoding", "gzip")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
        elif path.startswith("/huge"):
            handler.send_response(200)
            handler.send_header("Content-Length", str(1 << 40))
            handler.end_headers()
        elif path.startswith("/endless"):  # no length: streamed until the cap
            handler.send_response(200)
            handler.send_header("Connection", "close")
            handler.end_headers()
            try:
                for _ in range(10_000):
                    handler.wfile.write(b"\0" * 65536)
            except OSError:
                pass
        elif path.startswith("/trickle-body"):
            handler.send_response(200)
            handler.send_header("Content-Length", "100000")
            handler.end_headers()
            _trickle(handler.wfile)
        elif path.startswith("/trickle-headers"):
            _trickle(handler.wfile, b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 1000)
        else:
            handler.send_response(200)
            handler.send_header("Content-Type", "image/png")
            handler.send_header("Content-Length", str(len(IMAGE)))
            handler.end_headers()
            handler.wfile.write(IMAGE)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _trickle(wfile: Any, data: bytes = b"x" * 1000) -> None:
    """One byte every 0.2 s (the issue's host sent one every 2 s and held a thread 46 s)."""
    try:
        for byte in data:
            wfile.write(bytes([byte]))
            wfile.flush()
            time.sleep(0.2)
    except OSError:
        pass


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Server, Server]]:
    good, secret = Server(), Server()
    yield good, secret
    good.stop()
    secret.stop()


@pytest.fixture()
def paddlex(make_app, servers):  # type: ignore[no-untyped-def]
    good, secret = servers
    good.requests.clear()
    secret.requests.clear()
    app = make_app(url_input_allowed_hosts=good.host, url_input_timeout_seconds=2.0)
    client = app.test_client()

    def post(url: str):  # type: ignore[no-untyped-def]
        return client.post("/ocr", json={"file": url, "fileType": 1})

    return post


def test_allowed_url_is_fetched_with_the_request_rebuilt(paddlex, servers):
    good, _ = servers
    resp = paddlex(f"http://{good.host}/a/../word.png?x=1")
    assert resp.status_code == 200, resp.get_json()
    assert resp.get_json()["result"]["ocrResults"][0]["prunedResult"]["rec_texts"]
    path, headers = good.requests[-1]
    assert path == "/word.png?x=1" and headers["Host"] == good.host
    assert headers["Accept-Encoding"] == "identity"


def test_parser_differential_from_the_review_is_refused(paddlex, servers):
    good, secret = servers
    hostile = [
        f"http://127.0.0.1:{secret.port}\\@127.0.0.1:{good.port}/../secret.png",
        f"http://127.0.0.1:{good.port}\\@127.0.0.1:{secret.port}/../secret.png",
        f"http://127.0.0.1:{good.port}@127.0.0.1:{secret.port}/secret.png",
        f"http://user:pw@127.0.0.1:{good.port}/word.png",
        f"http://127.0.0.1:{good.port} @127.0.0.1:{secret.port}/",
        f"http://127.0.0.1:{good.port}\t/word.png",
        f"http://127.0.0.1:{good.port}/word.png\r\nX-Injected: 1",
        f"http://127.0.0.1:{secret.port}#@127.0.0.1:{good.port}/",
        f"http://127.0.0.1:{secret.port}?@127.0.0.1:{good.port}/",
        f"http://127.0.0.1:{secret.port}/word.png",
        f"http://localhost:{good.port}/word.png",
        f"http://127.0.0.1.:{good.port}/word.png",
        f"http://0x7f000001:{good.port}/word.png",
        f"http://ｌｏｃａｌｈｏｓｔ:{good.port}/",
    ]
    for url in hostile:
        resp = paddlex(url)
        assert resp.status_code == 422, (url, resp.get_json())
    assert secret.requests == []


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:99999/x.png",
        "http://127.0.0.1:0/x.png",
        "http://127.0.0.1:abc/x.png",
        "http://[::1/x.png",
        "http://[::1]]:80/x.png",
        "http://[fe80::1%25eth0]:80/x.png",
        "http://",
        "http:///x.png",
        "https://:443/",
        "http://" + "a" * 9000 + "/",
        "abc",
    ],
)
def test_malformed_urls_are_422(paddlex, url):
    resp = paddlex(url)
    assert resp.status_code == 422, resp.get_json()
    assert resp.get_json()["errorMsg"]


@pytest.mark.parametrize(
    "path,message",
    [
        ("/redirect.png", "HTTP 302"),
        ("/gzip.png", "Content-Encoding"),
        ("/huge.png", "over"),
        ("/endless.png", "over"),
        ("/trickle-body.png", "longer than 2"),
        ("/trickle-headers.png", "longer than 2"),
    ],
)
def test_hostile_hosts_cost_at_most_the_deadline(paddlex, servers, path, message):
    good, _ = servers
    started = time.monotonic()
    resp = paddlex(f"http://{good.host}{path}")
    elapsed = time.monotonic() - started
    assert resp.status_code == 422 and message in resp.get_json()["errorMsg"], resp.get_json()
    assert elapsed < 10, elapsed  # deadline 2 s; generous for a loaded machine


def test_https_is_verified_against_the_name(paddlex, servers):
    good, _ = servers
    resp = paddlex(f"https://{good.host}/word.png")  # no TLS there: the handshake fails
    assert resp.status_code == 422 and "could not fetch" in resp.get_json()["errorMsg"]


def test_a_name_is_resolved_once_and_the_checked_address_is_used(servers, monkeypatch):
    """DNS rebinding: the first answer is checked and pinned; a later answer pointing at
    the metadata address is never asked for or used."""
    good, _ = servers
    real = socket.getaddrinfo
    asked: list[str] = []

    def rebinding(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "images.test":
            asked.append(host)
            ip = "127.0.0.1" if len(asked) == 1 else "169.254.169.254"
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, good.port))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    allowed = frozenset({f"images.test:{good.port}", "127.0.0.1"})
    assert fetch.fetch(f"http://images.test:{good.port}/word.png", allowed, 1 << 20) == IMAGE
    assert asked == ["images.test"]
    assert good.requests[-1][1]["Host"] == f"images.test:{good.port}"
    # Without the loopback literal in the list, a name resolving to loopback is refused.
    with pytest.raises(BadRequest, match="refused address"):
        fetch.fetch(f"http://images.test:{good.port}/word.png", frozenset({"images.test"}), 1 << 20)


def test_a_slow_resolver_costs_at_most_the_deadline(servers, monkeypatch):
    good, _ = servers
    real = socket.getaddrinfo

    def slow(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "slow.test":
            time.sleep(5)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    started = time.monotonic()
    with pytest.raises(BadRequest, match="resolving the URL host took longer"):
        fetch.fetch("http://slow.test/word.png", frozenset({"slow.test"}), 1 << 20, timeout=0.5)
    assert time.monotonic() - started < 4  # the lookup itself takes 5 s


# --- generated URLs -------------------------------------------------------------------------

SEPARATORS = ["", "@", "\\", "\\@", "#", "?", "/", ":", "%40", "%5C", "%2F", " ", "\t", "\r\n",
              "\x00", "..", "/..", "%2e%2e", ";", ",", "[", "]", "\u3002", "ｆ"]  # fmt: skip


@st.composite
def urls(draw: st.DrawFn, good: int, secret: int) -> str:
    if draw(st.integers(0, 3)) == 0:  # well formed and allowed: these are fetched
        path = draw(st.sampled_from(["/word.png", "/a/../word.png", "/word.png?x=%40", "/w%2Fx"]))
        return f"http://127.0.0.1:{good}{path}"
    scheme = draw(st.sampled_from(["http://", "https://", "HTTP://", "http:/", "http:\\\\", ""]))
    hosts = ["127.0.0.1", "localhost", "[::1]", "127.1", "0", "2130706433", "[::ffff:127.0.0.1]",
             "169.254.169.254", "example.org", ""]  # fmt: skip
    ports = [str(good), str(secret), "", "0", "99999", "-1", "abc", f"{good}{secret}"]
    pieces = []
    for _ in range(draw(st.integers(1, 3))):
        host = draw(st.sampled_from(hosts))
        port = draw(st.sampled_from(ports))
        pieces.append(host + (f":{port}" if port else ""))
        pieces.append(draw(st.sampled_from(SEPARATORS)))
    path = draw(st.sampled_from(["/word.png", "/../secret.png", "", "/redirect.png", "?q=1"]))
    return scheme + "".join(pieces) + path


@settings(
    max_examples=300,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_generated_urls_never_reach_another_host(paddlex, servers, data):
    good, secret = servers
    url = data.draw(urls(good.port, secret.port))
    before = len(good.requests)
    resp = paddlex(url)
    event(f"HTTP {resp.status_code}")
    assert resp.status_code in (200, 422), (url, resp.status_code, resp.get_json())
    assert secret.requests == [], url
    if resp.status_code == 200:
        # Only a URL whose host and port are the allowed ones was fetched, once.
        target = fetch.parse(url, frozenset({good.host}))
        assert (target.host, target.port) == ("127.0.0.1", good.port)
        assert len(good.requests) == before + 1
