"""Document jobs (``/v1/jobs``, ``/api/v2/ocr/jobs``): a multi-page PDF made here from corpus
pages, submitted, driven by a real job driver through the real engine and a real Redis, polled
over HTTP; its pages equal what PaddleX ``/ocr`` answers for the same file; a repeat is all
hits; the stock ``PaddleOCRClient`` from the installed paddleocr package against a served
app; a signed callback checked by a receiver here; cancellation; tenants; bad input."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from werkzeug.serving import make_server

from app.engine_side import job_driver
from app.jobs import callback
from app.jobs.store import GROUP, SETTLE_SECONDS
from tests.conftest import CORPUS, PHOTOTEST, WORD_CH, WORD_EN
from tests.fleet import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SECRET = "a-callback-secret-of-enough-length"


def make_pdf(*paths: Path) -> bytes:
    pages = [Image.open(p).convert("RGB") for p in paths]
    buf = io.BytesIO()
    pages[0].save(buf, "PDF", resolution=72, save_all=True, append_images=pages[1:])
    return buf.getvalue()


PDF = make_pdf(PHOTOTEST, WORD_EN, WORD_CH)


def encrypted_pdf() -> bytes:
    """A PDF whose trailer names an encryption dictionary: pdfium asks for a password."""
    data = make_pdf(WORD_EN)
    entry = b"/Encrypt << /Filter /Standard /V 1 /R 2 /O <" + b"11" * 32 + b"> /U <"
    entry += b"22" * 32 + b"> /P -4 >>\n/ID [<" + b"33" * 16 + b"> <" + b"33" * 16 + b">]"
    return data.replace(b"trailer\n<<", b"trailer\n<<\n" + entry)


class Service:
    """An in-process app (both roles) with its job driver, and a test client."""

    def __init__(self, make_app: Callable[..., Any], **overrides: Any) -> None:
        settings = dict(pdf_render_scale=1.0, jobs_pages_in_flight=2)
        self.app = make_app(**{**settings, **overrides})
        self.shared = self.app.extensions["ocr"]
        self.client = self.app.test_client()
        self.driver = job_driver.start(self.shared.settings, self.shared.jobs, self.shared.cache)

    def stop(self) -> None:
        if self.driver is not None:
            self.driver.stop()

    def submit(self, pdf: bytes = PDF, headers: dict[str, str] | None = None, **form: str) -> Any:
        data = {"file": (io.BytesIO(pdf), "doc.pdf"), **form}
        return self.client.post("/v1/jobs", data=data, headers=headers or {})

    def wait(self, job_id: str, headers: dict[str, str] | None = None, timeout: float = 240) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            answer = self.client.get(f"/v1/jobs/{job_id}", headers=headers or {}).get_json()
            if answer["status"] in ("succeeded", "failed", "cancelled"):
                return answer
            assert time.monotonic() < deadline, f"job {job_id} never ended: {answer}"
            time.sleep(0.2)


@pytest.fixture()
def service(make_app: Callable[..., Any]) -> Iterator[Service]:
    running = Service(make_app)
    yield running
    running.stop()


def paddlex_pages(client: Any, pdf: bytes) -> list[dict[str, Any]]:
    body = {"file": base64.b64encode(pdf).decode(), "fileType": 0, "visualize": False}
    answer = client.post("/ocr", data=json.dumps(body))
    assert answer.status_code == 200, answer.get_data(as_text=True)
    return [item["prunedResult"] for item in answer.get_json()["result"]["ocrResults"]]


def test_a_pdf_job_reads_every_page_as_paddlex_ocr_does_and_a_repeat_is_all_hits(
    service: Service,
) -> None:
    submitted = service.submit()
    assert submitted.status_code == 202, submitted.get_data(as_text=True)
    job = submitted.get_json()
    assert submitted.headers["Location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] == "queued" and job["progress"]["pages_total"] == 3
    done = service.wait(job["id"])
    assert done["status"] == "succeeded", done
    assert done["progress"] == {"pages_done": 3, "pages_failed": 0, "pages_total": 3}
    assert [page["page"] for page in done["pages"]] == [1, 2, 3]
    assert all(page["cache"] == "MISS" for page in done["pages"])
    one = service.client.get(f"/v1/jobs/{job['id']}/pages/2").get_json()
    assert one == done["pages"][1]

    expected = paddlex_pages(service.client, PDF)  # the synchronous answer: all hits now
    for page, pruned in zip(done["pages"], expected, strict=True):
        assert [line["text"] for line in page["lines"]] == pruned["rec_texts"]
        assert [line["box"] for line in page["lines"]] == pruned["rec_polys"]

    again = service.wait(service.submit().get_json()["id"])
    assert again["status"] == "succeeded"
    assert [page["cache"] for page in again["pages"]] == ["HIT", "HIT", "HIT"]
    assert [p["lines"] for p in again["pages"]] == [p["lines"] for p in done["pages"]]


def test_a_pdf_sharing_pages_computes_only_its_new_ones(service: Service) -> None:
    first = service.wait(service.submit(make_pdf(WORD_EN, WORD_CH)).get_json()["id"])
    assert [page["cache"] for page in first["pages"]] == ["MISS", "MISS"]
    second = service.wait(service.submit(make_pdf(WORD_CH, PHOTOTEST, WORD_EN)).get_json()["id"])
    assert [page["cache"] for page in second["pages"]] == ["HIT", "MISS", "HIT"]


def test_page_ranges_select_pages(service: Service) -> None:
    answer = service.submit(pages="3,1").get_json()
    assert answer["progress"]["pages_total"] == 2
    done = service.wait(answer["id"])
    expected = paddlex_pages(service.client, PDF)
    texts = [[line["text"] for line in page["lines"]] for page in done["pages"]]
    assert texts == [expected[2]["rec_texts"], expected[0]["rec_texts"]]
    assert [page["page"] for page in done["pages"]] == [3, 1]  # the document's numbers
    one = service.client.get(f"/v1/jobs/{answer['id']}/pages/3").get_json()
    assert one == done["pages"][0]
    assert service.client.get(f"/v1/jobs/{answer['id']}/pages/2").status_code == 404


def test_the_stock_paddleocr_client_runs_a_job_unchanged(
    make_app: Callable[..., Any], tmp_path: Path
) -> None:
    """``PaddleOCRClient(base_url=..., token=...).ocr(file_path=...)`` from the installed
    paddleocr, against the app served over HTTP: its pages are the PaddleX ``/ocr`` pages.
    The stock client names only the models it knows (PP-OCRv5, PP-OCRv6); the tests' engine
    runs PP-OCRv4 files, so the operator lists the name its clients send (``JOBS_API_MODELS``),
    as the docs say."""
    from paddleocr import PaddleOCRClient

    service = Service(make_app, jobs_api_models="PP-OCRv5")
    server = make_server("127.0.0.1", 0, service.app, threaded=True)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    path = tmp_path / "doc.pdf"
    path.write_bytes(PDF)
    model = "PP-OCRv5"
    try:
        with PaddleOCRClient(token="any-token", base_url=f"http://127.0.0.1:{server.port}") as api:
            api._poller._initial_interval = 0.2  # the stock poller's first wait is 3 s
            result = api.ocr(file_path=str(path), model=model)
            with pytest.raises(Exception, match="parses documents"):
                api.submit_document_parsing(file_path=str(path))
    finally:
        server.shutdown()
        service.stop()
    assert [page.pruned_result for page in result.pages] == paddlex_pages(service.client, PDF)
    assert result.data_info["numPages"] == 3 and result.data_info["type"] == "pdf"


def test_the_paddleocr_cli_api_mode_runs_a_job_unchanged(
    make_app: Callable[..., Any], tmp_path: Path
) -> None:
    """``paddleocr api --model_type ocr ...``, the installed package's own CLI, in a process of
    its own against the app served over HTTP: its pages are the PaddleX ``/ocr`` pages."""
    service = Service(make_app, jobs_api_models="PP-OCRv5")
    server = make_server("127.0.0.1", 0, service.app, threaded=True)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    path = tmp_path / "doc.pdf"
    path.write_bytes(PDF)
    command = [
        str(Path(sys.executable).parent / "paddleocr"), "api", "--model_type", "ocr",
        "--model", "PP-OCRv5", "--file_path", str(path), "--page_ranges", "1-2",
        "--base_url", f"http://127.0.0.1:{server.port}", "--token", "any-token",
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
        service.stop()
    assert done.returncode == 0, done.stderr[-2000:]
    output = json.loads(done.stdout[done.stdout.index("{") :])
    expected = paddlex_pages(service.client, PDF)[:2]
    assert [page["prunedResult"] for page in output["pages"]] == expected


def job_driver_model(service: Service) -> str:
    from app.routes.jobs import engine_model

    return engine_model(service.shared.engine_description)


def test_paddleocr_api_states_errors_and_unknown_models(service: Service) -> None:
    client = service.client
    refused = client.post("/api/v2/ocr/jobs", json={"fileUrl": "", "model": "PP-OCRv5"})
    assert refused.status_code == 400 and refused.get_json()["code"] == 400
    wrong = client.post(
        "/api/v2/ocr/jobs",
        data={"file": (io.BytesIO(PDF), "doc.pdf"), "model": "PP-OCRv6-unknown"},
    )
    assert wrong.status_code == 400 and "answers for" in wrong.get_json()["msg"]
    answer = client.post(
        "/api/v2/ocr/jobs",
        data={"file": (io.BytesIO(PDF), "doc.pdf"), "model": job_driver_model(service),
              "optionalPayload": json.dumps({"textRecScoreThresh": 0.9}), "batchId": "b1"},
    )  # fmt: skip
    assert answer.status_code == 200, answer.get_data(as_text=True)
    job_id = answer.get_json()["data"]["jobId"]
    status = client.get(f"/api/v2/ocr/jobs/{job_id}").get_json()["data"]
    assert status["state"] in ("pending", "running", "done")
    assert status["extractProgress"]["totalPages"] == 3
    service.wait(job_id)
    status = client.get(f"/api/v2/ocr/jobs/{job_id}").get_json()["data"]
    assert status["state"] == "done" and status["extractProgress"]["extractedPages"] == 3
    url = status["resultUrl"]["jsonUrl"]
    path = url.split("://", 1)[1].split("/", 1)[1]
    lines = client.get("/" + path).get_data(as_text=True).strip().split("\n")
    scores = [s for line in lines for s in json.loads(line)["result"]["ocrResults"][0]
              ["prunedResult"]["rec_scores"]]  # fmt: skip
    assert scores and min(scores) >= 0.9  # the payload's threshold
    assert client.get("/" + path.replace("token=", "token=x")).status_code == 404
    batch = client.get("/api/v2/ocr/jobs/batch/b1").get_json()["data"]
    assert [item["jobId"] for item in batch["extractResult"]] == [job_id]
    assert client.get("/api/v2/ocr/jobs/job_" + "A" * 22).status_code == 404


class Receiver(BaseHTTPRequestHandler):
    received: list[tuple[dict[str, str], bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Receiver.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def receiver() -> Iterator[ThreadingHTTPServer]:
    Receiver.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server
    server.shutdown()


def test_the_callback_is_signed_per_tenant_and_verifies(
    make_app: Callable[..., Any], receiver: ThreadingHTTPServer, tmp_path: Path
) -> None:
    port = receiver.server_address[1]
    keys = tmp_path / "tenants.json"
    keys.write_text(json.dumps({"tenants": [
        {"name": "acme", "key_sha256": hashlib.sha256(b"acme-key-0123456789abcdef").hexdigest()},
    ]}))  # fmt: skip
    running = Service(
        make_app, auth="keys", api_keys_file=str(keys), jobs_callback_secret=SECRET,
        jobs_callback_allowed_hosts=f"127.0.0.1:{port}",
    )  # fmt: skip
    headers = {"Authorization": "Bearer acme-key-0123456789abcdef"}
    try:
        url = f"http://127.0.0.1:{port}/hook?x=1"
        refused = running.submit(headers=headers, callback_url="http://example.com/hook")
        assert refused.status_code == 400
        assert refused.get_json()["error"]["code"] == "callback_not_allowed"
        job = running.submit(make_pdf(WORD_EN), headers=headers, callback_url=url).get_json()
        assert running.wait(job["id"], headers)["status"] == "succeeded"
        wait_for(lambda: Receiver.received, 60, "the job's callback")
    finally:
        running.stop()
    (got_headers, body), = Receiver.received  # fmt: skip
    mine = callback.tenant_secret(SECRET, "acme")
    assert callback.verify(mine, got_headers, body)
    assert not callback.verify(callback.tenant_secret(SECRET, "other"), got_headers, body)
    payload = json.loads(body)
    assert payload["type"] == "job.succeeded" and payload["data"]["id"] == job["id"]


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_a_job_is_its_tenants_alone(make_app: Callable[..., Any], tmp_path: Path) -> None:
    keys = tmp_path / "tenants.json"
    keys.write_text(json.dumps({"tenants": [
        {"name": name, "key_sha256": digest(f"{name}-key-0123456789ab")}
        for name in ("acme", "zeta")
    ]}))  # fmt: skip
    running = Service(make_app, auth="keys", api_keys_file=str(keys))
    acme = {"Authorization": "Bearer acme-key-0123456789ab"}
    zeta = {"X-Api-Key": "zeta-key-0123456789ab"}
    try:
        assert running.submit(make_pdf(WORD_EN)).status_code == 401
        job = running.submit(make_pdf(WORD_EN), headers=acme).get_json()
        assert running.client.get(f"/v1/jobs/{job['id']}").status_code == 401
        other = running.client.get(f"/v1/jobs/{job['id']}", headers=zeta)
        assert other.status_code == 404 and other.get_json()["error"]["code"] == "not_found"
        assert running.client.delete(f"/v1/jobs/{job['id']}", headers=zeta).status_code == 404
        assert running.wait(job["id"], acme)["status"] == "succeeded"
    finally:
        running.stop()


def test_cancelling_drops_the_pages_not_started(make_app: Callable[..., Any]) -> None:
    """One page at a time: cancelled once its first page is done, the job ends
    ``cancelled`` with the pages not started never computed (nor cached)."""
    running = Service(make_app, jobs_pages_in_flight=1)
    pages = sorted(CORPUS.glob("paddleocr_doc_*.jpg"))[:6]
    try:
        job = running.submit(make_pdf(*pages)).get_json()

        def now() -> Any:
            return running.client.get(f"/v1/jobs/{job['id']}").get_json()

        wait_for(lambda: now()["progress"]["pages_done"] >= 1, 120, "the first page done",
                 lambda: str(now()))  # fmt: skip
        cancelled = running.client.delete(f"/v1/jobs/{job['id']}")
        assert cancelled.status_code == 200 and cancelled.get_json()["status"] == "cancelled"
        # Time for a page wrongly started after the cancel to show, and for the page that was
        # running then to end (it may take longer than that on a loaded host).
        time.sleep(3)
        runner = running.shared.cache._computer.runner
        wait_for(lambda: runner.running == 0 and runner.waiting == 0, 120, "the engine idle")
        final = running.client.get(f"/v1/jobs/{job['id']}").get_json()
        assert final["status"] == "cancelled"
        assert final["progress"]["pages_done"] <= 2  # the first, and at most the one running
        again = running.client.delete(f"/v1/jobs/{job['id']}")
        assert again.status_code == 409
    finally:
        running.stop()


@pytest.mark.parametrize(
    ("document", "form", "code"),
    [
        (b"\x00garbage bytes, not a document", {}, "invalid_document"),
        (b"%PDF-1.7\n%broken\n", {}, "invalid_document"),
        (encrypted_pdf(), {}, "invalid_document"),
        (PDF, {"pages": "2-9"}, "invalid_field"),
        (PDF, {"callback_url": "http://169.254.169.254/latest"}, "callback_not_allowed"),
    ],
    ids=["garbage", "broken-pdf", "encrypted-pdf", "pages-out-of-range", "callback-not-allowed"],
)
def test_bad_input_is_a_4xx_and_nothing_is_stored(
    service: Service, redis_client: Any, document: bytes, form: dict[str, str], code: str
) -> None:
    answer = service.submit(document, **form)
    assert answer.status_code == 400, answer.get_data(as_text=True)
    assert answer.get_json()["error"]["code"] == code
    stored = [k for k in redis_client.keys("*") if b":job:" in k or b":v1:" in k]
    assert not stored and not redis_client.exists("ocr:jobs:open:{~}")
    assert not redis_client.exists("ocr:jobs:queue") or not redis_client.xlen("ocr:jobs:queue")


def test_limits_pages_and_open_jobs(make_app: Callable[..., Any], redis_client: Any) -> None:
    running = Service(make_app, jobs_max_pages=2, jobs_max_open_per_tenant=1, jobs_drivers=0)
    try:
        over = running.submit()
        assert over.status_code == 400 and over.get_json()["error"]["code"] == "too_many_pages"
        first = running.submit(make_pdf(WORD_EN))
        assert first.status_code == 202
        full = running.submit(make_pdf(WORD_EN))  # no driver: the first is still open
        assert full.status_code == 429 and full.headers["Retry-After"]
        assert running.client.get("/v1/jobs/nope").status_code == 404
        # The first job's record evicted (what allkeys-lru may do): its place is given back
        # once it is older than a submission could still be storing its job.
        job_id = first.get_json()["id"]
        redis_client.delete(f"ocr:job:{{{job_id}}}")
        assert running.submit(make_pdf(WORD_EN)).status_code == 429  # too young to tell
        settled_ms = (SETTLE_SECONDS + 1) * 1000
        redis_client.zincrby("ocr:jobs:open:{~}", -settled_ms, job_id)  # taken a minute ago
        assert running.submit(make_pdf(WORD_EN)).status_code == 202
    finally:
        running.stop()


def test_concurrent_submissions_never_pass_the_open_jobs_limit(
    make_app: Callable[..., Any],
) -> None:
    """Six submissions at once against a limit of two: exactly two are taken (the count and
    the place are one step in Redis; a count read before storing let all six in)."""
    running = Service(make_app, jobs_max_open_per_tenant=2, jobs_drivers=0)
    together = threading.Barrier(6)
    document = make_pdf(WORD_EN)

    def submit(_: int) -> int:
        together.wait()
        return int(running.submit(document).status_code)

    try:
        with ThreadPoolExecutor(6) as pool:
            codes = sorted(pool.map(submit, range(6)))
    finally:
        running.stop()
    assert codes == [202, 202, 429, 429, 429, 429]


def test_a_job_its_drivers_died_on_three_times_fails_saying_so(
    make_app: Callable[..., Any], redis_client: Any
) -> None:
    """A document that kills whichever engine drives it must not go round the fleet for
    ever: taken a fourth time, the job fails with the reason, computing nothing more."""
    running = Service(make_app, jobs_drivers=0)
    job = running.submit(make_pdf(WORD_EN)).get_json()
    store = running.shared.jobs
    store.ensure_group()
    # Three drivers took it in turn and died on it (each one silent from then on).
    [[_, [(entry, _)]]] = redis_client.xreadgroup(GROUP, "dead-1", {store.stream: ">"}, count=1)
    for dead in ("dead-2", "dead-3"):
        redis_client.xclaim(store.stream, GROUP, dead, 0, [entry])
    settings = running.shared.settings.with_overrides(jobs_drivers=1, jobs_claim_idle_seconds=2)
    running.driver = job_driver.start(settings, store, running.shared.cache)
    try:
        final = running.wait(job["id"], timeout=60)
    finally:
        running.stop()
    assert final["status"] == "failed", final
    assert "stopped 3 times" in final["error"]["message"] and not final["pages"]
    assert not redis_client.xpending(store.stream, GROUP)["pending"]  # acknowledged


def test_a_job_whose_document_was_evicted_fails_saying_so(
    make_app: Callable[..., Any], redis_client: Any
) -> None:
    """Under ``allkeys-lru`` a job's document may go before a driver reads it: the job ends
    ``failed`` with the reason, never a hang; a job whose record went answers 404."""
    running = Service(make_app, jobs_drivers=0)  # nothing takes it yet
    job = running.submit(make_pdf(WORD_EN)).get_json()
    running.stop()
    [document] = [k for k in redis_client.keys("*") if k.endswith(b":doc")]
    redis_client.delete(document)  # what the LRU would do
    settings = running.shared.settings.with_overrides(jobs_drivers=1)
    running.driver = job_driver.start(settings, running.shared.jobs, running.shared.cache)
    try:
        final = running.wait(job["id"], timeout=60)
    finally:
        running.stop()
    assert final["status"] == "failed" and "evicted" in final["error"]["message"]
    [record] = [k for k in redis_client.keys("*") if k.endswith(b"}") and b":job:" in k]
    redis_client.delete(record)
    assert running.client.get(f"/v1/jobs/{job['id']}").status_code == 404
