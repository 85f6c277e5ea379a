"""Fetching ``file`` URLs for PaddleX requests — off unless hosts are allow-listed (SSRF).

The URL is parsed once, by urllib3's ``parse_url`` (the parser of the client that fetches
it), and the request is rebuilt from those parts: no other parser ever sees the raw text, so
the allow-list check and the connection cannot disagree about the host (a ``urlsplit`` check
let ``http://a:1\\@b:2/`` through to ``a:1``). Refused outright: anything but http(s),
userinfo, backslashes, whitespace, control and non-ASCII characters, ports outside 1-65535.

The host must be in ``URL_INPUT_ALLOWED_HOSTS`` (``host`` or ``host:port``; IPv6 as
``[::1]``). A name is resolved once, here; if any of its addresses is loopback, link-local
(cloud metadata), multicast, unspecified or reserved, the URL is refused (allow such an
address by listing it as an IP literal), and the connection goes to the checked address
(pinned: a second DNS answer cannot switch it; HTTPS still verifies the certificate for the
name). No redirects, no content encodings (no decompression bombs), at most ``max_bytes``,
and one deadline for the whole exchange — connect, headers and body — so a host trickling
bytes cannot hold a request thread.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from http.client import HTTPException

import certifi
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.exceptions import HTTPError, LocationParseError
from urllib3.util import parse_url

from app.protocols.errors import BadRequest

# Whitespace, controls, DEL, backslash and anything outside ASCII: never in a URL we fetch.
_FORBIDDEN = re.compile(r"[\x00-\x20\x7f\\]|[^\x00-\x7f]")
_CHUNK = 64 * 1024
# Name lookups (getaddrinfo cannot be interrupted): a request waits for one at most its
# deadline, and a hung lookup holds one of these threads, not a request thread.
_RESOLVER = ThreadPoolExecutor(4, thread_name_prefix="url-resolve")


def is_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))


@dataclass(frozen=True)
class Target:
    """A validated URL, as the parts the request is rebuilt from."""

    scheme: str
    host: str  # lower case; IPv6 in brackets
    port: int
    request_uri: str  # path and query, as urllib3 normalised them

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return self.host if self.port == default else f"{self.host}:{self.port}"


def parse(url: str, allowed_hosts: frozenset[str]) -> Target:
    """The URL's parts if it may be fetched, else ``BadRequest`` naming why."""
    if not allowed_hosts:
        raise BadRequest("URL input is disabled on this service; send the file as base64")
    if len(url) > 8192:
        raise BadRequest("URL is over 8192 characters")
    if _FORBIDDEN.search(url):
        raise BadRequest("URL contains whitespace, a control character, a backslash or non-ASCII")
    try:
        parts = parse_url(url)
    except (LocationParseError, ValueError) as exc:
        raise BadRequest(f"not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise BadRequest("only http and https URLs are fetched")
    if parts.auth is not None or "@" in (parts.netloc or ""):
        raise BadRequest("URLs with user information are refused")
    host = (parts.host or "").lower()
    if not host or "%" in host:  # no IPv6 zone ids
        raise BadRequest("URL has no valid host")
    port = parts.port if parts.port is not None else (443 if parts.scheme == "https" else 80)
    if not 1 <= port <= 65535:
        raise BadRequest(f"URL port {port} is out of range")
    if host not in allowed_hosts and f"{host}:{port}" not in allowed_hosts:
        raise BadRequest(f"URL host {host}:{port} is not allowed")
    return Target(parts.scheme, host, port, parts.request_uri or "/")


def resolve(target: Target, allowed_hosts: frozenset[str], timeout: float = 10.0) -> str:
    """The address to connect to: checked, and pinned for the connection. The lookup runs
    on a helper thread so a slow resolver costs the request ``timeout`` at most."""
    literal = target.host.strip("[]")
    try:
        return str(ipaddress.ip_address(literal))  # an IP literal was allow-listed as such
    except ValueError:
        pass
    lookup = _RESOLVER.submit(socket.getaddrinfo, literal, target.port, type=socket.SOCK_STREAM)
    try:
        infos = lookup.result(timeout=timeout)
    except FutureTimeout:
        raise BadRequest(f"resolving the URL host took longer than {timeout:g} s") from None
    except (OSError, UnicodeError) as exc:
        raise BadRequest(f"could not resolve the URL host: {exc.__class__.__name__}") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    for address in addresses:
        listed = str(address) in allowed_hosts or f"[{address}]" in allowed_hosts
        if _special(address) and not listed:
            raise BadRequest(f"URL host {target.host} resolves to a refused address {address}")
    if not addresses:
        raise BadRequest("could not resolve the URL host")
    return str(addresses[0])


def _special(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    if mapped is not None:
        address = mapped
    return (
        address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_unspecified
        or address.is_reserved
    )


def fetch(url: str, allowed_hosts: frozenset[str], max_bytes: int, timeout: float = 10.0) -> bytes:
    """The body at ``url`` (HTTP 200 only), within ``timeout`` seconds overall."""
    target = parse(url, allowed_hosts)
    deadline = time.monotonic() + timeout
    address = resolve(target, allowed_hosts, timeout)
    with pinned(target, address, max(0.1, deadline - time.monotonic())) as (conn, expired):
        try:
            return _download(conn, target, max_bytes)
        except BadRequest:
            raise
        except (HTTPError, HTTPException, OSError, ValueError) as exc:
            if expired.is_set():
                raise BadRequest(f"fetching the URL took longer than {timeout:g} s") from None
            raise BadRequest(f"could not fetch the URL: {exc.__class__.__name__}") from None


@contextmanager
def pinned(
    target: Target, address: str, seconds: float
) -> Iterator[tuple[HTTPConnection, threading.Event]]:
    """A connection for ``target`` to its checked ``address`` (HTTPS still verifies the
    certificate for the name), and the event set when ``seconds`` ran out: one deadline for
    everything, at which the socket is shut down, ending any read (per-read timeouts alone
    let a host send a byte every few seconds forever). Also the job callbacks' way out."""
    name = target.host.strip("[]")
    if target.scheme == "https":
        conn: HTTPConnection = HTTPSConnection(
            address, target.port, timeout=seconds, server_hostname=name, assert_hostname=name,
            cert_reqs="CERT_REQUIRED", ca_certs=certifi.where(),
        )  # fmt: skip
    else:
        conn = HTTPConnection(address, target.port, timeout=seconds)
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield conn, expired
    finally:
        timer.cancel()
        conn.close()


def _download(conn: HTTPConnection, target: Target, max_bytes: int) -> bytes:
    conn.request(
        "GET",
        target.request_uri,
        headers={"Host": target.host_header, "Accept-Encoding": "identity", "Accept": "*/*"},
        preload_content=False,
        decode_content=False,
    )
    resp = conn.getresponse()
    if resp.status != 200:
        raise BadRequest(f"fetching the URL gave HTTP {resp.status}")  # redirects included
    encoding = (resp.headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise BadRequest(f"the URL answered with Content-Encoding {encoding!r}; not accepted")
    declared = resp.headers.get("Content-Length")
    if declared is not None and declared.isascii() and declared.strip().isdigit():
        if int(declared) > max_bytes:
            raise BadRequest(f"the file at the URL is over {max_bytes} bytes")
    data = bytearray()
    while True:
        chunk = resp.read1(_CHUNK)  # whatever has arrived: the deadline is checked by the timer
        if not chunk:
            break
        data.extend(chunk)
        if len(data) > max_bytes:
            raise BadRequest(f"the file at the URL is over {max_bytes} bytes")
    return bytes(data)
