"""nginx at the edge (app/edge.py, app/nginx.conf.j2): the rendered configuration passes
``nginx -t`` for every kind of setting, and a real ``python -m app serve`` answers through
nginx as the protocols answer: request ids, the JSON access log, the client's real address,
413 and 429 in each protocol's own form, probes never limited, TLS with HTTP/2, a graceful
stop that finishes a request in flight, and the ways it refuses to start or runs without nginx.

Processes cost this machine's CPU, so one service with the real engine (``edge``) serves most
tests, each client from its own loopback address (nginx limits per address: RATE_LIMIT=1:2
limits only the test that means to be limited); the services that need other settings use
``OCR_ENGINE=serving`` against that one (no engine of their own to load), and the last test
stops it."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from requests.adapters import HTTPAdapter

from app.config import Settings
from app.edge import Edge, find_nginx, render
from app.embedded_redis import EmbeddedRedis
from app.ports import free_port
from app.protocols import pipeline
from tests.conftest import CORPUS, ROOT, WORD_CH, WORD_EN
from tests.fleet import wait_for
from tests.helpers import alive, b64, metric_sum

pytestmark = pytest.mark.deploy

NGINX = find_nginx()
needs_nginx = pytest.mark.skipif(
    NGINX is None, reason="no nginx binary (Debian's nginx-light): the edge cannot be checked"
)

TOKEN = "edge-test-token-0123456789"  # CACHE_CONTROL_TOKEN
TRUSTED_SOURCE = "127.0.0.3"  # in the edge service's TRUSTED_NETWORKS, with 10.0.0.0/8
PROXY_SOURCE = "127.0.0.9"  # EDGE_REAL_IP_FROM: a proxy in front of the edge (an Ingress)
MAX_BODY = 4 * 1024 * 1024  # MAX_REQUEST_BYTES: a 2.1 MB image's base64 fits, 4 MB does not
SLOW_IMAGE = CORPUS / "sroie_282.jpg"  # a receipt: seconds of engine on this machine
NGINX_REQUEST_ID = re.compile(r"[0-9a-f]{32}")  # nginx's $request_id
PROTOCOLS = (("/v1/ocr", "rest"), ("/ocr", "paddlex"), ("/ocr/prediction", "pipeline"))

_sources = (str(ipaddress.ip_address("127.1.0.0") + i) for i in itertools.count(1))


def new_source() -> str:
    """A loopback address of its own for one client: its own nginx rate-limit budget."""
    return next(_sources)


class _From(HTTPAdapter):
    """Connections from one source address."""

    def __init__(self, source: str) -> None:
        self._source = source
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["source_address"] = (self._source, 0)
        super().init_poolmanager(*args, **kwargs)


def client(source: str | None = None) -> requests.Session:
    session = requests.Session()
    session.mount("http://", _From(source or new_source()))
    return session


# The configuration ------------------------------------------------------------------------


def _certificate(folder: Path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and localhost: (cert file, key file)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "edge.crt", folder / "edge.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_file), str(key_file)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return _certificate(tmp_path_factory.mktemp("tls"))


MATRIX = {
    # Retry-After on nginx's own 502 (a worker died or restarts), rate limit or not.
    "defaults": (
        {},
        ["listen 0.0.0.0:9998;", "access_log /dev/stdout edge_json;", "Retry-After 1 always;"],
    ),
    "rate limit": (
        {"RATE_LIMIT": "20:40"},
        ["rate=20r/s", "limit_req zone=per_client burst=40 nodelay;", "Retry-After 1"],
    ),
    "rate limit below 1/s": ({"RATE_LIMIT": "0.5:3"}, ["rate=30r/m", "burst=3 nodelay"]),
    "rate limit without burst": ({"RATE_LIMIT": "0.5"}, ["rate=30r/m"]),
    "tls": ({"TLS": "yes"}, ["ssl http2;", "ssl_certificate "]),
    "ipv6 any": ({"HOST": "::"}, ["listen [::]:9998;"]),
    "ipv6 loopback, tls": ({"HOST": "::1", "TLS": "yes"}, ["listen [::1]:9998 ssl http2;"]),
    "edge workers": ({"EDGE_WORKERS": "4"}, ["worker_processes 4;"]),
    "tiny body limit": ({"MAX_REQUEST_BYTES": "1024"}, ["client_max_body_size 1024;"]),
    "access log off": ({"EDGE_ACCESS_LOG": "false"}, ["access_log off;"]),
    "short timeouts": (
        {"HTTP_HEADER_TIMEOUT_SECONDS": "0.5", "HTTP_BODY_TIMEOUT_SECONDS": "2"},
        ["client_header_timeout 500ms;", "client_body_timeout 2s;"],
    ),
    "pipeline name": ({"PIPELINE_SERVICE_NAME": "receipts"}, ["location /receipts/ {"]),
    "behind a proxy": (
        {"EDGE_REAL_IP_FROM": "10.0.0.0/8,fd00::/8"},
        ["set_real_ip_from 10.0.0.0/8;", "set_real_ip_from fd00::/8;", "real_ip_recursive on;"],
    ),
    "everything": (
        {
            "RATE_LIMIT": "5:1",
            "TLS": "yes",
            "HOST": "::",
            "EDGE_WORKERS": "2",
            "MAX_REQUEST_BYTES": "2048",
            "EDGE_ACCESS_LOG": "false",
            "LOG_LEVEL": "debug",
        },
        ["worker_processes 2;", "error_log stderr info;", "listen [::]:9998 ssl http2;"],
    ),  # fmt: skip
}


@needs_nginx
@pytest.mark.parametrize("case", list(MATRIX))
def test_the_rendered_configuration_passes_nginx_t(case, certificate, tmp_path):
    environ, expected = MATRIX[case]
    environ = dict(environ)
    if environ.pop("TLS", None):
        environ["TLS_CERT_FILE"], environ["TLS_KEY_FILE"] = certificate
    settings = Settings.from_env(environ)
    assert NGINX is not None
    edge = Edge(settings, str(tmp_path / "front.sock"), NGINX)
    try:
        text = Path(edge.config).read_text()
        for line in expected:
            assert line in text, (case, line)
        edge.check()  # raises with nginx's own words when it refuses
    finally:
        edge.quit()
    assert not os.path.exists(edge.run_dir)


def test_only_recognitions_are_sent_twice_after_a_connection_error(tmp_path):
    """A POST whose kept-alive connection a retiring worker closed is tried once more when it
    is a recognition (the same image, the same answer), never when it uploads a job."""
    text = render(Settings.from_env({}), str(tmp_path / "front.sock"), str(tmp_path), (1, 22))
    blocks = {
        block.split("{", 1)[0].strip(): block
        for block in text.split("location ")[1:]
        if not block.startswith("@")
    }
    retried = {m for m, block in blocks.items() if "error non_idempotent" in block}
    assert retried == {"= /v1/ocr", "= /ocr", "/ocr/", "/v2/"}, retried
    assert "proxy_next_upstream_tries 2;" in text


@needs_nginx
def test_nginx_t_refuses_a_broken_certificate(tmp_path):
    """The check is real: a certificate nginx cannot load fails it, in nginx's words."""
    cert, key = tmp_path / "bad.crt", tmp_path / "bad.key"
    cert.write_text("not a certificate\n")
    key.write_text("not a key\n")
    settings = Settings.from_env({"TLS_CERT_FILE": str(cert), "TLS_KEY_FILE": str(key)})
    assert NGINX is not None
    edge = Edge(settings, str(tmp_path / "front.sock"), NGINX)
    try:
        with pytest.raises(RuntimeError, match="nginx refused its configuration"):
            edge.check()
    finally:
        edge.quit()


