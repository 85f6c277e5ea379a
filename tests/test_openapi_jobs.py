"""Schemathesis against the document-job operations of the app's own OpenAPI document:
``POST /v1/jobs`` and ``GET /v1/jobs/{job_id}`` generated (examples, coverage, a small
deterministic fuzzing phase), on an app with no job driver (``JOBS_DRIVERS=0``: a job
accepted stays queued). No 5xx; every answer matches the documented statuses, content types,
headers and schemas; data that breaks the schema is refused. Then one explicit request per
documented job operation, REST and PaddleOCR's, so that the success shapes (202 and its
``Location``, a queued job, a cancel, a 409, PaddleOCR's envelopes) are checked too."""

from __future__ import annotations

import io
import json
from collections import Counter
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from PIL import Image
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from app.routes.ops import OPENAPI
from tests.conftest import WORD_EN

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_EXAMPLES = 30  # fuzzing phase, per operation; examples and coverage cases come on top
CONFORMANCE = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
CHECKS = [*CONFORMANCE, negative_data_rejection, unsupported_method]
CASES: Counter[tuple[str, str, int]] = Counter()  # (operation, mode, status)

schema = schemathesis.openapi.from_dict(
    json.loads(OPENAPI),
    config=schemathesis.Config.from_dict(
        {"generation": {"database": "none", "deterministic": True}, "seed": 7}
    ),
).include(operation_id=["submitJob", "getJob"])


def pdf_bytes() -> bytes:
    buf = io.BytesIO()
    Image.open(WORD_EN).convert("RGB").save(buf, "PDF")
    return buf.getvalue()


@pytest.fixture()
def jobs_app(make_app: Any) -> Any:
    return make_app(jobs_drivers=0)


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_generated_job_requests_conform(case: Any, jobs_app: Any) -> None:
    response = case.call(app=jobs_app)
    meta = case.meta
    mode = meta.generation.mode.value if meta is not None else "positive"
    CASES[(case.operation.label, mode, response.status_code)] += 1
    case.validate_response(response, checks=CHECKS, transport_kwargs={"app": jobs_app})


def test_every_job_operation_answers_as_documented(make_app: Any) -> None:
    """One request per documented job operation, the success shapes included; each answer
    checked against the document."""
    app = make_app(jobs_drivers=0)
    document = schemathesis.openapi.from_dict(json.loads(OPENAPI))
    pdf = pdf_bytes()

    def call(path: str, method: str, status: int, **kwargs: Any) -> Any:
        case = document[path][method].Case(**kwargs)
        response = case.call(app=app)
        assert response.status_code == status, (method, path, response.text[:300])
        case.validate_response(response, checks=CONFORMANCE, transport_kwargs={"app": app})
        return response

    multipart = "multipart/form-data"
    submitted = call("/v1/jobs", "POST", 202, body={"file": pdf}, media_type=multipart)
    job = submitted.json()
    assert submitted.headers["location"] == [f"/v1/jobs/{job['id']}"]  # lowercased, listed
    assert job["status"] == "queued" and job["started_at"] is None and job["pages"] == []
    ids = {"job_id": job["id"]}
    polled = call("/v1/jobs/{job_id}", "GET", 200, path_parameters=ids).json()
    assert polled["progress"] == {"pages_done": 0, "pages_failed": 0, "pages_total": 1}
    page = {**ids, "number": 1}
    call("/v1/jobs/{job_id}/pages/{number}", "GET", 404, path_parameters=page)
    cancelled = call("/v1/jobs/{job_id}", "DELETE", 200, path_parameters=ids).json()
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"] is not None
    assert call("/v1/jobs/{job_id}", "DELETE", 409, path_parameters=ids).json()["error"] == {
        "code": "job_ended",
        "message": f"job {job['id']} has ended (cancelled)",
    }
    call("/v1/jobs/{job_id}", "GET", 404, path_parameters={"job_id": "job_" + "A" * 22})
    refused = call("/v1/jobs", "POST", 400, body={"file": pdf, "pages": "2"}, media_type=multipart)
    assert refused.json()["error"]["code"] == "invalid_field"
    empty = call("/v1/jobs", "POST", 400, body={"url": ""}, media_type="application/json")
    assert empty.json()["error"]["code"] == "missing_field"

    from app.routes.jobs import engine_model

    model = engine_model(app.extensions["ocr"].engine_description)
    form = {"file": pdf, "model": model, "batchId": "b1", "optionalPayload": "{}"}
    paddle = call("/api/v2/ocr/jobs", "POST", 200, body=form, media_type=multipart).json()
    assert paddle["code"] == 0 and paddle["msg"] == "success"
    paddle_ids = {"job_id": paddle["data"]["jobId"]}
    state = call("/api/v2/ocr/jobs/{job_id}", "GET", 200, path_parameters=paddle_ids).json()
    assert state["data"]["state"] == "pending" and "resultUrl" not in state["data"]
    batch = call(
        "/api/v2/ocr/jobs/batch/{batch}", "GET", 200, path_parameters={"batch": "b1"}
    ).json()
    assert [item["jobId"] for item in batch["data"]["extractResult"]] == [paddle_ids["job_id"]]
    call("/api/v2/ocr/jobs/batch/{batch}", "GET", 404, path_parameters={"batch": "none"})
    parsing = {**form, "model": "PP-StructureV3"}
    refused = call("/api/v2/ocr/jobs", "POST", 400, body=parsing, media_type=multipart).json()
    assert refused["code"] == 400 and "parses documents" in refused["msg"]
    call(
        "/api/v2/ocr/jobs/{job_id}/result.jsonl",
        "GET",
        404,
        path_parameters=paddle_ids,
        query={"token": "not-the-token"},
    )


def test_cases_were_run() -> None:
    """Report generated cases per operation, mode and status (visible with ``-s``)."""
    if not CASES:
        pytest.skip("run with test_generated_job_requests_conform to count its cases")
    for (operation, mode, status), n in sorted(CASES.items()):
        print(f"schemathesis: {operation:22s} {mode:9s} HTTP {status}: {n}")
    assert not [key for key in CASES if key[2] >= 500]
    assert {operation for operation, _, _ in CASES} == {"POST /v1/jobs", "GET /v1/jobs/{job_id}"}
