"""Docker HEALTHCHECK (and the Kubernetes front container's exec probe): exit 0 when
GET /healthz answers 200. The image has no curl; standard library only, so it starts fast.

Where it asks, from the same environment the service reads (app/config):
- an engine (``healthcheck.py engine``, or the container's command is ``engine``: PID 1's
  command line ends with it, as tini runs ``entrypoint.sh engine``): its own port
  ``ENGINE_PORT`` (default 18100) on the loopback address;
- ``EDGE=external`` (the Kubernetes pod's front container): granian's unix socket
  ``EDGE_SOCKET`` directly, since the edge runs in another container;
- otherwise ``HTTP_PORT`` on the loopback address (nginx, or granian itself with ``EDGE=none``
  or no nginx installed), over https without verifying the certificate when ``TLS_CERT_FILE``
  is set (nginx then speaks TLS only; the certificate names the public host, not 127.0.0.1).
"""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import sys
from collections.abc import Mapping

TIMEOUT_SECONDS = 4.0  # the HEALTHCHECK's --timeout is 5 s


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a connected AF_UNIX socket."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)  # the Host header only
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _loopback(host: str) -> str:
    """The address to reach a server listening on ``host`` from inside the container."""
    host = host.strip().strip("[]")
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":  # nginx listens IPv6-only on [::] (ipv6only=on)
        return "::1"
    return host


def container_role(cmdline: str = "/proc/1/cmdline") -> str:
    """``engine`` when PID 1's command line (tini's: ``tini -- entrypoint.sh engine``) ends with
    that command, else "" (``serve``, ``front``, anything else, or no such file)."""
    try:
        with open(cmdline, "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return ""
    return "engine" if argv and argv[-1] == "engine" else ""


def connection(environ: Mapping[str, str], role: str = "") -> http.client.HTTPConnection:
    if role == "engine":
        port = int(environ.get("ENGINE_PORT", "").strip() or "18100")
        return http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_SECONDS)
    if environ.get("EDGE", "").strip().lower() == "external":
        return UnixHTTPConnection(environ["EDGE_SOCKET"].strip(), TIMEOUT_SECONDS)
    host = _loopback(environ.get("HOST", ""))
    port = int(environ.get("HTTP_PORT", "").strip() or "9998")
    if environ.get("TLS_CERT_FILE", "").strip():
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return http.client.HTTPSConnection(host, port, timeout=TIMEOUT_SECONDS, context=context)
    return http.client.HTTPConnection(host, port, timeout=TIMEOUT_SECONDS)


def main(environ: Mapping[str, str] = os.environ, role: str | None = None) -> int:
    """``role``: ``engine`` or "" (a front or ``serve``); None: the container's (PID 1)."""
    if role is None:
        role = container_role()
    try:
        conn = connection(environ, role)
        try:
            conn.request("GET", "/healthz")
            status = conn.getresponse().status
        finally:
            conn.close()
    except (OSError, KeyError, ValueError, http.client.HTTPException) as exc:
        print(f"unhealthy: {exc!r}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"unhealthy: /healthz answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(role=sys.argv[1] if len(sys.argv) > 1 else None))
