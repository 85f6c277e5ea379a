"""``ocr-cache submit`` against the real thing: an app (real engine, real Redis) served over
HTTP on a free port with its job driver running, and the command's ``main`` run in-process
on a two-page PDF made here from corpus images; its pages checked against what PaddleX
``/ocr`` reads in the same PDF. Also the web page's job section, read as served (there is no
browser here: ``tests/test_webpage.py`` drives one where Chromium is installed)."""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from PIL import Image
from werkzeug.serving import make_server

from app import cli, cli_jobs
from app.engine_side import job_driver
from tests.conftest import PHOTOTEST, WORD_EN

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The web page's job section: its form, its progress and its pages.
JOB_SECTION = (
    "job", "job-form", "job-file", "job-page-ranges", "job-submit", "job-cancel",
    "job-error", "job-view", "job-state", "job-progress", "job-counts", "job-pages",
)  # fmt: skip


def make_pdf(*paths: Path) -> bytes:
    pages = [Image.open(p).convert("RGB") for p in paths]
    buf = io.BytesIO()
    pages[0].save(buf, "PDF", resolution=72, save_all=True, append_images=pages[1:])
    return buf.getvalue()


@pytest.fixture()
def served(make_app: Callable[..., Any]) -> Iterator[str]:
    """The app and its job driver, served on a free port: its base URL."""
    app = make_app(pdf_render_scale=1.0, jobs_pages_in_flight=2)
    shared = app.extensions["ocr"]
    driver = job_driver.start(shared.settings, shared.jobs, shared.cache)
    assert driver is not None, "no job driver: jobs are off or there is no Redis"
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(10)
        driver.stop()


@pytest.fixture()
def document(tmp_path: Path) -> Path:
    path = tmp_path / "two-pages.pdf"
    path.write_bytes(make_pdf(PHOTOTEST, WORD_EN))
    return path


def paddlex_texts(base: str, pdf: Path) -> list[list[str]]:
    """Each page's lines as the synchronous PaddleX ``/ocr`` reads the same PDF."""
    body = {"file": base64.b64encode(pdf.read_bytes()).decode(), "fileType": 0}
    answer = requests.post(f"{base}/ocr", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return [r["prunedResult"]["rec_texts"] for r in answer.json()["result"]["ocrResults"]]


def ended(base: str, job_id: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job: dict[str, Any] = requests.get(f"{base}/v1/jobs/{job_id}", timeout=10).json()
        if job["status"] in cli_jobs.ENDED:
            return job
        assert time.monotonic() < deadline, f"job {job_id} never ended: {job}"
        time.sleep(0.2)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(["submit", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_submit_wait_prints_both_pages_and_json_is_the_ended_job(
    served: str, document: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, str(document), "--server", served, "--wait")
    assert code == 0, err
    expected = paddlex_texts(served, document)
    assert len(expected) == 2 and all(expected), (expected, out)
    assert re.match(r"job job_\S+ succeeded: 2 of 2 pages done, 0 failed", out), out
    page_one, page_two = out.index("page 1: MISS"), out.index("page 2: MISS")
    assert page_one < page_two, out
    for number, texts in enumerate(expected, 1):
        section = out[page_one:page_two] if number == 1 else out[page_two:]
        for text in texts:
            assert f"  {text}\n" in section, (number, text, out)

    # Again as JSON: the ended job, its pages now cache hits, the same lines.
    code, out, err = run(capsys, str(document), "--server", served, "--wait", "--json")
    assert code == 0, err
    job = json.loads(out)
    assert job["status"] == "succeeded", job
    assert job["progress"] == {"pages_done": 2, "pages_failed": 0, "pages_total": 2}
    assert [page["page"] for page in job["pages"]] == [1, 2]
    assert [page["cache"] for page in job["pages"]] == ["HIT", "HIT"]
    assert [[line["text"] for line in page["lines"]] for page in job["pages"]] == expected

    # Without --wait: the id alone, at once; the job is the service's to finish.
    code, out, err = run(capsys, str(document), "--server", served, "--pages", "2")
    assert code == 0, err
    job_id = out.strip()
    assert re.fullmatch(r"job_[A-Za-z0-9_-]{22}", job_id), out
    polled = requests.get(f"{served}/v1/jobs/{job_id}", timeout=10).json()
    assert polled["progress"]["pages_total"] == 1


def test_a_garbage_file_is_refused_with_the_services_reason(
    served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "garbage.pdf"
    garbage.write_bytes(b"this is neither a PDF nor an image\n" * 20)
    code, out, err = run(capsys, str(garbage), "--server", served, "--wait")
    assert code == 2, (out, err)
    assert out == ""
    assert "invalid_document" in err and "neither a PDF nor an image" in err, err
    assert "garbage.pdf was not accepted: HTTP 400" in err, err


def test_a_bad_page_range_and_an_unreachable_service_are_usage_errors(
    served: str, document: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, str(document), "--server", served, "--pages", "3-4")
    assert code == 2 and "outside the document's 1-2" in err, err
    closed = served.rsplit(":", 1)[0] + ":1"
    code, _, err = run(capsys, str(document), "--server", closed)
    assert code == 2 and "cannot reach the service" in err, err


def test_a_cancelled_job_exits_1(
    served: str,
    document: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Someone else cancels the job while the command waits: it says so and exits 1."""
    submit = cli_jobs.submit
    cancelled: list[int] = []

    def submit_then_cancel(client: cli.Client, *args: Any) -> dict[str, Any]:
        job = submit(client, *args)
        cancelled.append(requests.delete(f"{served}/v1/jobs/{job['id']}", timeout=10).status_code)
        return job

    monkeypatch.setattr(cli_jobs, "submit", submit_then_cancel)
    code, out, err = run(capsys, str(document), "--server", served, "--wait")
    assert cancelled == [200]
    assert code == 1, (out, err)
    assert re.match(r"job job_\S+ cancelled", out), out
    assert "was cancelled" in err, err


def test_ctrl_c_while_waiting_says_how_to_cancel_and_leaves_the_job(
    served: str,
    document: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def interrupted(client: cli.Client, job_id: str) -> dict[str, Any]:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_jobs, "get_job", interrupted)
    code, out, err = run(capsys, str(document), "--server", served, "--wait")
    assert code == 130, (out, err)
    job_id = re.search(r"job (job_\S+) goes on", err)
    assert job_id, err
    assert f"DELETE /v1/jobs/{job_id[1]}" in err
    assert f"curl -X DELETE {served}/v1/jobs/{job_id[1]}" in err
    job = ended(served, job_id[1])
    assert job["status"] == "succeeded", job  # it went on, not cancelled behind one's back


def test_the_web_page_has_a_document_job_section() -> None:
    """Static: the served page holds the job section's controls, and its script submits,
    polls and cancels through ``/v1/jobs`` with no HTML built from the server's text."""
    from flask import Flask

    from app import ui

    app = Flask(__name__)
    app.register_blueprint(ui.blueprint)
    client = app.test_client()
    page = client.get("/")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    for element in JOB_SECTION:
        assert f'id="{element}"' in html, element
    assert re.search(r'<progress id="job-progress"', html)
    script = client.get("/ui/app.js").get_data(as_text=True)
    assert 'fetch("/v1/jobs", { method: "POST"' in script
    assert "fetch(`/v1/jobs/${encodeURIComponent(followed.id)}`" in script
    assert 'method: "DELETE"' in script
    assert "JOB_POLL_MS = 1000" in script
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script
    assert "http://" not in script.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in script + html
    assert client.get("/ui/style.css").status_code == 200
