"""nginx's own answers to a request it cannot parse (issue 36 §5), through the real nginx
edge (app/edge.py renders its configuration, as ``python -m app serve`` runs it): a bad
header, no Host, a bad or doubled Content-Length, a bad chunk size, an obs-fold line, a bad
method, a request line or header line over the head buffers, ``Transfer-Encoding: gzip`` and
HTTP/3.0 are each JSON in the form of the protocol the path belongs to (REST where nginx read
no path), with ``X-Request-Id``, sent over a raw socket as a client would.

None of these reaches granian, so nginx runs alone here (its upstream socket does not exist:
what it would pass on answers 502, in its form too); the app's 405 on the pipeline's path is
checked on the WSGI middleware that makes it."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from werkzeug.test import Client

from app.config import Settings
from app.edge import HEAD_BUFFER_BYTES, Edge, find_nginx
from app.ports import free_port
from app.protocols import pipeline
from app.routes.endpoints import Endpoints
from tests.fleet import wait_for

pytestmark = pytest.mark.integration

NGINX = find_nginx()
needs_nginx = pytest.mark.skipif(
    NGINX is None, reason="no nginx binary (Debian's nginx-light): the edge cannot be checked"
)
NGINX_REQUEST_ID = re.compile(r"[0-9a-f]{32}")  # nginx's $request_id
# Each path and the form of its protocol; /healthz: a probe's location, REST like every other.
PATHS = (
    ("/v1/ocr", "rest"),
    ("/ocr/prediction", "pipeline"),
    ("/ocr", "paddlex"),
    ("/healthz", "rest"),
)
HOST = "Host: edge\r\n"
LONG = "a" * (HEAD_BUFFER_BYTES + 100)


@dataclass(frozen=True)
class Case:
    head: str  # the request, ``{path}`` in it
    status: int
    code: str  # REST's error.code
    words: str  # in the message
    path_read: bool  # nginx read the path: the path's protocol's form, else REST's


MALFORMED = "malformed HTTP request"
CASES = {
    "bad header": Case(f"GET {{path}} HTTP/1.1\r\n{HOST}Bad Header: 1\r\n\r\n", 400,
                       "bad_request", MALFORMED, True),
    "no Host with HTTP/1.1": Case("GET {path} HTTP/1.1\r\n\r\n", 400, "bad_request", MALFORMED,
                                  True),
    "bad Content-Length": Case(f"POST {{path}} HTTP/1.1\r\n{HOST}Content-Length: 12a\r\n\r\n",
                               400, "bad_request", MALFORMED, True),
    "two Content-Length": Case(
        f"POST {{path}} HTTP/1.1\r\n{HOST}Content-Length: 2\r\nContent-Length: 3\r\n\r\n{{{{}}}}",
        400, "bad_request", MALFORMED, True),
    "bad chunk size": Case(
        f"POST {{path}} HTTP/1.1\r\n{HOST}Transfer-Encoding: chunked\r\n\r\nzz\r\n{{{{}}}}\r\n"
        "0\r\n\r\n", 400, "bad_request", MALFORMED, True),
    "obs-fold header line": Case(f"GET {{path}} HTTP/1.1\r\n{HOST}X-Folded: a\r\n b\r\n\r\n",
                                 400, "bad_request", MALFORMED, True),
    "bad method token": Case(f"G@T {{path}} HTTP/1.1\r\n{HOST}\r\n", 400, "bad_request",
                             MALFORMED, False),
    "URI over the head buffers": Case(f"GET {{path}}?q={LONG} HTTP/1.1\r\n{HOST}\r\n", 414,
                                      "request_uri_too_large", "request line over", False),
    "header over the head buffers": Case(f"GET {{path}} HTTP/1.1\r\n{HOST}X-Long: {LONG}\r\n\r\n",
                                         400, "request_header_fields_too_large",
                                         "request header line over", True),
    "Transfer-Encoding: gzip": Case(
        f"POST {{path}} HTTP/1.1\r\n{HOST}Transfer-Encoding: gzip\r\n\r\n", 501,
        "not_implemented", "Transfer-Encoding", True),
    "HTTP/3.0": Case(f"GET {{path}} HTTP/3.0\r\n{HOST}\r\n", 505, "http_version_not_supported",
                     "HTTP version", False),
}  # fmt: skip


class Running:
    """nginx as the edge renders it, in front of a granian socket that does not exist."""

    def __init__(self, tmp: Path, **environ: str) -> None:
        assert NGINX is not None
        self.port = free_port()
        settings = Settings.from_env({"HOST": "127.0.0.1", "HTTP_PORT": str(self.port), **environ})
        self.edge = Edge(settings, str(tmp / "front.sock"), NGINX)
        self.edge.check()
        self.edge.start()
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError as exc:
                assert time.monotonic() < deadline, f"nginx never listened: {exc}"
                time.sleep(0.05)

    def send(self, raw: bytes) -> tuple[int, dict[str, str], bytes]:
        """One request as bytes on a fresh connection: (status, headers, body)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(raw)
            answer = http.client.HTTPResponse(sock)
            answer.begin()
            return answer.status, dict(answer.getheaders()), answer.read()


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    if NGINX is None:
        pytest.skip("no nginx binary (Debian's nginx-light): the edge cannot be checked")
    running = Running(tmp_path_factory.mktemp("edge-errors"))
    try:
        yield running
    finally:
        running.edge.quit()


