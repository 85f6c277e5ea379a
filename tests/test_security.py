"""Security: Redis over TLS and with a prefix-limited ACL user, secrets from files and never
shown, encrypted values, the admin API, tenant namespaces, request-level cache controls,
no pickle/eval, and logs without image bytes or recognized text."""

from __future__ import annotations

import ast
import base64
import datetime
import ipaddress
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from app.cache.keys import digest_image
from app.embedded_redis import EmbeddedRedis
from tests.conftest import PHOTOTEST, ROOT, SHORT, WORD_CH, WORD_EN
from tests.fleet import wait_for
from tests.helpers import b64, entry_keys

pytestmark = pytest.mark.integration

TOKEN = "admin-token-0123456789abcdef"


def ocr(client, data: bytes, **headers):  # type: ignore[no-untyped-def]
    return client.post("/v1/ocr", json={"image": b64(data)}, headers=headers)


# --- TLS -----------------------------------------------------------------------------------


def _cert(subject: str, issuer_key, issuer_name, key, ca: bool):  # type: ignore[no-untyped-def]
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, obj) -> str:  # type: ignore[no-untyped-def]
    if isinstance(obj, x509.Certificate):
        path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(
            obj.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return str(path)


@pytest.fixture()
def tls_redis(tmp_path):  # type: ignore[no-untyped-def]
    ca_key, server_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test-ca")])
    ca = _cert("test-ca", ca_key, ca_name, ca_key, ca=True)
    server = _cert("localhost", ca_key, ca_name, server_key, ca=False)
    files = {
        "ca": _write(tmp_path / "ca.crt", ca),
        "cert": _write(tmp_path / "redis.crt", server),
        "key": _write(tmp_path / "redis.key", server_key),
    }
    port_holder = EmbeddedRedis()  # picks a free port
    args = ["--port", "0", "--tls-port", str(port_holder.port), "--tls-cert-file", files["cert"],
            "--tls-key-file", files["key"], "--tls-ca-cert-file", files["ca"],
            "--tls-auth-clients", "no"]  # fmt: skip
    server_proc = EmbeddedRedis(
        extra_args=args,
        port=port_holder.port,
        client_kwargs={"ssl": True, "ssl_ca_certs": files["ca"], "host": "localhost"},
    ).start()
    yield server_proc, files
    server_proc.cleanup()


def test_redis_over_tls(make_app, tls_redis):
    server, files = tls_redis
    url = f"rediss://localhost:{server.port}/0"
    client = make_app(redis_url=url, redis_tls_ca_file=files["ca"]).test_client()
    assert ocr(client, WORD_EN.read_bytes()).headers["X-Cache"] == "MISS"
    assert ocr(client, WORD_EN.read_bytes()).headers["X-Cache"] == "HIT"
    # Without the CA the server is not trusted: answers still come (from the engine), never
    # from the cache.
    untrusted = make_app(redis_url=url).test_client()
    for _ in range(2):
        resp = ocr(untrusted, WORD_EN.read_bytes())
        assert resp.status_code == 200 and resp.headers["X-Cache"] == "MISS"
    # And plaintext clients are refused by the server.
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=server.port, socket_timeout=1).ping()


# --- ACL user limited to the prefix, password from a file ------------------------------------


@pytest.fixture()
def acl_redis(tmp_path):  # type: ignore[no-untyped-def]
    with EmbeddedRedis() as server:
        admin = redis.Redis(port=server.port)
        admin.acl_setuser("admin", enabled=True, passwords=["+admin-pw"], keys=["*"],
                          channels=["*"], commands=["+@all"])  # fmt: skip
        admin.execute_command(
            "ACL", "SETUSER", "ocr", "on", ">ocr-secret-pw", "~ocr:*", "~{ocr:dispatch:*",
            "&ocr:*", "&ocr:done:*", "+@all", "-@dangerous",
        )  # fmt: skip
        admin.execute_command("ACL", "SETUSER", "default", "off")
        secret = tmp_path / "redis-password"
        secret.write_text("ocr-secret-pw\n")
        yield server, secret


