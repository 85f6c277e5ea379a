"""The web page at ``/`` in a real headless Chromium (Debian's package, driven by Playwright's
Python client; no browser is downloaded), against the real service: upload corpus files, find
their boxes drawn and their lines listed as the REST API answers them. Screenshots go to
``test-artifacts/`` (or ``$TEST_ARTIFACTS_DIR``)."""

from __future__ import annotations

import base64
import os
import shutil
import threading
from collections.abc import Iterator
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import pytest
import requests
from PIL import Image

from tests.conftest import PHOTOTEST, ROOT, WORD_EN
from tests.fleet import wait_for
from tests.live_server import live_service  # noqa: F401  (fixture)

pytestmark = pytest.mark.deploy

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS_DIR", ROOT / "test-artifacts"))
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@pytest.fixture()
def browser_context(tmp_path: Path) -> Iterator[Any]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(
            "no chromium: `apt-get install -y chromium` failed or was not possible here, "
            "so the web page was not tested in a browser"
        )
    from playwright.sync_api import sync_playwright

    profile = tmp_path / "chromium-profile"  # empty: no state from any earlier run
    profile.mkdir()
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=ARGS,
            viewport={"width": 1280, "height": 900},
        )
        try:
            yield context
        finally:
            context.close()


def rest_lines(base: str, path: Path, **form: str) -> list[dict[str, Any]]:
    answer = requests.post(
        f"{base}/v1/ocr", files={"file": path.read_bytes()}, data=form, timeout=60
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["lines"]


def test_upload_an_image_see_boxes_lines_and_status(live_service, browser_context):  # noqa: F811
    base = live_service()
    page = browser_context.pages[0] if browser_context.pages else browser_context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("console", lambda msg: msg.type == "error" and problems.append(msg.text))
    local = (base, "blob:", "data:")  # the page asks only its own service
    page.on("request", lambda req: req.url.startswith(local) or problems.append(req.url))
    page.goto(f"{base}/")
    assert page.title() == "OCR cache"
    # Keyboard: past the skip link, Tab reaches the file chooser, then the options.
    page.keyboard.press("Tab")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "file"
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.tagName") == "SUMMARY"

    page.set_input_files("#file", str(PHOTOTEST))  # choosing a file recognises it
    page.wait_for_selector("#lines li")
    texts = page.locator("#lines li .text").all_inner_texts()
    expected = rest_lines(base, PHOTOTEST)  # now a hit: the same lines the page got
    assert texts == [line["text"] for line in expected] and len(texts) > 5
    polygons = page.locator("#pages svg polygon")
    assert polygons.count() == len(texts)
    first_box = [[round(float(v)) for v in p.split(",")] for p in
                 polygons.first.get_attribute("points").split()]  # fmt: skip
    assert first_box == [[round(v) for v in p] for p in expected[0]["box"]]
    assert page.locator("#meta .badge").inner_text() == "MISS"
    assert "answered in" in page.locator("#meta").inner_text()
    scores = page.locator("#lines li .score").all_inner_texts()
    assert scores == [f"{line['score']:.3f}" for line in expected]

    # Hover a line: its box lights up; hover a box: its line lights up.
    page.hover("#lines li[data-line='1']")
    assert "hot" in (page.locator("polygon[data-line='1']").get_attribute("class") or "")
    page.mouse.move(0, 0)
    page.locator("polygon[data-line='2']").hover(force=True)
    assert "hot" in (page.locator("#lines li[data-line='2']").get_attribute("class") or "")

    # Keyboard: Tab walks the lines, and the focused line's box lights up.
    page.focus("#lines li[data-line='3']")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.dataset.line") == "4"
    assert "hot" in (page.locator("polygon[data-line='4']").get_attribute("class") or "")

    # Copy text puts the lines, in order, on the clipboard.
    browser_context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base)
    page.click("#copy")
    page.wait_for_selector("#copied:has-text('Copied')")
    assert page.evaluate("navigator.clipboard.readText()") == "\n".join(texts)

    # Again: a cache hit; the status panel shows the service's own figures.
    page.click("#run")
    page.wait_for_selector("#meta .badge:has-text('HIT')")

    def page_shows_the_services_figures() -> bool:
        """The page refreshes every five seconds and may have fetched its figures before the
        service counted the hit (and so may this test): compare fresh ones until they agree."""
        stats = requests.get(f"{base}/v1/stats", timeout=10).json()
        # As the page writes it: JavaScript's toFixed(1) rounds the double's exact value, a
        # tie upwards (Python's format rounds a tie to even: 57.25 is 57.3 there, 57.2 here).
        ratio = Decimal(stats["cache"]["hit_ratio"] * 100).quantize(Decimal("0.1"), ROUND_HALF_UP)
        shown = (page.locator("#stat-engine-calls").inner_text(),
                 page.locator("#stat-hit-ratio").inner_text())  # fmt: skip
        return shown == (str(stats["engine"]["calls"]), f"{ratio} %")

    wait_for(page_shows_the_services_figures, 30, "the status panel shows /v1/stats' figures")
    assert page.locator("#stat-p50").inner_text() not in ("", "–")

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.hover("#lines li[data-line='3']")  # show a highlighted line in the picture
    page.screenshot(path=str(ARTIFACTS / "webpage-desktop.png"), full_page=True)

    # An option switch: min_score filters as the REST API does.
    page.click("#options summary")
    page.fill("#min-score", "0.98")
    page.click("#run")
    confident = [line["text"] for line in rest_lines(base, PHOTOTEST, min_score="0.98")]
    page.wait_for_function(
        "n => document.querySelectorAll('#lines li').length === n", arg=len(confident)
    )
    assert page.locator("#lines li .text").all_inner_texts() == confident

    # A phone-sized screen: nothing wider than the screen, the result still there.
    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    assert page.locator("#pages img").bounding_box()["width"] <= 390
    page.screenshot(path=str(ARTIFACTS / "webpage-phone.png"), full_page=True)
    assert problems == []


