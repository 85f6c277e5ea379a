"""Logs cannot be forged by client strings, and labelled counters exist (at 0) from start-up."""

from __future__ import annotations

import base64
import logging
import subprocess
import sys

import pytest

from tests.conftest import ROOT, WORD_EN

pytestmark = pytest.mark.integration

FORGED = "10.0.0.1\n2026-11-30 00:00:00,000 WARNING app.admin: purge by admin\r\x1b[2J"


def test_client_strings_cannot_forge_log_lines(client, caplog):
    body = {"key": ["image"], "value": ["not base64 !"], "logid": 7, "clientip": FORGED}
    with caplog.at_level(logging.DEBUG, logger="app"):
        answer = client.post("/ocr/prediction", json=body).get_json()
    assert answer["err_no"] != 0  # the error path logs clientip at INFO
    lines = [r.getMessage() for r in caplog.records if "clientip=" in r.getMessage()]
    assert lines, caplog.text
    for line in lines:
        assert "\n" not in line and "\r" not in line and "\x1b" not in line
        assert "clientip=10.0.0.1\\n2026-11-30" in line  # kept, escaped
    assert not any(
        text.startswith("2026-11-30 00:00:00,000 WARNING") for text in caplog.text.splitlines()
    )


def test_labelled_counters_are_exported_from_the_start(client):
    """Present before their first event (in this test process other tests may have counted
    already; the fresh-process test below checks the zeros)."""
    text = client.get("/metrics").get_data(as_text=True)
    for sample in (
        'ocr_engine_calls_total{engine="paddle",outcome="busy"}',
        'ocr_engine_calls_total{engine="paddle",outcome="timeout"}',
        'ocr_cache_requests_total{result="hit"}',
        'ocr_cache_requests_total{result="coalesced"}',
        'ocr_cache_tier_hits_total{tier="l2"}',
        'ocr_engine_queue_dropped_total{reason="full"}',
        'ocr_unexpected_errors_total{protocol="grpc"}',
        "ocr_engine_queue_depth ",
    ):
        assert sample in text, sample


def test_counters_are_exported_before_any_request_multiprocess(tmp_path):
    """Under granian (multiprocess mode) too: a fresh worker's files hold the zeros."""
    code = (
        f"import os; os.environ['PROMETHEUS_MULTIPROC_DIR'] = {str(tmp_path)!r}\n"
        "from app import metrics; metrics.initialise('paddle')\n"
        "print(metrics.render()[0].decode())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert 'ocr_engine_calls_total{engine="paddle",outcome="ok"} 0.0' in out.stdout
    assert 'ocr_cache_requests_total{result="miss"} 0.0' in out.stdout
    assert 'ocr_unexpected_errors_total{protocol="grpc"} 0.0' in out.stdout


def test_escaping_keeps_ordinary_text(client):
    from app.logsafe import escape

    assert escape("plain ASCII, ünïcode 文字") == "plain ASCII, ünïcode 文字"
    assert escape("a\nb\tc\x00") == "a\\nb\\tc\\x00"
    resp = client.post("/v1/ocr", json={"image": base64.b64encode(WORD_EN.read_bytes()).decode()})
    assert resp.status_code == 200