def test_acl_user_limited_to_the_prefix_with_password_file(make_app, acl_redis, caplog):
    from app.config import Settings

    server, secret = acl_redis
    settings = Settings.from_env(
        {"REDIS_USERNAME": "ocr", "REDIS_PASSWORD_FILE": str(secret)}
    )  # the *_FILE form, as from a Kubernetes Secret
    assert settings.redis.password == "ocr-secret-pw"
    assert "ocr-secret-pw" not in repr(settings)
    with caplog.at_level(logging.DEBUG):
        app = make_app(
            redis_url=server.url, redis_username="ocr", redis_password=settings.redis.password
        )
        assert app.extensions["ocr"]["cache"].dispatch_ready(60)  # the queue's keys allowed too
        client = app.test_client()
        statuses = [ocr(client, WORD_CH.read_bytes()).headers["X-Cache"] for _ in range(2)]
    assert statuses == ["MISS", "HIT"]
    assert "ocr-secret-pw" not in caplog.text
    user = redis.Redis(port=server.port, username="ocr", password="ocr-secret-pw")
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.set("elsewhere:key", b"x")  # outside the prefix
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.execute_command("FLUSHALL")
    # A wrong password: still answered, nothing cached, and the password is not logged.
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        wrong = make_app(
            redis_url=server.url, redis_username="ocr", redis_password="not-the-password"
        ).test_client()
        for _ in range(2):
            resp = ocr(wrong, WORD_EN.read_bytes())
            assert resp.status_code == 200 and resp.headers["X-Cache"] == "MISS"
    assert "not-the-password" not in caplog.text


