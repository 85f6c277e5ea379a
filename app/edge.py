"""nginx at the edge: the buffering proxy that Python servers' deployment guides put in front
of their workers (gunicorn's names nginx), here in front of the front's server (granian).
nginx reads every request whole (a slow client costs it a connection, never a worker thread),
limits bodies and request rates, speaks TLS and HTTP/2 to clients, writes the JSON access log
and hands each request to the front's server over a unix socket.

This module renders nginx's configuration from the service's settings (``nginx.conf.j2``)
and runs nginx as a supervised child: ``Edge.quit`` stops it gracefully (SIGQUIT: in-flight
requests finish; SIGTERM would drop them). ``python -m app serve`` starts it beside the front's
server (``EDGE=nginx``); ``python -m app edge`` runs it alone, in front of a front server
elsewhere that shares the socket's folder (the Kubernetes pod's edge container, ``EDGE=external``).

The answers nginx makes itself (413, 429, 502, 504, and those to a request it cannot parse:
400, 414, 494, 501, 505) are rendered by each protocol's own error code into the
configuration, so a client reads them as it reads the service's own.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jinja2

from app.config import Settings
from app.protocols import kserve, paddlex, pipeline, pipeline_http, rest

log = logging.getLogger("app.edge")

TEMPLATE = Path(__file__).with_name("nginx.conf.j2")
# Bodies up to this size stay in nginx's memory (a 312 KB image is a 416 KB JSON body).
BODY_BUFFER_BYTES = 512 * 1024
# The front's server keeps idle connections from nginx longer than nginx does (see the
# template): granian closes one idle for its header read timeout, at most 60 s.
UPSTREAM_KEEPALIVE_SECONDS = 45
SERVER_KEEPALIVE_SECONDS = 60
# The answers nginx makes itself, in each protocol's form.
STATUSES = (413, 429, 502, 504)
# ... and its answers to a request it cannot parse, mostly before it picks a location: in the
# form of the protocol the path belongs to where it read one (``map $uri``), else REST.
MALFORMED = (400, 414, 494, 501, 505)
# nginx's own 494 (a header line over its buffers) reaches the client as 400, as nginx sends it.
ANSWERED = {494: 400}
# Where those with no path read (a malformed request line) are answered: an internal location
# no client's path reaches, since nginx merges the slashes of every path it reads.
NO_PATH = "//edge-error/"
# large_client_header_buffers: a request line and each header line fit in one buffer.
HEAD_BUFFERS, HEAD_BUFFER_BYTES = 4, 8192
_MESSAGES = {
    413: "request body over {max_body} bytes",
    429: "rate limit exceeded: at most {rate} requests per second per client; retry later",
    502: "the service is not answering; retry later",
    504: "the service did not answer in time",
    400: (
        "malformed HTTP request: a bad request line, header line, Host, Content-Length or "
        "chunk size"
    ),
    414: "request line over {head_buffer} bytes",
    494: "a request header line over {head_buffer} bytes, or a request head over {head} bytes",
    501: "unsupported Transfer-Encoding: only chunked is accepted",
    505: "unsupported HTTP version: HTTP/1.0 and HTTP/1.1 are served (HTTP/2 over TLS)",
}
# REST's error.code: the app's for the same status (werkzeug's name), nginx's own otherwise.
_CODES = {
    413: "too_large",
    429: "rate_limited",
    502: "unavailable",
    504: "timeout",
    400: "bad_request",
    414: "request_uri_too_large",
    494: "request_header_fields_too_large",
    501: "not_implemented",
    505: "http_version_not_supported",
}
_LOG_ID = "EDGE_REQUEST_ID"  # the request's X-Request-Id in the PaddleX envelope


@dataclass(frozen=True)
class Form:
    """One protocol's error answers: (nginx's status, the status sent, body) for
    ``STATUSES`` and ``MALFORMED``."""

    name: str
    bodies: tuple[tuple[int, int, str], ...]


@dataclass(frozen=True)
class Location:
    match: str
    form: str
    comment: str
    max_body: int = 0  # its own body limit (0: MAX_REQUEST_BYTES)
    # A recognition: sent once more after a connection error even when it is a POST (an
    # image read twice gives the same answer, single flight), unlike a job's upload.
    recognizes: bool = False


def find_nginx(given: str = "") -> str | None:
    """``given`` (EDGE_NGINX) when set, if it can run; else the ``nginx`` on PATH, the one
    ``make install`` put beside this Python (the venv's bin), or Debian's /usr/sbin/nginx
    (sbin is not on every PATH)."""
    if given:
        return given if os.access(given, os.X_OK) else None
    found = shutil.which("nginx")
    for candidate in (os.path.join(os.path.dirname(sys.executable), "nginx"), "/usr/sbin/nginx"):
        if found is None and os.access(candidate, os.X_OK):
            found = candidate
    return found


def nginx_version(binary: str) -> tuple[int, ...]:
    """``nginx -v`` prints ``nginx version: nginx/1.22.1`` (on stderr)."""
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=10)
    match = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", out.stderr + out.stdout)
    return tuple(int(part) for part in match.groups()) if match else (0, 0, 0)


def forms(settings: Settings) -> tuple[Form, ...]:
    """The protocols' own error bodies for the answers nginx makes itself."""
    values = {
        "max_body": settings.server.max_request_bytes,
        "rate": f"{settings.edge.rate_limit.rate:g}" if settings.edge.rate_limit else "",
        "head_buffer": HEAD_BUFFER_BYTES,
        "head": HEAD_BUFFERS * HEAD_BUFFER_BYTES,
    }
    messages = {status: text.format(**values) for status, text in _MESSAGES.items()}

    def pipeline_body(status: int) -> bytes:
        err_no = pipeline.TIMEOUT if status == 504 else pipeline.UNKNOWN_ERROR
        answer = pipeline.PipelineAnswer(err_no=err_no, err_msg=messages[status])
        return pipeline_http.render(answer)

    renderers: dict[str, Callable[[int], bytes]] = {
        "rest": lambda status: rest.error_body(_CODES[status], messages[status]),
        "paddlex": lambda status: paddlex.error(_LOG_ID, _answered(status), messages[status]),
        "pipeline": pipeline_body,
        "kserve": lambda status: kserve.error_body(messages[status]),
    }
    return tuple(
        Form(
            name,
            tuple(
                (status, _answered(status), _nginx_string(render(status)))
                for status in STATUSES + MALFORMED
            ),
        )
        for name, render in renderers.items()
    )


def _answered(status: int) -> int:
    return ANSWERED.get(status, status)


def _path_forms(locations: list[Location]) -> list[tuple[str, str]]:
    """The locations as ``map $uri`` regexes (exact matches first, then prefixes, longest
    first, as nginx picks a location), each with its form; any other path is REST's."""
    exact = [loc for loc in locations if loc.match.startswith("= ")]
    prefixes = sorted(
        (loc for loc in locations if not loc.match.startswith("= ") and loc.match != "/"),
        key=lambda loc: -len(loc.match),
    )
    found = [(f"^{re.escape(loc.match[2:])}$", loc.form) for loc in exact]
    found += [(f"^{re.escape(loc.match)}", loc.form) for loc in prefixes]
    return found


def _nginx_string(body: bytes) -> str:
    """A body for ``return STATUS '...'``: nginx reads ``$`` as a variable and ``\\`` and
    ``'`` as quoting, so none may occur (our messages have none)."""
    text = body.decode()
    if any(c in text for c in "$\\'\n"):
        raise ValueError(f"an edge error body nginx cannot quote: {text!r}")
    return text.replace(_LOG_ID, "$edge_request_id")


def _listen(settings: Settings) -> list[str]:
    host = settings.server.host
    if ":" in host:  # IPv6
        return [f"[{host}]:{settings.server.http_port}"]
    return [f"{host}:{settings.server.http_port}"]


def render(settings: Settings, socket: str, run_dir: str, version: tuple[int, ...]) -> str:
    """nginx.conf for these settings, the front's server on ``socket``, temp files under
    ``run_dir``."""
    del version  # every directive used is in nginx 1.18 (Ubuntu 22.04) and later
    limit = settings.edge.rate_limit
    name = settings.protocols.pipeline_service_name
    locations = [
        Location("= /v1/ocr", "rest", "REST", recognizes=True),
        Location("= /ocr", "paddlex", "PaddleX / PaddleOCR 3.x serving", recognizes=True),
        Location(
            f"/{name}/", "pipeline", "Paddle Serving pipeline: /{name}/{method}", recognizes=True
        ),
        Location(
            "/v2/",
            "kserve",
            "Open Inference Protocol (KServe v2, Triton's clients)",
            recognizes=True,
        ),  # fmt: skip
        Location("= /v1/jobs", "rest", "document jobs", settings.jobs.upload_limit()),
        Location("= /api/v2/ocr/jobs", "rest", "PaddleOCR's job API", settings.jobs.upload_limit()),
        Location("/", "rest", "everything else: the web page, stats, admin"),
    ]
    answers = forms(settings)
    rest_form = next(form for form in answers if form.name == "rest")
    environment = jinja2.Environment(
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, autoescape=False
    )
    template = environment.from_string(TEMPLATE.read_text())
    return template.render(
        workers=settings.edge.workers,
        user="root" if os.geteuid() == 0 else "",  # else nginx's workers would be nobody
        run_dir=run_dir,
        error_level="info" if settings.server.log_level == "DEBUG" else "warn",
        shutdown_seconds=settings.server.request_timeout_seconds,
        worker_connections=4096,
        header_timeout=_seconds(settings.edge.header_timeout_seconds),
        body_timeout=_seconds(settings.edge.body_timeout_seconds),
        max_body_bytes=settings.server.max_request_bytes,
        body_buffer_bytes=min(BODY_BUFFER_BYTES, settings.server.max_request_bytes),
        access_log=settings.edge.access_log,
        real_ip_from=[str(network) for network in settings.edge.real_ip_from],
        rate=_nginx_rate(limit.rate) if limit else "",
        rate_setting=str(limit) if limit else "",
        burst=limit.burst if limit else 0,
        retry_after=limit.retry_after() if limit else 1,
        socket=socket,
        upstream_keepalive_seconds=UPSTREAM_KEEPALIVE_SECONDS,
        listen=_listen(settings),
        tls={"cert": settings.edge.tls_cert_file, "key": settings.edge.tls_key_file}
        if settings.edge.tls_cert_file
        else None,
        upstream_timeout=settings.server.request_timeout_seconds + 30,
        head_buffers=HEAD_BUFFERS,
        head_buffer_bytes=HEAD_BUFFER_BYTES,
        statuses=STATUSES + MALFORMED,
        malformed=MALFORMED,
        path_forms=_path_forms(locations),
        no_path=NO_PATH,
        no_path_bodies=[body for body in rest_form.bodies if body[0] in MALFORMED],
        locations=locations,
        forms=answers,
    )


def _seconds(value: float) -> str:
    """nginx time: whole seconds, or milliseconds below a second."""
    return f"{round(value)}s" if value >= 1 else f"{max(1, round(value * 1000))}ms"


def _nginx_rate(rate: float) -> str:
    """nginx counts whole requests per second or per minute."""
    if rate >= 1 and float(rate).is_integer():
        return f"{int(rate)}r/s"
    return f"{max(1, round(rate * 60))}r/m"


class Edge:
    """One nginx master (and its workers), configured for these settings and this socket."""

    def __init__(self, settings: Settings, socket: str, binary: str) -> None:
        self._binary = binary
        self._version = nginx_version(binary)
        self.run_dir = tempfile.mkdtemp(prefix="ocr-edge-")
        self.config = os.path.join(self.run_dir, "nginx.conf")
        Path(self.config).write_text(render(settings, socket, self.run_dir, self._version))
        self._timeout = settings.server.request_timeout_seconds + 10
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = False

    def _command(self, *extra: str) -> list[str]:
        # -e: the error log before the configuration is read (nginx >= 1.19.5), else the
        # compiled-in path, which a read-only root cannot open (an alert, not an error).
        early_log = ["-e", "stderr"] if self._version >= (1, 19, 5) else []
        return [self._binary, *early_log, "-p", self.run_dir, "-c", self.config, *extra]

    def check(self) -> None:
        """``nginx -t``: raises ``RuntimeError`` with nginx's own words when it refuses."""
        out = subprocess.run(self._command("-t"), capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"nginx refused its configuration: {out.stderr.strip()}")

    def start(self, on_exit: Callable[[], None] | None = None) -> None:
        """Start nginx in its own session (a terminal's Ctrl-C reaches the service, which
        stops nginx in order); it gets SIGTERM should this process die first."""
        self._proc = subprocess.Popen(
            self._command(), start_new_session=True, preexec_fn=_die_with_parent
        )
        log.info("edge: nginx on %s (config %s)", self.config, self._proc.pid)
        watch = threading.Thread(target=self._watch, args=(on_exit,), name="edge-watch")
        watch.daemon = True
        watch.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _watch(self, on_exit: Callable[[], None] | None) -> None:
        # the server's reaper may collect nginx first: wait() then returns without a status.
        assert self._proc is not None
        self._proc.wait()
        if not self._stopping:
            log.error("edge: nginx exited; stopping the service")
            if on_exit is not None:
                on_exit()

    def quit(self, graceful: bool = True) -> None:
        """SIGQUIT: stop accepting, finish in-flight requests, close idle connections, exit.
        Not graceful (SIGTERM): at once."""
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signal.SIGQUIT if graceful else signal.SIGTERM)
                proc.wait(timeout=self._timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            except ProcessLookupError:
                pass
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def run(self) -> int:
        """In the foreground (``python -m app edge``): SIGTERM and SIGINT stop nginx
        gracefully; returns nginx's exit status."""
        self.start()
        assert self._proc is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: threading.Thread(target=self.quit).start())
        code = self._proc.wait()
        self.quit()
        return 0 if self._stopping else code


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent goes (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