# Services ---------------------------------------------------------------------------------


class Service:
    """`python -m app serve` (optionally under a wrapper command) in its own session; its
    stdout and stderr collected line by line as it runs (the access log is on stdout)."""

    def __init__(self, env: dict[str, str], wrapper: tuple[str, ...] = ()) -> None:
        full = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR",)}
        full.update(env)
        self.port = int(env["HTTP_PORT"])
        self.base = f"http://127.0.0.1:{self.port}"
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "app", "serve"], cwd=ROOT, env=full,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, path: str = "/readyz", timeout: float = 240, **kwargs: Any) -> None:
        """Three answers in a row (``kwargs``: for requests, e.g. ``verify``)."""
        url = self.base.replace("http:", "https:") if "verify" in kwargs else self.base
        deadline = time.monotonic() + timeout
        streak = 0
        while streak < 3:
            assert self.proc.poll() is None, self.output[-4000:]
            assert time.monotonic() < deadline, "never ready:\n" + self.output[-4000:]
            try:
                streak = streak + 1 if requests.get(url + path, timeout=5, **kwargs).ok else 0
            except requests.RequestException:
                streak = 0
            time.sleep(0.3)

    def nginx_pids(self) -> list[int]:
        """nginx processes under this service (the master and its workers)."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [p.pid for p in children if _name(p) == "nginx"]

    def stop(self, timeout: float = 90) -> int:
        """SIGTERM, then the exit status (killed after ``timeout``: a failure)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            code = -9
        self._reader.join(10)
        return code

    def access_log(self, **match: Any) -> list[dict[str, Any]]:
        """The access log's JSON lines whose fields equal ``match``."""
        found = []
        for line in list(self.lines):
            if not line.startswith('{"time"'):
                continue
            entry = json.loads(line)
            if all(entry.get(k) == v for k, v in match.items()):
                found.append(entry)
        return found

    def wait_log(self, timeout: float = 60, **match: Any) -> dict[str, Any]:
        """The one access log line matching (nginx writes it as the answer leaves)."""
        deadline = time.monotonic() + timeout
        while not (found := self.access_log(**match)):
            assert time.monotonic() < deadline, (
                f"no access log line {match}:\n{self.output[-3000:]}"
            )
            time.sleep(0.05)
        assert len(found) == 1, found
        return found[0]


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return ""


