"""``ocr-cache`` as people run it: the installed console script in a subprocess, against the
real service (real engine, real Redis) on a folder of corpus files."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from PIL import Image

from app.ports import free_port
from tests.conftest import PHOTOTEST, SHORT, WORD_CH, WORD_EN
from tests.live_server import live_service  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

CLI = Path(sys.executable).with_name("ocr-cache")


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert CLI.is_file(), f"{CLI} missing: `make install` installs the console script"
    return subprocess.run(
        [str(CLI), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture()
def corpus_folder(tmp_path: Path) -> Path:
    """A few corpus files (links), one in a sub-folder, a one-page PDF and a file to skip."""
    folder = tmp_path / "scans"
    (folder / "sub").mkdir(parents=True)
    (folder / WORD_EN.name).symlink_to(WORD_EN)
    (folder / PHOTOTEST.name).symlink_to(PHOTOTEST)
    (folder / "sub" / WORD_CH.name).symlink_to(WORD_CH)
    Image.open(WORD_EN).convert("RGB").save(folder / "sub" / "word.pdf")
    (folder / "notes.txt").write_text("not an image")
    return folder


def records(text: str) -> dict[str, dict[str, Any]]:
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    return {Path(r["path"]).name: r for r in lines}


def stats(base: str) -> dict[str, Any]:
    return requests.get(f"{base}/v1/stats", timeout=10).json()


def settled(base: str) -> dict[str, Any]:
    """The figures once the engine calls counted in this process (every app a test here built
    shares the engine and its counter) held still for 2 s: a call another test left behind
    does not land in this test's count. At most a minute."""
    last, deadline = stats(base), time.monotonic() + 60
    while True:
        time.sleep(2)
        now = stats(base)
        if now["engine"]["calls"] == last["engine"]["calls"] or time.monotonic() > deadline:
            return now
        last = now


def test_ocr_folder_json_lines_summary_then_hits(live_service, corpus_folder, tmp_path):  # noqa: F811
    base = live_service()
    out = tmp_path / "results.jsonl"
    before = settled(base)

    first = run_cli("ocr", str(corpus_folder), "--server", base, "--json", "--out", str(out),
                    "--concurrency", "2")  # fmt: skip
    assert first.returncode == 0, first.stderr
    got = records(first.stdout)
    assert set(got) == {WORD_EN.name, PHOTOTEST.name, WORD_CH.name, "word.pdf"}  # not notes.txt
    assert records(out.read_text()) == got
    assert {r["cache"] for r in got.values()} == {"MISS"}
    assert "4 files (3 images, 1 PDFs with 1 pages): 0 hits, 4 misses, 0 errors" in first.stderr

    # Each record carries what the service answers for that file.
    for path in (WORD_EN, PHOTOTEST, WORD_CH):
        answer = requests.post(
            f"{base}/v1/ocr", files={"file": path.read_bytes()}, timeout=60
        ).json()
        assert got[path.name]["lines"] == answer["lines"]
        assert (got[path.name]["width"], got[path.name]["height"]) == (
            answer["width"],
            answer["height"],
        )
    assert got[WORD_EN.name]["lines"] and len(got[PHOTOTEST.name]["lines"]) > 5
    pdf_page = got["word.pdf"]["pages"][0]
    assert pdf_page["lines"] and all(
        set(line) == {"text", "score", "box"} for line in pdf_page["lines"]
    )

    second = run_cli("ocr", str(corpus_folder), "--server", base)
    assert second.returncode == 0, second.stderr
    assert "4 files (3 images, 1 PDFs with 1 pages): 4 hits, 0 misses, 0 errors" in second.stdout
    mean = stats(base)["engine"]["mean_seconds"]
    assert mean > 0
    assert f"engine time saved by hits: {4 * mean:.2f} s (4 images x {mean:.3f} s" in second.stdout
    after = stats(base)
    # The service counted what the CLI saw: 4 misses, then 4 hits (plus the 3 direct calls).
    assert after["cache"]["misses"] - before["cache"]["misses"] == 4
    assert after["cache"]["hits"] - before["cache"]["hits"] == 4 + 3
    assert after["engine"]["calls"] - before["engine"]["calls"] == 4


