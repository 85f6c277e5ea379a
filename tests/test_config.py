import subprocess
import sys

import pytest

from app.config import ConfigError, Settings
from tests.conftest import ROOT


def test_defaults():
    s = Settings.from_env({})
    assert (s.http_port, s.grpc_port, s.cache_ttl_seconds, s.cache_key_prefix) == (
        9998,
        18091,
        86400,
        "ocr",
    )
    assert s.cache_enabled and s.ocr_engine == "paddle" and s.ocr_device == "cpu"


def test_values_are_parsed():
    s = Settings.from_env(
        {"HTTP_PORT": "8080", "CACHE_ENABLED": "false", "OCR_DEVICE": "GPU", "LOG_LEVEL": "debug"}
    )
    assert (s.http_port, s.cache_enabled, s.ocr_device, s.log_level) == (
        8080,
        False,
        "gpu",
        "DEBUG",
    )


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