def _common_env(tmp: Path, **extra: str) -> dict[str, str]:
    return {
        "HOST": "127.0.0.1", "HTTP_PORT": str(free_port()), "WEB_CONCURRENCY": "1",
        "ENGINE_PROCESSES": "1",
        "WEB_THREADS": "4", "OCR_WORK_DIR": str(tmp / "models"),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp / "metrics"), **extra,
    }  # fmt: skip


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The service with the real engine behind nginx, its own private Redis (REDIS_URL
    unset), RATE_LIMIT=1:2, TRUSTED_NETWORKS, a proxy in EDGE_REAL_IP_FROM and a control
    token, 4 MB bodies. The last test
    of this file stops it (a graceful stop with a request in flight)."""
    if NGINX is None:
        pytest.skip("no nginx binary (Debian's nginx-light): the edge cannot be checked")
    tmp = tmp_path_factory.mktemp("edge")
    env = _common_env(
        tmp, GRPC_PORT=str(free_port()), RATE_LIMIT="1:2", CACHE_CONTROL_TOKEN=TOKEN,
        TRUSTED_NETWORKS=f"10.0.0.0/8,{TRUSTED_SOURCE}/32", MAX_REQUEST_BYTES=str(MAX_BODY),
        EDGE_REAL_IP_FROM=f"{PROXY_SOURCE}/32",
    )  # fmt: skip
    env["REDIS_URL"] = ""  # the private Redis `serve` starts
    service = Service(env)
    try:
        service.wait_ready()
        yield service
    finally:
        running = service.proc.poll() is None
        code = service.stop()
        if running:  # not stopped by the graceful-stop test (it failed, or was deselected)
            assert code == 0, service.output[-4000:]


def _image_body(path: Path = WORD_EN) -> dict[str, str]:
    return {"image": b64(path.read_bytes())}


def _request_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(6).hex()}"


# Through nginx ----------------------------------------------------------------------------


def test_rest_miss_then_hit_through_nginx_with_the_access_log(edge):
    source = new_source()
    session = client(source)
    ids = [_request_id("miss"), _request_id("hit")]
    answers = [
        session.post(f"{edge.base}/v1/ocr", json=_image_body(), headers={"X-Request-Id": rid},
                     timeout=120)
        for rid in ids
    ]  # fmt: skip
    for answer, rid in zip(answers, ids, strict=True):
        assert answer.status_code == 200, answer.text[:300]
        assert answer.headers["X-Request-Id"] == rid
        assert "X-Edge-Cache" not in answer.headers  # the access log's, hidden by nginx
        assert answer.headers["Server"] == "nginx"  # server_tokens off: no version
        assert answer.json()["lines"]
    assert [a.headers["X-Cache"] for a in answers] == ["MISS", "HIT"]
    assert answers[1].headers["X-Cache-Tier"] in ("l1", "l2")
    miss, hit = (edge.wait_log(request_id=rid) for rid in ids)
    assert miss["cache"] == "MISS" and hit["cache"] in ("HIT l1", "HIT l2")
    for line in (miss, hit):
        assert line["client"] == source and line["status"] == 200
        assert line["method"] == "POST" and line["path"] == "/v1/ocr"
        assert line["protocol"] == "HTTP/1.1"
        # the front server's time, and nginx's whole time (timed apart: neither bounds the other).
        assert float(line["upstream_seconds"]) >= 0 and line["seconds"] >= 0
        assert line["request_bytes"] > len(_image_body()["image"])


def test_request_ids_generated_propagated_or_replaced(edge):
    session = client()
    cases = {
        None: "generated",
        "client-id.1:2_3": "propagated",
        "a" * 128: "propagated",
        "has spaces in it": "replaced",
        "a" * 300: "replaced",
        "semi;colon": "replaced",
    }
    for sent, fate in cases.items():
        headers = {"X-Request-Id": sent} if sent else {}
        answer = session.get(f"{edge.base}/healthz", headers=headers, timeout=10)
        assert answer.status_code == 200
        got = answer.raw.headers.getlist("X-Request-Id")
        assert len(got) == 1, got  # nginx's, never the app's as well
        if fate == "propagated":
            assert got[0] == sent
        else:
            assert NGINX_REQUEST_ID.fullmatch(got[0]) and got[0] != sent, (sent, got)
        line = edge.wait_log(request_id=got[0])
        assert line["path"] == "/healthz" and line["cache"] == ""
    # The app answers under the same id: an error it makes (a REST 400) carries it too.
    answer = session.post(f"{edge.base}/v1/ocr", json={}, headers={"X-Request-Id": "bad id"},
                          timeout=30)  # fmt: skip
    assert answer.status_code == 400 and answer.json()["error"]["code"]
    assert NGINX_REQUEST_ID.fullmatch(answer.headers["X-Request-Id"])
    assert edge.wait_log(request_id=answer.headers["X-Request-Id"])["status"] == 400


def test_the_app_sees_the_real_client_address(edge):
    """TRUSTED_NETWORKS=10.0.0.0/8 and 127.0.0.3: nginx replaces a client's X-Forwarded-For
    with the address it connected from, so claiming 10.1.2.3 earns no trust (its
    ``Cache-Control: no-cache`` is ignored), while a client really at 127.0.0.3 is trusted."""
    body = _image_body(WORD_CH)
    first = client().post(f"{edge.base}/v1/ocr", json=body, timeout=120)
    assert first.status_code == 200
    spoofing = new_source()
    claims = (
        {"X-Forwarded-For": "10.1.2.3"},
        {"X-Forwarded-For": "10.1.2.3, 10.4.5.6", "X-Real-IP": "10.1.2.3"},
        {"Forwarded": "for=10.1.2.3"},
    )
    for claim in claims:
        answer = client(spoofing).post(
            f"{edge.base}/v1/ocr", json=body, headers={**claim, "Cache-Control": "no-cache"},
            timeout=120,
        )  # fmt: skip
        assert answer.status_code == 200
        assert answer.headers["X-Cache"] == "HIT", claim  # no-cache ignored: not trusted
    wait_for(lambda: len(edge.access_log(path="/v1/ocr", client=spoofing)) >= len(claims), 60,
             "an access log line per claim", lambda: edge.output[-3000:])  # fmt: skip
    assert not edge.access_log(client="10.1.2.3")  # the log has the real address too
    trusted = client(TRUSTED_SOURCE).post(
        f"{edge.base}/v1/ocr", json=body, headers={"Cache-Control": "no-cache"}, timeout=120
    )
    assert trusted.status_code == 200 and trusted.headers["X-Cache"] == "MISS"  # recomputed


def test_behind_a_declared_proxy_the_client_is_its_forwarded_address(edge):
    """EDGE_REAL_IP_FROM names the proxy in front of the edge: from it, X-Forwarded-For is
    the client, for TRUSTED_NETWORKS (10.0.0.0/8), RATE_LIMIT (a budget per forwarded
    client, not one for the proxy) and the access log; the proxy's own entries are skipped."""
    body = _image_body(WORD_EN)
    assert client().post(f"{edge.base}/v1/ocr", json=body, timeout=120).status_code == 200
    proxy = client(PROXY_SOURCE)
    forwarded = {"X-Forwarded-For": f"10.7.7.7, {PROXY_SOURCE}", "Cache-Control": "no-cache"}
    answer = proxy.post(f"{edge.base}/v1/ocr", json=body, headers=forwarded, timeout=120)
    assert answer.status_code == 200 and answer.headers["X-Cache"] == "MISS"  # trusted
    assert edge.wait_log(request_id=answer.headers["X-Request-Id"])["client"] == "10.7.7.7"
    outside = {"X-Forwarded-For": "198.51.100.7", "Cache-Control": "no-cache"}
    answer = proxy.post(f"{edge.base}/v1/ocr", json=body, headers=outside, timeout=120)
    assert answer.status_code == 200 and answer.headers["X-Cache"] == "HIT"  # not trusted
    statuses = []
    while len(statuses) < 20 and 429 not in statuses:  # one forwarded client's budget
        headers = {"X-Forwarded-For": "198.51.100.8"}
        statuses.append(proxy.post(f"{edge.base}/v1/ocr", json={}, headers=headers).status_code)
    assert statuses[-1] == 429, statuses
    other = proxy.post(f"{edge.base}/v1/ocr", json={}, headers={"X-Forwarded-For": "198.51.100.9"})
    assert other.status_code == 400  # another client behind the same proxy: its own budget