def test_upload_a_pdf_and_a_bad_file(live_service, browser_context, tmp_path):  # noqa: F811
    base = live_service()
    pdf = tmp_path / "word.pdf"
    Image.open(WORD_EN).convert("RGB").save(pdf)
    page = browser_context.pages[0] if browser_context.pages else browser_context.new_page()
    page.goto(f"{base}/")

    page.set_input_files("#file", str(pdf))
    page.wait_for_selector("#lines li[data-line='0']")
    answer = requests.post(
        f"{base}/ocr", json={"file": base64.b64encode(pdf.read_bytes()).decode(),
                             "fileType": 0}, timeout=60,
    ).json()  # fmt: skip
    pruned = answer["result"]["ocrResults"][0]["prunedResult"]
    assert page.locator("#lines li .text").all_inner_texts() == pruned["rec_texts"]
    assert page.locator("#pages svg polygon").count() == len(pruned["rec_texts"]) > 0
    assert page.locator("#pages img").get_attribute("src").startswith("data:image/jpeg;base64,")

    # Drag and drop: a file dropped on the drop zone is recognised like a chosen one.
    page.evaluate(
        """([name, data]) => {
            const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
            const transfer = new DataTransfer();
            transfer.items.add(new File([bytes], name, { type: "image/png" }));
            const drop = document.getElementById("drop");
            for (const type of ["dragenter", "dragover", "drop"]) {
                const init = { dataTransfer: transfer, bubbles: true, cancelable: true };
                drop.dispatchEvent(new DragEvent(type, init));
            }
        }""",
        [PHOTOTEST.name, base64.b64encode(PHOTOTEST.read_bytes()).decode()],
    )
    expected = [line["text"] for line in rest_lines(base, PHOTOTEST)]
    page.wait_for_function(
        "n => document.querySelectorAll('#lines li').length === n", arg=len(expected)
    )
    assert page.locator("#lines li .text").all_inner_texts() == expected
    assert page.locator("#chosen").inner_text().startswith(PHOTOTEST.name)

    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    page.set_input_files("#file", str(bad))
    page.wait_for_selector("#error:not([hidden])")
    assert page.locator("#error").inner_text().startswith("Could not recognise broken.png: ")


def test_a_document_job_shows_its_pages_as_they_come(make_app, browser_context, tmp_path):  # type: ignore[no-untyped-def]
    """The page's document job: a two-page PDF submitted, its pages listed with their lines
    as the job's REST answer has them, the job's end shown."""
    from werkzeug.serving import make_server

    from app.engine_side import job_driver

    app = make_app(pdf_render_scale=1.0)
    shared = app.extensions["ocr"]
    driver = job_driver.start(shared.settings, shared.jobs, shared.cache)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    pdf = tmp_path / "two.pdf"
    pictures = [Image.open(p).convert("RGB") for p in (PHOTOTEST, WORD_EN)]
    pictures[0].save(pdf, "PDF", resolution=72, save_all=True, append_images=pictures[1:])
    try:
        page = browser_context.pages[0] if browser_context.pages else browser_context.new_page()
        problems: list[str] = []
        page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
        page.goto(f"{base}/")
        page.set_input_files("#job-file", str(pdf))
        page.click("#job-submit")
        page.wait_for_selector("#job-state.succeeded", timeout=120_000)
        job_id = page.locator("#job-state").inner_text().split()[1]
        answer = requests.get(f"{base}/v1/jobs/{job_id}", timeout=30).json()
        shown = page.locator("#job-pages pre").all_inner_texts()
        assert shown == ["\n".join(line["text"] for line in p["lines"]) for p in answer["pages"]]
        assert page.locator("#job-counts").inner_text().startswith("2 of 2 pages done")
        assert not problems, problems
    finally:
        server.shutdown()
        if driver is not None:
            driver.stop()
