import subprocess
import sys

import pytest

from app.config import REMOVED, ConfigError, Settings, markdown
from tests.conftest import ROOT

pytestmark = pytest.mark.unit


def test_defaults():
    s = Settings.from_env({})
    assert (s.server.http_port, s.server.grpc_port, s.cache.ttl_seconds, s.cache.key_prefix) == (
        9998,
        18091,
        86400,
        "ocr",
    )
    assert s.cache.enabled and s.engine.kind == "paddle" and s.paddle.device == "cpu"


def test_values_are_parsed():
    s = Settings.from_env(
        {"HTTP_PORT": "8080", "CACHE_ENABLED": "false", "OCR_DEVICE": "GPU", "LOG_LEVEL": "debug"}
    )
    assert (s.server.http_port, s.cache.enabled, s.paddle.device, s.server.log_level) == (
        8080,
        False,
        "gpu",
        "DEBUG",
    )


def test_each_variable_is_read_once_into_one_section():
    """One section per component; a variable is read in exactly one place, and an override
    names it by the variable (``with_overrides(http_port=...)``)."""
    seen = [var for var, _, _ in Settings().variables()]
    assert len(seen) == len(set(seen)) and len(seen) > 90
    s = Settings().with_overrides(http_port=1234, cache_l1_bytes=0, ocr_device="gpu")
    assert (s.server.http_port, s.cache.l1_bytes, s.paddle.device) == (1234, 0, "gpu")
    with pytest.raises(TypeError):
        Settings().with_overrides(no_such_setting=1)


def test_secrets_come_from_files_and_are_never_shown(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("t" * 20 + "\n")
    s = Settings.from_env({"ADMIN_TOKEN_FILE": str(secret), "REDIS_URL": "redis://:pw@h:1/0"})
    assert s.server.admin_token == "t" * 20
    assert "t" * 20 not in repr(s) and "pw@" not in repr(s)
    shown = {var: secret for var, _, secret in s.variables()}
    assert shown["ADMIN_TOKEN"] and shown["REDIS_URL"] and not shown["HTTP_PORT"]


@pytest.mark.parametrize("var", sorted(REMOVED))
def test_a_removed_setting_still_set_stops_start_up_naming_its_replacement(var):
    with pytest.raises(ConfigError) as info:
        Settings.from_env({var: "1"})
    assert str(info.value) == f"{var}: removed; {REMOVED[var]}"


def test_the_configuration_document_is_generated_from_the_code():
    """docs/CONFIGURATION.md is what ``python -m app config-doc`` prints: regenerate it
    (``.venv/bin/python -m app config-doc > docs/CONFIGURATION.md``) after changing a setting."""
    assert (ROOT / "docs" / "CONFIGURATION.md").read_text() == markdown()


@pytest.mark.parametrize(
    "var,value",
    [
        ("HTTP_PORT", "abc"),
        ("HTTP_PORT", "70000"),
        ("CACHE_TTL_SECONDS", "0"),
        ("CACHE_ENABLED", "maybe"),
        ("OCR_ENGINE", "tesseract"),
        ("OCR_DEVICE", "tpu"),
        ("WEB_CONCURRENCY", "-1"),
        ("REDIS_URL", "http://localhost"),
        ("CACHE_KEY_PREFIX", "a b"),
        ("LOG_LEVEL", "loud"),
    ],
)
def test_bad_value_names_the_variable(var, value):
    with pytest.raises(ConfigError) as info:
        Settings.from_env({var: value})
    assert str(info.value).startswith(f"{var}:")
    assert "\n" not in str(info.value)


@pytest.mark.integration  # starts `python -m app serve`: a process (tests/conftest.py)
def test_bad_value_stops_start_up_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "app", "serve"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HTTP_PORT": "nope"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "configuration error: HTTP_PORT: expected an integer, got 'nope'"
    ]


@pytest.mark.parametrize("runtime", [{"OCR_DEVICE": "gpu"}, {"OCR_CPU_THREADS": "2"}])
def test_line_reuse_is_refused_where_its_exactness_is_unmeasured(runtime):
    """CACHE_LINES recognises new lines in batches of other sizes than the stock
    recognizer's: exact where a reading does not depend on the batch's size, which was
    measured on CPU with one thread only. Other engines ignore the setting."""
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"CACHE_LINES": "on", **runtime})
    assert str(info.value).startswith("CACHE_LINES:") and "\n" not in str(info.value)
    assert Settings.from_env({"CACHE_LINES": "on"}).lines.enabled
    assert Settings.from_env(
        {"CACHE_LINES": "on", "OCR_ENGINE": "serving", "SERVING_URL": "http://s:9", **runtime}
    ).lines.enabled
    assert Settings.from_env({**runtime}).lines.ttl_seconds == 0  # 0: CACHE_TTL_SECONDS


def test_the_pipeline_cannot_take_the_open_inference_protocols_path():
    """``/v2/...`` is KServe v2's: a pipeline named v2 would lose its routes to it (and give
    nginx two ``location /v2/``)."""
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"PIPELINE_SERVICE_NAME": "v2"})
    assert str(info.value).startswith("PIPELINE_SERVICE_NAME:")
    assert Settings.from_env({"PIPELINE_SERVICE_NAME": "v3"}).protocols.pipeline_service_name