def _raw_post(base: str, path: str, length: int, source: str) -> tuple[int, dict, bytes]:
    """A POST whose head announces ``length`` bytes, and no body: (status, headers, body)."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30, source_address=(source, 0))
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(length))
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def _check_form(form: str, body: bytes, headers: dict, status: int, words: str) -> None:
    """``body`` is the protocol's own error answer for ``status``."""
    data = json.loads(body)
    if form == "rest":
        assert set(data) == {"error"} and words in data["error"]["message"], data
        code = {413: "too_large", 429: "rate_limited"}[status]
        assert data["error"]["code"] == code, data
    elif form == "paddlex":
        assert set(data) == {"logId", "errorCode", "errorMsg"}, data
        assert data["errorCode"] == status and words in data["errorMsg"], data
        assert data["logId"] == headers["X-Request-Id"]  # nginx's $request_id
    else:
        assert data == {
            "err_no": pipeline.UNKNOWN_ERROR, "err_msg": data["err_msg"], "key": [],
            "value": [], "tensors": [],
        }, data  # fmt: skip
        assert words in data["err_msg"]


def test_a_body_over_the_limit_gets_413_in_each_protocols_form(edge):
    """nginx refuses it from the head (Content-Length), before reading a byte of it."""
    for path, form in PROTOCOLS:
        status, headers, body = _raw_post(edge.base, path, MAX_BODY + 1, new_source())
        assert status == 413, (path, body[:300])
        assert headers["Content-Type"] == "application/json"
        _check_form(form, body, headers, 413, f"request body over {MAX_BODY} bytes")
        assert NGINX_REQUEST_ID.fullmatch(headers["X-Request-Id"])
        line = edge.wait_log(request_id=headers["X-Request-Id"])
        assert line["status"] == 413 and line["upstream_seconds"] == ""  # never passed on