def test_check_config_never_prints_secrets(tmp_path):
    secret = tmp_path / "pw"
    secret.write_text("file-secret-value")
    env = {
        "PATH": os.environ["PATH"],
        "REDIS_URL": "redis://user:url-secret-value@localhost:6379/0",
        "REDIS_PASSWORD_FILE": str(secret),
        "ADMIN_TOKEN": TOKEN,
        "CACHE_ENCRYPTION_KEYS": "k1:" + base64.b64encode(b"k" * 32).decode(),
    }
    out = subprocess.run(
        [sys.executable, "-m", "app", "check-config"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for value in ("file-secret-value", "url-secret-value", TOKEN, "a2tr"):
        assert value not in out.stdout + out.stderr
    assert "REDIS_PASSWORD=<set>" in out.stdout and "ADMIN_TOKEN=<set>" in out.stdout


# --- encryption at rest ----------------------------------------------------------------------


def _keys(*pairs: tuple[str, bytes]) -> tuple[tuple[str, bytes], ...]:
    return tuple(pairs)


def test_values_are_encrypted_and_keys_rotate(make_app, redis_client):
    old, new = ("old", b"o" * 32), ("new", b"n" * 32)
    data = PHOTOTEST.read_bytes()
    writer = make_app(cache_encryption_keys=_keys(old)).test_client()
    lines = ocr(writer, data).get_json()["lines"]
    (key,) = entry_keys(redis_client)
    raw = redis_client.get(key)
    assert raw[:5] == b"OCR1e" and b"quick brown" not in raw and b"lazy fox" not in raw
    # Rotation: the new key encrypts, the old one still decrypts: a hit, no flush needed.
    rotated = make_app(cache_encryption_keys=_keys(new, old)).test_client()
    resp = ocr(rotated, data)
    assert resp.headers["X-Cache"] == "HIT" and resp.get_json()["lines"] == lines
    # Without the key (or with another one) the entry is unreadable: a miss, then rewritten.
    stranger = make_app(cache_encryption_keys=_keys(("other", b"x" * 32))).test_client()
    assert ocr(stranger, data).headers["X-Cache"] == "MISS"
    plain = make_app().test_client()
    assert ocr(plain, WORD_EN.read_bytes()).headers["X-Cache"] == "MISS"
    # A plaintext entry (e.g. planted by someone who can write to Redis) is not trusted.
    assert ocr(rotated, WORD_EN.read_bytes()).headers["X-Cache"] == "MISS"


# --- admin API -------------------------------------------------------------------------------


def test_admin_api_is_off_without_a_token(client, redis_client):
    ocr(client, WORD_EN.read_bytes())
    assert client.get("/admin/stats").status_code in (404, 405)  # no such resource
    # POST /{name}/{method} is the pipeline protocol: "admin" is not our service name.
    resp = client.post("/admin/purge", json={"namespace": ""})
    assert json.loads(resp.data)["err_no"] == 3002
    assert redis_client.keys("ocr:*")  # nothing purged


def test_admin_api_needs_the_bearer_token(make_app):
    client = make_app(admin_token=TOKEN).test_client()
    assert client.get("/admin/stats").status_code == 401
    bad = {"Authorization": "Bearer " + "x" * len(TOKEN)}
    assert client.get("/admin/stats", headers=bad).status_code == 401
    assert client.get("/admin/stats", headers={"Authorization": TOKEN}).status_code == 401
    stats = client.get("/admin/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    assert stats.status_code == 200
    body = stats.get_json()
    assert body["redis"]["maxmemory_policy"] == "allkeys-lru"
    assert body["engine"]["status"] == "ready" and "l1" in body


def test_purge_by_digest_and_by_namespace(make_app, redis_client):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    a = make_app(admin_token=TOKEN, cache_tenant_header="X-Tenant", cache_l1_bytes=1 << 20)
    b = make_app(cache_tenant_header="X-Tenant", cache_l1_bytes=1 << 20)  # another process
    ca, cb = a.test_client(), b.test_client()
    for data in (WORD_EN.read_bytes(), SHORT.read_bytes()):
        ocr(ca, data)
        ocr(ca, data, **{"X-Tenant": "acme"})
        assert ocr(cb, data).headers["X-Cache"] == "HIT"  # now in b's L1 too
    md5 = digest_image(WORD_EN.read_bytes()).md5
    resp = ca.post("/admin/purge", json={"md5": md5}, headers=auth)
    assert resp.status_code == 200 and resp.get_json()["removed"] == 1
    assert ocr(ca, WORD_EN.read_bytes()).headers["X-Cache"] == "MISS"

    def dropped() -> bool:  # b drops its L1 when the purge is announced
        status = ocr(cb, SHORT.read_bytes(), **{"Cache-Control": "no-store"}).headers["X-Cache"]
        return status == "HIT" and b.extensions["ocr"]["cache"].l1.size_bytes <= 5000

    wait_for(dropped, 60, "b's L1 dropped by the purge's announcement",
             lambda: f"b's L1: {b.extensions['ocr']['cache'].l1.size_bytes} bytes")  # fmt: skip
    # Purge a tenant's namespace: its keys go, the default namespace's stay.
    assert any(k.startswith(b"ocr.acme:") for k in redis_client.keys("*"))
    redis_client.config_resetstat()
    resp = ca.post("/admin/purge", json={"namespace": "acme"}, headers=auth)
    # two entries and their pixel-tier pointers
    assert resp.status_code == 200 and resp.get_json()["removed"] == 4
    stats = redis_client.info("commandstats")
    assert "cmdstat_scan" in stats and "cmdstat_keys" not in stats  # never KEYS
    keys = redis_client.keys("*")
    assert not any(k.startswith(b"ocr.acme:") for k in keys)
    assert any(k.startswith(b"ocr:") for k in keys)
    for body in ({"md5": "nothex"}, {"namespace": "a b"}, "text"):
        assert ca.post("/admin/purge", json=body, headers=auth).status_code == 400


# --- request-level controls and tenants --------------------------------------------------------


def test_tenants_never_share_entries(make_app, redis_client):
    client = make_app(cache_tenant_header="X-Tenant").test_client()
    data = WORD_CH.read_bytes()
    assert ocr(client, data, **{"X-Tenant": "alpha"}).headers["X-Cache"] == "MISS"
    assert ocr(client, data, **{"X-Tenant": "alpha"}).headers["X-Cache"] == "HIT"
    assert ocr(client, data, **{"X-Tenant": "beta"}).headers["X-Cache"] == "MISS"
    assert ocr(client, data).headers["X-Cache"] == "MISS"  # no header: the default namespace
    prefixes = {k.split(b":")[0] for k in redis_client.keys("*")}
    assert prefixes == {b"ocr.alpha", b"ocr.beta", b"ocr"}
    bad = ocr(client, data, **{"X-Tenant": "../etc"})
    assert bad.status_code == 400 and bad.get_json()["error"]["code"] == "invalid_tenant"
    body = json.dumps({"key": ["image"], "value": [b64(data)]})
    pipe = client.post("/ocr/prediction", data=body, headers={"X-Tenant": "alpha"})
    assert pipe.headers["X-Cache"] == "HIT"


def test_ttl_override_is_bounded(make_app, redis_client):
    client = make_app(cache_ttl_max_seconds=3600).test_client()
    assert ocr(client, WORD_EN.read_bytes(), **{"X-Cache-TTL": "120"}).status_code == 200
    (key,) = entry_keys(redis_client)
    assert 100 < redis_client.ttl(key) <= 120
    for value in ("0", "abc", "3601", "-5"):
        resp = ocr(client, SHORT.read_bytes(), **{"X-Cache-TTL": value})
        assert resp.status_code == 400 and resp.get_json()["error"]["code"] == "invalid_ttl"
    body = json.dumps({"key": ["image"], "value": [b64(SHORT.read_bytes())]})
    pipe = client.post("/ocr/prediction", data=body, headers={"X-Cache-TTL": "0"})
    assert json.loads(pipe.data)["err_no"] == 5000


# --- code and logs -----------------------------------------------------------------------------


def test_no_pickle_or_eval_anywhere_in_app():
    """Checked on the syntax tree (docstrings may mention eval; code may not call it)."""
    unsafe_modules = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle"}
    offenders = []
    for path in (ROOT / "app").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                if any(n.split(".")[0] in unsafe_modules for n in names):
                    offenders.append(f"{where}: imports {names}")
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                if isinstance(func, ast.Name) and name in {"eval", "exec", "compile"}:
                    offenders.append(f"{where}: calls {name}()")
                if name == "load" and ast.unparse(func).startswith("yaml."):
                    offenders.append(f"{where}: yaml.load (use safe_load)")
                for kw in node.keywords:
                    if kw.arg == "allow_pickle" and ast.unparse(kw.value) != "False":
                        offenders.append(f"{where}: allow_pickle")
    assert offenders == []


def test_info_logs_hold_no_image_bytes_or_recognized_text(make_app, caplog):
    data = PHOTOTEST.read_bytes()
    with caplog.at_level(logging.INFO):
        client = make_app().test_client()
        lines = ocr(client, data).get_json()["lines"]
        ocr(client, data)
        client.post("/ocr/prediction", data=json.dumps({"key": ["image"], "value": [b64(data)]}))
        client.post("/ocr", json={"file": b64(data), "fileType": 1})
        client.post("/ocr/prediction", data=json.dumps({"key": ["image"], "value": ["@@"]}))
        ocr(client, b"not an image at all")
    texts = [line["text"] for line in lines if len(line["text"]) > 6]
    assert texts
    for record in caplog.records:
        message = record.getMessage()
        assert not any(text in message for text in texts), message
        assert b64(data)[:40] not in message