def check_form(form: str, data: Any, headers: dict[str, str], status: int, code: str,
               words: str) -> None:  # fmt: skip
    """``data`` is ``form``'s error answer for ``status``."""
    if form == "rest":
        assert set(data) == {"error"} and set(data["error"]) == {"code", "message"}, data
        assert data["error"]["code"] == code and words in data["error"]["message"], data
    elif form == "paddlex":
        assert set(data) == {"logId", "errorCode", "errorMsg"}, data
        assert data["errorCode"] == status and words in data["errorMsg"], data
        assert data["logId"] == headers["X-Request-Id"]  # nginx's $request_id
    else:
        assert data == {
            "err_no": pipeline.UNKNOWN_ERROR, "err_msg": data["err_msg"], "key": [],
            "value": [], "tensors": [],
        }, data  # fmt: skip
        assert words in data["err_msg"], data


@needs_nginx
@pytest.mark.parametrize("path,form", PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_request_is_answered_in_its_protocols_form(edge, case, path, form):
    expected = CASES[case]
    status, headers, body = edge.send(expected.head.format(path=path).encode("latin-1"))
    assert status == expected.status, (case, path, body[:300])
    assert headers["Content-Type"] == "application/json", (case, path, body[:300])
    assert int(headers["Content-Length"]) == len(body) and headers["Connection"] == "close"
    assert NGINX_REQUEST_ID.fullmatch(headers["X-Request-Id"]), headers
    data = json.loads(body)
    form = form if expected.path_read else "rest"  # no path read: nginx cannot know it
    check_form(form, data, headers, status, expected.code, expected.words)


@needs_nginx
@pytest.mark.parametrize("path,form", PATHS)
def test_nginx_s_other_answers_keep_their_forms(edge, path, form):
    """413 (from the head) and 502 (nothing behind this nginx) as before, with Retry-After."""
    head = f"POST {path} HTTP/1.1\r\n{HOST}Content-Length: {1 << 40}\r\n\r\n"
    status, headers, body = edge.send(head.encode())
    if path == "/healthz":  # probes have no error pages of their own for these: nginx's
        assert status == 413
    else:
        assert status == 413 and headers["Content-Type"] == "application/json"
        check_form(form, json.loads(body), headers, 413, "too_large", "request body over")
    status, headers, body = edge.send(f"POST {path} HTTP/1.1\r\n{HOST}\r\n".encode())
    assert status == 502, body[:300]
    if path != "/healthz":
        assert headers["Retry-After"] == "1" and headers["Content-Type"] == "application/json"
        check_form(form, json.loads(body), headers, 502, "unavailable", "not answering")


@needs_nginx
def test_the_client_s_request_id_and_the_access_log(tmp_path):
    """A request id the client sent is kept where nginx read the head; a request line nginx
    could not read logs no method and no path (its internal answer is not logged as one).
    nginx's stdout (its access log) is a file of this test's: pytest's capture truncates its
    file after each read, and a line nginx appended in between was lost (a loaded run)."""
    access_log = tmp_path / "access.log"
    saved = os.dup(1)
    with access_log.open("ab") as sink:
        os.dup2(sink.fileno(), 1)  # nginx inherits it: its /dev/stdout
        try:
            running = Running(tmp_path)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    try:
        _, headers, _ = running.send(
            f"GET /v1/ocr HTTP/1.1\r\n{HOST}X-Request-Id: mine-1\r\nBad Header: 1\r\n\r\n".encode()
        )
        assert headers["X-Request-Id"] == "mine-1"
        _, headers, _ = running.send(f"G@T /ocr HTTP/1.1\r\n{HOST}\r\n".encode())
        bad_line = headers["X-Request-Id"]

        def logged() -> dict[str, dict[str, Any]] | None:
            lines = [json.loads(line) for line in access_log.read_text().splitlines()
                     if line.startswith('{"time"')]  # fmt: skip
            found = {entry["request_id"]: entry for entry in lines}
            return found if {"mine-1", bad_line} <= set(found) else None

        lines = wait_for(logged, 60, "both requests in the access log", access_log.read_text)
    finally:
        running.edge.quit()
    assert (lines["mine-1"]["method"], lines["mine-1"]["path"]) == ("GET", "/v1/ocr")
    assert lines["mine-1"]["status"] == 400
    assert (lines[bad_line]["method"], lines[bad_line]["path"]) == ("", "")
    assert lines[bad_line]["status"] == 400


@needs_nginx
def test_a_pipeline_name_with_a_dot_picks_its_own_path_only(tmp_path):
    """PIPELINE_SERVICE_NAME becomes a regex for the answers made before a location is
    picked: its dot is a dot."""
    running = Running(tmp_path, PIPELINE_SERVICE_NAME="ocr.v2")
    try:
        for path, form in (("/ocr.v2/prediction", "pipeline"), ("/ocrXv2/prediction", "rest")):
            head = f"GET {path} HTTP/1.1\r\n{HOST}Bad Header: 1\r\n\r\n"
            status, headers, body = running.send(head.encode())
            assert status == 400
            check_form(form, json.loads(body), headers, 400, "bad_request", MALFORMED)
    finally:
        running.edge.quit()


def test_a_wrong_method_on_the_pipeline_s_path_is_405_in_its_form():
    """The app's own 405 there: the pipeline's five fields, with Allow."""
    settings = Settings.from_env({})
    service = SimpleNamespace(settings=settings, admission=None)
    app = Endpoints(service, lambda environ, start: [], set())  # type: ignore[arg-type]
    answer = Client(app).get("/ocr/prediction")
    assert answer.status_code == 405 and "POST" in answer.headers["Allow"]
    assert answer.headers["Content-Type"] == "application/json"
    data = json.loads(answer.get_data())
    assert data == {
        "err_no": pipeline.UNKNOWN_ERROR, "err_msg": data["err_msg"], "key": [], "value": [],
        "tensors": [],
    }, data  # fmt: skip
    assert data["err_msg"]