def test_rate_limit_429_in_each_protocols_form_and_probes_never_limited(edge):
    """RATE_LIMIT=1:2: three at once, then 429 with Retry-After; per client address."""
    for path, form in PROTOCOLS:
        session = client()
        answers = []
        while len(answers) < 20 and not any(a.status_code == 429 for a in answers):
            answers.append(session.post(f"{edge.base}{path}", json={}, timeout=30))
        statuses = [a.status_code for a in answers]
        assert 429 not in statuses[:3], (path, statuses)  # the burst: never refused
        assert statuses[-1] == 429, (path, statuses)
        refused = answers[-1]
        assert refused.headers["Retry-After"] == "1"
        assert refused.headers["Content-Type"] == "application/json"
        _check_form(form, refused.content, refused.headers, 429, "rate limit exceeded")
        line = edge.wait_log(request_id=refused.headers["X-Request-Id"])
        assert line["status"] == 429 and line["upstream_seconds"] == ""
        # Probes and metrics are never limited, even for a client over its budget.
        for probe in ("/healthz", "/readyz", "/metrics", "/health"):
            for _ in range(5):
                answer = session.get(f"{edge.base}{probe}", timeout=10)
                assert answer.status_code != 429, (probe, answer.status_code)
        assert session.post(f"{edge.base}{path}", json={}, timeout=30).status_code == 429
    # Another client is not limited by them.
    assert client().post(f"{edge.base}/v1/ocr", json={}, timeout=30).status_code == 400