def test_failures_exit_1_with_reasons_and_other_files_still_done(live_service, tmp_path):  # noqa: F811
    base = live_service()
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / WORD_EN.name).symlink_to(WORD_EN)
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (folder / "broken.pdf").write_bytes(b"%PDF-1.4 truncated")

    result = run_cli("ocr", str(folder), "--server", base, "--json")
    assert result.returncode == 1
    got = records(result.stdout)
    assert "lines" in got[WORD_EN.name] and "error" not in got[WORD_EN.name]
    assert got["broken.png"]["error"].startswith("HTTP 400 ")
    assert got["broken.pdf"]["error"].startswith("HTTP 422")
    assert "3 files (2 images, 1 PDFs with 0 pages): 0 hits, 1 misses, 2 errors" in result.stderr
    assert "2 files failed:" in result.stderr
    assert f"  {folder / 'broken.png'}: HTTP 400 " in result.stderr
    assert f"  {folder / 'broken.pdf'}: HTTP 422" in result.stderr


def test_progress_bar_on_a_terminal(live_service, tmp_path):  # noqa: F811
    base = live_service()
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / SHORT.name).symlink_to(SHORT)
    # rich draws the live bar only on a terminal; TTY_COMPATIBLE=1 says stderr is one.
    result = run_cli("ocr", str(folder), "--server", base, env={"TTY_COMPATIBLE": "1"})
    assert result.returncode == 0, result.stderr
    bar = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", result.stderr)  # without colours
    assert re.search(r"OCR ━+ 1/1 hits 0 misses 1 errors 0 [0-9.]+ files/s .* ETA", bar), bar
    quiet = run_cli("ocr", str(folder), "--server", base)  # not a terminal: no bar
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_unreachable_server_and_bad_paths_are_one_line_errors(tmp_path):
    down = f"http://127.0.0.1:{free_port()}"
    result = run_cli("ocr", str(WORD_EN), "--server", down)
    assert result.returncode == 2
    assert (
        result.stderr
        == f"ocr-cache: error: cannot reach the service at {down}: connection refused\n"
    )
    result = run_cli("stats", "--server", down)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    missing = tmp_path / "nope"
    result = run_cli("ocr", str(missing), "--server", down)
    assert (result.returncode, result.stderr) == (
        2,
        f"ocr-cache: error: no such file or folder: {missing}\n",
    )
    (tmp_path / "empty").mkdir()
    result = run_cli("ocr", str(tmp_path / "empty"), "--server", down)
    assert result.returncode == 2 and "no images or PDFs found" in result.stderr


def test_warm_then_stats(live_service, corpus_folder):  # noqa: F811
    base = live_service()
    warm = run_cli("warm", str(corpus_folder), "--server", base)
    assert warm.returncode == 0, warm.stderr
    assert "4 files" in warm.stdout and "0 errors" in warm.stdout
    again = run_cli("ocr", str(corpus_folder), "--server", base, "--json")
    assert {r["cache"] for r in records(again.stdout).values()} == {"HIT"}

    raw = run_cli("stats", "--server", base, "--json")
    assert raw.returncode == 0, raw.stderr
    figures = json.loads(raw.stdout)
    now = stats(base)
    assert figures["engine"] == now["engine"]
    for key in ("lookups", "hits", "misses", "hit_ratio"):
        assert figures["cache"][key] == now["cache"][key]
    redis = figures["cache"]["redis"]
    assert redis["state"] == "up" and redis["keys"] >= 4 and redis["used_memory_bytes"] > 0
    shown = run_cli("stats", "--server", base)
    assert shown.returncode == 0, shown.stderr
    ratio = figures["cache"]["hit_ratio"]
    assert f"hit ratio      {ratio:.1%}" in shown.stdout
    assert f"engine calls   {figures['engine']['calls']} " in shown.stdout
    assert f"entries        {redis['keys']} Redis keys" in shown.stdout
    assert (
        "evictions      0" in shown.stdout and "memory " in shown.stdout and "p95" in shown.stdout
    )


