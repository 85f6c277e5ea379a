"""Document jobs served for real (``python -m app serve``: a front whose workers hold no
engine, an engine process that drives jobs): a front worker killed and an engine killed
(``-9``) while a job runs; the job still succeeds, every page read, from the same polls."""

from __future__ import annotations

import base64
import io
import os
import signal
import time
from pathlib import Path

import pytest
import requests
from PIL import Image

from app.config import Settings
from tests.conftest import CORPUS, PHOTOTEST, WORD_CH, WORD_EN
from tests.test_roles import serve

pytestmark = [pytest.mark.deploy, pytest.mark.slow]

BIG = CORPUS / "donut_document.png"  # seconds of engine time: the engine dies inside it


def make_pdf(*paths: Path) -> bytes:
    pages = [Image.open(p).convert("RGB") for p in paths]
    buf = io.BytesIO()
    pages[0].save(buf, "PDF", resolution=72, save_all=True, append_images=pages[1:])
    return buf.getvalue()


def test_a_job_outlives_a_front_worker_and_an_engine_killed_mid_page(tmp_path: Path) -> None:
    pdf = make_pdf(WORD_EN, BIG, PHOTOTEST, WORD_CH)
    settings = {
        "JOBS_PAGES_IN_FLIGHT": "1", "JOBS_CLAIM_IDLE_SECONDS": "4",
        "PDF_RENDER_SCALE": "1", "WEB_CONCURRENCY": "2",
    }  # fmt: skip
    with serve(tmp_path, **settings) as fleet:
        answer = requests.post(
            f"{fleet.base}/v1/jobs", files={"file": ("doc.pdf", pdf)}, timeout=60
        )
        assert answer.status_code == 202, answer.text
        url = f"{fleet.base}{answer.headers['Location']}"

        def job() -> dict:
            got = requests.get(url, timeout=30)
            assert got.status_code == 200, got.text
            return dict(got.json())

        deadline = time.monotonic() + 120
        while job()["progress"]["pages_done"] < 1:  # page 1 done, page 2 (BIG) computing
            assert time.monotonic() < deadline, job()
            time.sleep(0.1)
        worker = fleet.front_workers()[0]
        os.kill(worker, signal.SIGKILL)  # granian starts another; the job is not its
        [engine] = fleet.engines()
        time.sleep(0.5)
        assert job()["status"] == "running"  # page 2 (BIG) computing: the engine dies in it
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 240
        while (state := job())["status"] in ("queued", "running"):
            assert time.monotonic() < deadline, state
            time.sleep(0.5)
        assert fleet.engines() and fleet.engines() != [engine]
        job_id = url.rsplit("/", 1)[1]
        assert "".join(fleet.output).count(f"job {job_id}: driving") == 2  # taken over
        assert state["status"] == "succeeded", state
        # Every page as the synchronous PaddleX /ocr reads the same file, computed afresh
        # (no cached entry read, none stored) by the engine that replaced the killed one.
        body = {"file": base64.b64encode(pdf).decode(), "fileType": 0, "visualize": False,
                "textRecScoreThresh": Settings.from_env({}).ocr.rec_score_thresh}  # fmt: skip
        answer = requests.post(
            f"{fleet.base}/ocr", json=body, timeout=300,
            headers={"Cache-Control": "no-cache, no-store"},
        )  # fmt: skip
        assert answer.headers["X-Cache"] == "MISS", answer.headers
    assert state["progress"] == {"pages_done": 4, "pages_failed": 0, "pages_total": 4}
    assert [page["page"] for page in state["pages"]] == [1, 2, 3, 4]
    expected = [item["prunedResult"]["rec_texts"] for item in answer.json()["result"]["ocrResults"]]
    assert [[line["text"] for line in page["lines"]] for page in state["pages"]] == expected
    assert any(expected)