def test_a_huge_form_field_beside_an_image_is_a_rest_4xx(edge):
    """multipart: ``min_score`` = 2 MB of digits next to a normal image, through nginx and
    the front's server: the client's error in REST form, never a 5xx (several times: it was a
    race)."""
    session = client()
    statuses = []
    for _ in range(6):
        answer = session.post(
            f"{edge.base}/v1/ocr",
            files={"file": ("word.png", WORD_EN.read_bytes(), "image/png")},
            data={"min_score": "1" * (2 * 1024 * 1024)},
            timeout=60,
        )
        statuses.append(answer.status_code)
        data = answer.json()
        assert set(data) == {"error"} and data["error"]["code"] and data["error"]["message"]
        time.sleep(1)  # RATE_LIMIT=1:2: one a second stays within this client's budget
    assert all(400 <= status < 500 for status in statuses), statuses


# Other settings, with the edge service as their engine -------------------------------------


def _serving_env(tmp: Path, edge: Service, redis_server: EmbeddedRedis, **extra: str) -> dict:
    """A service whose engine is the edge service (Paddle Serving's pipeline over HTTP):
    nothing to load; its own key prefix on the session's Redis."""
    return _common_env(
        tmp, OCR_ENGINE="serving", SERVING_URL=edge.base, GRPC_ENABLED="false",
        REDIS_URL=redis_server.url, CACHE_KEY_PREFIX=f"edge-{tmp.name}", **extra,
    )  # fmt: skip


def _curl(*args: str) -> tuple[str, str]:
    """curl's response head and body."""
    out = subprocess.run(
        ["curl", "-sS", "--max-time", "60", "-D", "-", *args], capture_output=True, timeout=90
    )  # bytes: the head ends at the first CRLF CRLF
    assert out.returncode == 0, out.stderr
    head, _, body = out.stdout.partition(b"\r\n\r\n")
    return head.decode(), body.decode()


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl for the HTTP/2 client")
def test_tls_with_http2_and_http11(edge, redis_server, certificate, tmp_path):
    cert, key = certificate
    service = Service(
        _serving_env(tmp_path, edge, redis_server, TLS_CERT_FILE=cert, TLS_KEY_FILE=key)
    )
    try:
        service.wait_ready(verify=cert)
        url = f"https://127.0.0.1:{service.port}"
        head, body = _curl("-k", "--http2", f"{url}/healthz")
        assert head.splitlines()[0].strip() == "HTTP/2 200", head
        assert json.loads(body) == {"status": "alive"}
        head, _ = _curl("-k", "--http1.1", f"{url}/healthz")
        assert head.splitlines()[0].startswith("HTTP/1.1 200 "), head
        # A request with a body over HTTP/2: the engine (the edge service) answers it.
        image = tmp_path / "body.json"
        image.write_text(json.dumps(_image_body()))
        head, body = _curl(
            "-k", "--http2", "-H", "Content-Type: application/json",
            "--data-binary", f"@{image}", f"{url}/v1/ocr",
        )  # fmt: skip
        assert head.splitlines()[0].strip() == "HTTP/2 200", head
        assert json.loads(body)["lines"]
        assert "x-edge-cache" not in head.lower() and "x-request-id:" in head.lower()
        line = service.wait_log(path="/v1/ocr")
        assert line["protocol"] == "HTTP/2.0" and line["cache"] == "MISS"
        # Plain HTTP on the TLS port: refused by nginx, not passed on.
        plain = requests.get(f"http://127.0.0.1:{service.port}/healthz", timeout=10)
        assert plain.status_code == 400
        assert requests.get(f"{url}/healthz", verify=cert, timeout=10).status_code == 200
    finally:
        assert service.stop() == 0, service.output[-4000:]