def test_purge_with_token_from_env_or_file(live_service, tmp_path):  # noqa: F811
    base = live_service(admin_token="cli-test-token-1234567890")
    md5 = hashlib.md5(WORD_EN.read_bytes()).hexdigest()  # noqa: S324 (the cache key's digest)
    assert run_cli("ocr", str(WORD_EN), "--server", base).returncode == 0

    bad = run_cli("purge", "--md5", md5, "--server", base, env={"OCR_CACHE_ADMIN_TOKEN": "wrong"})
    assert (bad.returncode, bad.stderr) == (
        2,
        f"ocr-cache: error: the service at {base} refused the admin token (HTTP 401)\n",
    )
    none = run_cli("purge", "--md5", md5, "--server", base,
                   env={"OCR_CACHE_ADMIN_TOKEN": "", "ADMIN_TOKEN": ""})  # fmt: skip
    assert none.returncode == 2 and "an admin token is needed" in none.stderr
    unsaid = run_cli("purge", "--server", base, env={"OCR_CACHE_ADMIN_TOKEN": "x"})
    assert unsaid.returncode == 2 and "say what to purge" in unsaid.stderr

    token_file = tmp_path / "token"
    token_file.write_text("cli-test-token-1234567890\n")
    purged = run_cli("purge", "--md5", md5, "--server", base, "--token-file", str(token_file))
    assert purged.returncode == 0, purged.stderr
    assert purged.stdout.startswith("removed 1 entries (md5 " + md5)
    again = run_cli("ocr", str(WORD_EN), "--server", base, "--json")
    assert records(again.stdout)[WORD_EN.name]["cache"] == "MISS"

    by_env = run_cli("purge", "--all", "--server", base,
                     env={"OCR_CACHE_ADMIN_TOKEN": "cli-test-token-1234567890"})  # fmt: skip
    assert by_env.returncode == 0 and by_env.stdout.startswith("removed ")
    assert run_cli("purge", "--all", "--server", live_service(),
                   env={"OCR_CACHE_ADMIN_TOKEN": "x"}).stderr.endswith(
        "(start it with ADMIN_TOKEN set)\n"
    )  # fmt: skip


def test_keys_from_a_file_and_stats_per_tenant(live_service, tmp_path):  # noqa: F811
    """AUTH=keys: the CLI sends its key (file or env), and `stats --tenants` shows who costs
    what, one line per tenant."""
    key = "cli-tenant-key-0123456789abcdef"
    tenants = tmp_path / "tenants.json"
    digest = hashlib.sha256(key.encode()).hexdigest()
    tenants.write_text(json.dumps({"tenants": [{"name": "scans", "key_sha256": digest}]}))
    base = live_service(auth="keys", api_keys_file=str(tenants))
    refused = run_cli("ocr", str(WORD_EN), "--server", base, env={"OCR_CACHE_API_KEY": ""})
    assert refused.returncode == 1 and "401" in refused.stderr
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    sent = run_cli("ocr", str(WORD_EN), "--server", base, "--api-key-file", str(key_file))
    assert sent.returncode == 0, sent.stderr
    again = run_cli("ocr", str(WORD_EN), "--server", base, env={"OCR_CACHE_API_KEY": key})
    assert again.returncode == 0 and "1 hits" in again.stdout
    shown = run_cli("stats", "--tenants", "--server", base)
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines() if line.strip()}
    assert {"tenant", "default", "scans", "other"} <= rows.keys()
    figures = stats(base)["tenants"]["scans"]
    assert rows["scans"][1:3] == [str(figures["hits"] + figures["coalesced"]),
                                  str(figures["misses"])]  # fmt: skip
    assert figures["misses"] >= 1 and figures["hits"] >= 1