def test_edge_none_the_front_server_answers_the_port_itself(edge, redis_server, tmp_path):
    service = Service(_serving_env(tmp_path, edge, redis_server, EDGE="none"))
    try:
        service.wait_ready()
        assert not service.nginx_pids()
        answers = [
            requests.post(f"{service.base}/v1/ocr", json=_image_body(), timeout=120)
            for _ in range(2)
        ]
        assert [a.status_code for a in answers] == [200, 200], answers[0].text[:300]
        assert [a.headers["X-Cache"] for a in answers] == ["MISS", "HIT"]
        for answer in answers:
            assert "X-Edge-Cache" not in answer.headers  # only for nginx, over its socket
            assert "nginx" not in answer.headers.get("Server", "")
            assert re.fullmatch(r"[0-9a-f]{16}", answer.headers["X-Request-Id"])  # the app's
        assert not service.access_log()
    finally:
        assert service.stop() == 0, service.output[-4000:]
    assert "edge: nginx" not in service.output


# Refusals and running without nginx ---------------------------------------------------------


def _run(env: dict[str, str], wrapper: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    full.update(env)
    return subprocess.run(
        [*wrapper, sys.executable, "-m", "app", "serve"], cwd=ROOT, env=full,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("variable", "value", "instead"),
    [
        ("HTTP_FRONT", "true", "EDGE=nginx"),
        ("HTTP_FRONT_HITS", "true", "unset it"),
        ("HTTP_FRONT_PROCESSES", "2", "EDGE_WORKERS"),
    ],
)
def test_removed_settings_stop_start_up_in_one_line(variable, value, instead):
    out = _run({variable: value, "HTTP_PORT": str(free_port())})
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"configuration error: {variable}: removed") and instead in lines[0]


# Where find_nginx looks whatever PATH says: beside this Python (make install), and sbin.
_FIXED_PLACES = (os.path.join(os.path.dirname(sys.executable), "nginx"), "/usr/sbin/nginx")


@pytest.fixture(scope="module")
def hidden_nginx() -> tuple[str, ...]:
    """A wrapper that runs a command where no nginx can be found: a private mount namespace
    with /dev/null over the nginx binaries ``find_nginx`` looks for outside PATH (the host's
    files are untouched), a PATH without nginx, and no EDGE_NGINX (see ``_no_nginx_env``).
    Not a renamed /usr/sbin/nginx: other processes on this machine use it meanwhile."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare: cannot hide nginx from find_nginx")
    hide = [place for place in _FIXED_PLACES if os.path.exists(place)]
    mounts = "".join(f"mount --bind /dev/null {place} 2>/dev/null || exit 97; " for place in hide)
    script = mounts + 'exec "$@"'
    wrapper = (unshare, "--mount", "--propagation", "private", "sh", "-c", script, "sh")
    probe = subprocess.run(
        [*wrapper, sys.executable, "-c", "from app.edge import find_nginx; print(find_nginx())"],
        cwd=ROOT, env={**os.environ, **_no_nginx_env()},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if probe.returncode != 0 or probe.stdout.strip() != "None":
        pytest.skip(
            f"cannot hide nginx (a mount namespace needs CAP_SYS_ADMIN): {hide} "
            f"{probe.stdout.strip()} {probe.stderr.strip()[-300:]}"
        )
    return wrapper


def _no_nginx_env() -> dict[str, str]:
    return {"PATH": _path_without_nginx(), "EDGE_NGINX": ""}


def _path_without_nginx() -> str:
    keep = [
        folder for folder in os.environ.get("PATH", "").split(os.pathsep)
        if folder and not os.access(os.path.join(folder, "nginx"), os.X_OK)
    ]  # fmt: skip
    return os.pathsep.join(keep)


@pytest.mark.parametrize("setting", ["RATE_LIMIT", "TLS"])
def test_without_nginx_rate_limit_or_tls_is_a_configuration_error(
    setting, hidden_nginx, certificate
):
    env = {**_no_nginx_env(), "HTTP_PORT": str(free_port())}
    if setting == "TLS":
        env["TLS_CERT_FILE"], env["TLS_KEY_FILE"] = certificate
        named = "TLS_CERT_FILE"
    else:
        env["RATE_LIMIT"] = "1:2"
        named = "RATE_LIMIT"
    out = _run(env, hidden_nginx)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"configuration error: {named}") and "no nginx" in lines[0]


def test_without_nginx_the_front_server_serves_with_one_warning(
    edge, redis_server, hidden_nginx, tmp_path
):
    env = _serving_env(tmp_path, edge, redis_server, **_no_nginx_env())
    service = Service(env, hidden_nginx)
    try:
        service.wait_ready()
        assert not service.nginx_pids()
        answer = requests.get(f"{service.base}/healthz", timeout=10)
        assert answer.status_code == 200 and "nginx" not in answer.headers.get("Server", "")
    finally:
        assert service.stop() == 0, service.output[-4000:]
    warnings = [line for line in service.lines if "no nginx on PATH" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], service.output[-3000:]
    assert "the front's server serves 127.0.0.1:" in warnings[0]
    assert "edge: nginx" not in service.output


# Last: the edge service stops -----------------------------------------------------------------


def test_graceful_stop_finishes_a_request_in_flight(edge):
    """SIGTERM while a slow miss is computing: nginx quits gracefully first (the request is
    answered by the still-running worker), then the front's server; exit 0, no nginx left behind."""
    pids = edge.nginx_pids()
    assert pids, "nginx is not running under the service"
    result: dict[str, Any] = {}

    def slow_miss() -> None:
        try:
            result["answer"] = client().post(
                f"{edge.base}/v1/ocr", json=_image_body(SLOW_IMAGE),
                headers={"Cache-Control": "no-cache", "X-Cache-Control-Token": TOKEN},
                timeout=180,
            )  # fmt: skip
        except requests.RequestException as exc:
            result["error"] = exc
        result["done"] = time.monotonic()

    def computing() -> float:
        metrics = requests.get(f"{edge.base}/metrics", timeout=10).text
        return metric_sum(metrics, "ocr_engine_calls_running")

    idle = computing()
    request = threading.Thread(target=slow_miss)
    request.start()
    # Sent and computing (the engine takes seconds on this image), however loaded the host.
    wait_for(lambda: computing() > idle or "done" in result, 120, "the slow miss computing",
             lambda: f"{result}\n{edge.output[-3000:]}")  # fmt: skip
    signalled = time.monotonic()
    code = edge.stop(timeout=180)
    request.join(60)
    assert "error" not in result, result
    answer = result["answer"]
    assert answer.status_code == 200, answer.text[:300]
    assert answer.headers["X-Cache"] == "MISS" and answer.json()["lines"]
    assert result["done"] > signalled, "answered before the stop: nothing was in flight"
    assert code == 0, edge.output[-4000:]
    wait_for(lambda: not any(alive(pid) for pid in pids), 60, f"nginx ended ({pids})",
             lambda: str([pid for pid in pids if alive(pid)]))  # fmt: skip
    assert "Termination signal" not in edge.output
