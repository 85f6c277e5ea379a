"""Document jobs over HTTP, in two forms of one job: ``/v1/jobs`` (the REST API's) and
``/api/v2/ocr/jobs`` (PaddleOCR's job API, as its stock ``PaddleOCRClient`` and CLI speak it).

A front checks and stores the submission (the document, at most ``JOBS_MAX_BYTES``; a PDF
pdfium can open, at most ``JOBS_MAX_PAGES`` pages; the callback URL) and answers 202 with
the job; the engine processes drive it (``app/engine_side/job_driver.py``) and any front answers its
polls from Redis (``app/jobs/store.py``). With ``AUTH=keys`` a job is its tenant's: another
tenant's id is 404. The PaddleOCR result URL carries a secret of its own (the stock client
fetches it without credentials): unguessable, and gone with the job.
"""

from __future__ import annotations

import hmac
import io
import re
from datetime import UTC, datetime
from typing import Any, BinaryIO

import orjson
from flask import Blueprint, Response, g, request

from app import pdf
from app.imaging import InvalidImage, decode_image
from app.jobs import callback
from app.jobs.store import Job, JobsUnavailable, new_id
from app.protocols import fetch, paddlex, rest, trust
from app.protocols.b64 import decode_base64
from app.protocols.errors import BadRequest, lookup
from app.routes import common
from app.service import OcrService, current
from app.vocabulary import ClientError, OcrCacheError, OcrParams, OcrResult

blueprint = Blueprint("jobs", __name__)

# Models the PaddleOCR job API names that parse documents rather than read lines.
PARSING_MODELS = ("PP-StructureV3", "PaddleOCR-VL")
_RANGE = re.compile(r"\s*(\d{1,7})\s*(?:-\s*(\d{1,7})\s*)?")
PADDLEOCR_STATE = {
    "queued": "pending",
    "running": "running",
    "succeeded": "done",
    "failed": "failed",
    "cancelled": "failed",
}


class TooManyJobs(ClientError):
    code = "too_many_jobs"


class NotFound(ClientError):
    code = "not_found"


class DocumentTooLarge(ClientError):
    code = "too_large"


# The jobs' own error classes beside the REST table (``lookup``: the nearest class wins).
ERRORS: dict[type[OcrCacheError], int] = {
    **rest.ERRORS,
    TooManyJobs: 429,
    NotFound: 404,
    DocumentTooLarge: 413,
    JobsUnavailable: 503,
}


def status(exc: OcrCacheError) -> int:
    return lookup(ERRORS, exc) or 500


# Submission ---------------------------------------------------------------------------


def _submission(service: OcrService, paddle_api: bool) -> tuple[BinaryIO, dict[str, Any]]:
    """The document, as a file, and the submission's fields. A multipart upload (up to
    ``JOBS_MAX_BYTES``) stays in the temporary file werkzeug spooled it to: the front reads
    it only as far as pdfium needs to count its pages, then copies it to Redis a chunk at a
    time, so a large document never sits in a front's memory. A JSON body (the document in
    base64) or a URL is held in memory: at most ``MAX_REQUEST_BYTES``, as ``/ocr`` takes."""
    settings = service.settings
    if request.mimetype == "multipart/form-data":
        request.max_content_length = settings.jobs.upload_limit()
        fields: dict[str, Any] = dict(request.form.items())
        upload = request.files.get("file")
        if upload is None:
            raise BadRequest("multipart upload needs a 'file' field", "missing_field")
        stream: BinaryIO = upload.stream  # type: ignore[assignment]
        size = stream.seek(0, io.SEEK_END)
        stream.seek(0)
        if size > settings.jobs.max_bytes:
            raise DocumentTooLarge(
                f"the document is over JOBS_MAX_BYTES ({settings.jobs.max_bytes})"
            )
    else:
        try:
            fields = orjson.loads(request.get_data())
        except orjson.JSONDecodeError:
            raise BadRequest("body must be JSON or multipart/form-data", "invalid_json") from None
        if not isinstance(fields, dict):
            raise BadRequest("body must be a JSON object", "invalid_json")
        url = fields.get("fileUrl" if paddle_api else "url")
        if isinstance(url, str) and url:
            data = fetch.fetch(
                url, settings.protocols.url_hosts(), settings.server.max_request_bytes,
                settings.protocols.url_input_timeout_seconds,
            )  # fmt: skip
        elif isinstance(fields.get("file"), str):
            data = decode_base64(fields["file"])
        else:
            name = "fileUrl" if paddle_api else "url"
            raise BadRequest(f"the body needs 'file' (base64) or '{name}'", "missing_field")
        stream, size = io.BytesIO(data), len(data)
    if not size:
        raise BadRequest("the document is empty", "empty_document")
    return stream, fields


def _pages(service: OcrService, document: BinaryIO, ranges: Any) -> tuple[str, tuple[int, ...]]:
    """(kind, the page indexes to read): a PDF pdfium can open, or an image."""
    max_pages = service.settings.jobs.max_pages
    head = document.read(len(pdf.PDF_MAGIC))
    document.seek(0)
    if head == pdf.PDF_MAGIC:
        try:
            count = pdf.page_count(document)
        except InvalidImage as exc:
            raise BadRequest(f"the PDF cannot be read: {exc}", "invalid_document") from None
        pages = _ranges(ranges, count, max_pages)
        if len(pages) > max_pages:
            raise BadRequest(
                f"more pages to read than JOBS_MAX_PAGES ({max_pages}) allows a job",
                "too_many_pages",
            )
        return "pdf", pages
    limit = service.settings.server.max_request_bytes
    data = document.read(limit + 1)
    document.seek(0)
    if len(data) > limit:
        raise DocumentTooLarge(f"an image is at most MAX_REQUEST_BYTES ({limit}); a PDF more")
    try:
        decode_image(data, service.settings.server.max_image_pixels)
    except InvalidImage as exc:
        raise BadRequest(f"neither a PDF nor an image: {exc}", "invalid_document") from None
    return "image", _ranges(ranges, 1, max_pages)


def _ranges(raw: Any, count: int, most: int) -> tuple[int, ...]:
    """``"1-3,5"`` (1-based, PaddleOCR's ``pageRanges``) as 0-based indexes, each once, in the
    order given; none: all. More than ``most`` pages is refused before any list is built."""
    if raw is None or raw == "":
        return tuple(range(min(count, most + 1)))
    if not isinstance(raw, str) or len(raw) > 4096:
        raise BadRequest("page ranges must be a string such as '1-3,5'", "invalid_field")
    spans = []
    for part in raw.split(","):
        match = _RANGE.fullmatch(part)
        if not match:
            raise BadRequest(f"page range {part.strip()!r}: expected 'n' or 'a-b'", "invalid_field")
        first, last = int(match[1]), int(match[2] or match[1])
        if not 1 <= first <= last <= count:
            raise BadRequest(
                f"page range {part.strip()!r} is outside the document's 1-{count}", "invalid_field"
            )
        spans.append((first, last))
    if sum(last - first + 1 for first, last in spans) > most:
        return tuple(range(most + 1))  # over the limit whatever repeats: refused by the caller
    chosen: dict[int, None] = {}
    for first, last in spans:
        chosen.update(dict.fromkeys(range(first - 1, last)))
    return tuple(chosen)


def _submit(
    service: OcrService,
    document: BinaryIO,
    fields: dict[str, Any],
    params: OcrParams,
    options: dict[str, Any],
    model: str = "",
) -> Job:
    store = service.jobs
    if store is None:
        raise JobsUnavailable("they need Redis (REDIS_URL) and JOBS_ENABLED")
    settings = service.settings.jobs
    kind, pages = _pages(service, document, fields.get("pageRanges", fields.get("pages")))
    callback_url = fields.get("callback_url") or ""
    if callback_url:
        if not isinstance(callback_url, str):
            raise BadRequest("callback_url must be a string", "invalid_field")
        callback.check_url(callback_url, settings.callback_hosts())
        if not settings.callback_secret:
            raise BadRequest(
                "callbacks are off: JOBS_CALLBACK_SECRET is unset", "callback_not_allowed"
            )
    batch = fields.get("batchId") or ""
    if not isinstance(batch, str) or len(batch) > 128:
        raise BadRequest("batchId must be a string of at most 128 characters", "invalid_field")
    job = Job(
        id=new_id(), tenant=common.controls(g.call).namespace, kind=kind, pages=pages,
        params=params.to_dict(), options=options, callback_url=callback_url, batch=batch,
        model=model,
    )  # fmt: skip
    if not store.reserve(job, settings.max_open_per_tenant):
        raise TooManyJobs(
            f"{settings.max_open_per_tenant} jobs of this tenant are not yet ended "
            "(JOBS_MAX_OPEN_PER_TENANT); retry once one has"
        )
    return store.create(job, document)


def _admit(service: OcrService) -> None:
    call = g.call
    call.tenant = service.admission.admit(call.headers, call.address, call.trusted)


def _job(service: OcrService, job_id: str) -> Job:
    """The caller's job, else ``NotFound`` (another tenant's is not found either)."""
    store = service.jobs
    job = store.get(job_id) if store is not None else None
    if job is None or job.tenant != common.controls(g.call).namespace:
        raise NotFound(f"no job {job_id!r}")
    return job


# The REST form ------------------------------------------------------------------------


@blueprint.post("/v1/jobs")
def rest_submit() -> Response:
    service = current()
    try:
        _admit(service)
        document, fields = _submission(service, paddle_api=False)
        min_score = rest.parse_min_score(fields.get("min_score"), service.min_score)
        job = _submit(service, document, fields, service.default_params, {"min_score": min_score})
    except OcrCacheError as exc:
        return _rest_error(exc)
    response = _json(_rest_job(service, job, []), 202)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return response


@blueprint.get("/v1/jobs/<job_id>")
def rest_status(job_id: str) -> Response:
    service = current()
    try:
        _admit(service)
        job = _job(service, job_id)
        pages = list(service.jobs.pages(job.id).values()) if service.jobs else []
    except OcrCacheError as exc:
        return _rest_error(exc)
    return _json(_rest_job(service, job, pages))


@blueprint.get("/v1/jobs/<job_id>/pages/<int:number>")
def rest_page(job_id: str, number: int) -> Response:
    """One page by its number in the document (with ``pages`` chosen, a page the job reads)."""
    service = current()
    try:
        _admit(service)
        job = _job(service, job_id)
        if number - 1 not in job.pages:
            raise NotFound(f"job {job_id} does not read page {number} of its document")
        position = job.pages.index(number - 1) + 1  # pages are kept in the job's order
        found = service.jobs.pages(job.id, [position]) if service.jobs else {}
        if position not in found:
            raise NotFound(f"page {number} of job {job_id} is not done yet ({job.status})")
    except OcrCacheError as exc:
        return _rest_error(exc)
    return _json(_rest_page(service, job, found[position]))


@blueprint.delete("/v1/jobs/<job_id>")
def rest_cancel(job_id: str) -> Response:
    service = current()
    try:
        _admit(service)
        job = _job(service, job_id)  # a job exists only where jobs are stored
        store = service.jobs
        assert store is not None
        now = job.status if job.ended else store.cancel(job)
        if now != "cancelled" or job.ended:
            return _rest_error_body(409, "job_ended", f"job {job_id} has ended ({now})")
        job = store.get(job.id) or job  # its record now
    except OcrCacheError as exc:
        return _rest_error(exc)
    return _json(_rest_job(service, job, []))


def _rest_job(service: OcrService, job: Job, pages: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": job.id,
        "status": job.status,
        "progress": {"pages_done": job.done, "pages_failed": job.failed, "pages_total": job.total},
        "created_at": _time(job.created),
        "started_at": _time(job.started),
        "finished_at": _time(job.finished),
    }
    if job.error:
        body["error"] = {"code": "job_failed", "message": job.error}
    body["pages"] = [_rest_page(service, job, page) for page in pages]
    return body


def _rest_page(service: OcrService, job: Job, page: dict[str, Any]) -> dict[str, Any]:
    """One finished page as ``/v1/ocr`` answers an image (its lines over ``min_score``)."""
    if "error" in page:
        return {"page": page["page"], "error": page["error"]}
    result = OcrResult.from_dict(page["result"])
    min_score = float(job.options.get("min_score", service.min_score))
    body: dict[str, Any] = {
        "page": page["page"],
        "width": result.width,
        "height": result.height,
        "lines": [line.to_dict() for line in result.lines if line.score >= min_score],
    }
    if trust.shows_cache_status(g.call.trusted, service.settings.controls):
        body["cache"] = page["cache"]
        if page.get("cache_tier"):
            body["cache_tier"] = page["cache_tier"]
    return body


def _rest_error(exc: OcrCacheError) -> Response:
    response = _rest_error_body(status(exc), exc.code, str(exc))
    _error_headers(response, exc)
    return response


def _rest_error_body(code: int, name: str, message: str) -> Response:
    return Response(rest.error_body(name, message), status=code, mimetype=common.JSON)


# PaddleOCR's job API ------------------------------------------------------------------


@blueprint.post("/api/v2/ocr/jobs")
def paddle_submit() -> Response:
    service = current()
    try:
        _admit(service)
        document, fields = _submission(service, paddle_api=True)
        model = _model(service, fields.get("model"))
        req = _paddlex_options(service, fields.get("optionalPayload"))
        options = {"rec_score_thresh": req.rec_score_thresh}
        job = _submit(service, document, fields, req.params, options, model)
    except OcrCacheError as exc:
        return _paddle_error(exc)
    return _json({"code": 0, "msg": "success", "data": {"jobId": job.id}})


@blueprint.get("/api/v2/ocr/jobs/<job_id>")
def paddle_status(job_id: str) -> Response:
    service = current()
    try:
        _admit(service)
        job = _job(service, job_id)
    except OcrCacheError as exc:
        return _paddle_error(exc)
    return _json({"code": 0, "msg": "success", "data": _paddle_job(job)})


@blueprint.get("/api/v2/ocr/jobs/batch/<batch>")
def paddle_batch(batch: str) -> Response:
    service = current()
    try:
        _admit(service)
        if service.jobs is None:
            raise JobsUnavailable("they need Redis (REDIS_URL) and JOBS_ENABLED")
        jobs = service.jobs.batch(common.controls(g.call).namespace, batch)
        if not jobs:
            raise NotFound(f"no batch {batch!r}")
    except OcrCacheError as exc:
        return _paddle_error(exc)
    data = {"batchId": batch, "extractResult": [_paddle_job(job) for job in jobs]}
    return _json({"code": 0, "msg": "success", "data": data})


@blueprint.get("/api/v2/ocr/jobs/<job_id>/result.jsonl")
def paddle_result(job_id: str) -> Response:
    """The finished job as JSON Lines, one line a page in the PaddleX ``/ocr`` form; the
    URL's ``token`` is the credential (the stock client sends none here)."""
    service = current()
    try:
        store = service.jobs
        job = store.get(job_id) if store is not None else None
        given = request.args.get("token", "")
        if (
            job is None
            or not job.result_token
            or not hmac.compare_digest(given.encode(), job.result_token.encode())
        ):
            raise NotFound(f"no result for job {job_id!r}")
        if job.status != "succeeded":
            raise NotFound(f"job {job_id} has no result ({job.status})")
        pages = store.pages(job.id) if store is not None else {}
    except OcrCacheError as exc:
        return _paddle_error(exc)
    params = OcrParams.from_dict(job.params)
    thresh = float(job.options.get("rec_score_thresh", 0.0))
    results = [OcrResult.from_dict(page["result"]) for page in pages.values()]
    sizes = [{"width": r.width, "height": r.height} for r in results]
    info = (
        {"numPages": len(sizes), "pages": sizes, "type": "pdf"}
        if job.kind == "pdf"
        else {**sizes[0], "type": "image"}
    )
    lines = [
        orjson.dumps(
            {
                "result": {
                    "ocrResults": [{"prunedResult": paddlex.pruned_result(r, params, thresh)}],
                    "dataInfo": info,
                }
            }  # fmt: skip
        )
        for r in results
    ]
    return Response(b"\n".join(lines) + b"\n", mimetype="application/jsonl")


def _paddle_job(job: Job) -> dict[str, Any]:
    data: dict[str, Any] = {
        "jobId": job.id,
        "state": PADDLEOCR_STATE[job.status],
        "extractProgress": {
            "totalPages": job.total,
            "extractedPages": job.done,
            "startTime": _time(job.started),
            "endTime": _time(job.finished),
        },
    }
    if job.status == "succeeded":
        url = f"{_base_url()}/api/v2/ocr/jobs/{job.id}/result.jsonl?token={job.result_token}"
        data["resultUrl"] = {"jsonUrl": url}
    elif job.ended:
        data["errorMsg"] = job.error or "the job was cancelled"
    return data


def _base_url() -> str:
    """This service as the client reached it (the edge passes the scheme it was called by)."""
    via_edge = g.call.via_edge
    scheme = (
        request.headers.get("X-Forwarded-Proto", request.scheme) if via_edge else request.scheme
    )
    return f"{scheme}://{request.host}"


def _model(service: OcrService, raw: Any) -> str:
    served = service.settings.jobs.models(engine_model(service.engine_description))
    if not isinstance(raw, str) or not raw:
        raise BadRequest(f"'model' is required; this service answers for {', '.join(served)}")
    if raw.startswith(PARSING_MODELS):
        raise BadRequest(
            f"{raw} parses documents, which this service does not; it answers for "
            f"{', '.join(served)} (JOBS_API_MODELS)"
        )
    if raw not in served:
        raise BadRequest(
            f"model {raw!r} is not served here; this service answers for {', '.join(served)}"
        )
    return raw


def engine_model(description: dict[str, Any]) -> str:
    """The model family the engine runs, as PaddleOCR names it (``PP-OCRv5`` for
    ``PP-OCRv5_server_rec``); the engine's kind when it names none."""
    for name in description.get("models", {}):
        if str(name).endswith("_rec"):
            return str(name).split("_", 1)[0]
    return str(description.get("model") or description.get("kind", ""))


def _paddlex_options(service: OcrService, raw: Any) -> paddlex.InferRequest:
    """``optionalPayload`` (a JSON object, or its text in a form) read as PaddleX's ``/ocr``
    reads its fields."""
    if raw is None or raw == "":
        raw = {}
    if isinstance(raw, str):
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise BadRequest("optionalPayload must be a JSON object") from None
    if not isinstance(raw, dict):
        raise BadRequest("optionalPayload must be a JSON object")
    body = orjson.dumps({**raw, "file": "-", "fileType": 0})
    return paddlex.parse(
        body, service.default_params, service.settings.protocols.paddlex_rec_score_thresh
    )


def _paddle_error(exc: OcrCacheError) -> Response:
    """PaddleOCR's error form, ``{"code", "msg"}``, with the HTTP status its client maps."""
    code, message = status(exc), str(exc)
    if isinstance(exc, BadRequest) and message.startswith("[{"):
        message = f"optionalPayload: {message}"
    response = Response(
        orjson.dumps({"code": code, "msg": message}), status=code, mimetype=common.JSON
    )
    _error_headers(response, exc)
    return response


def _error_headers(response: Response, exc: OcrCacheError) -> None:
    """``Retry-After`` and ``WWW-Authenticate`` as every protocol answers them."""
    for name, value in common.error(b"", response.status_code, exc).headers:
        if name != "Content-Type":
            response.headers[name] = value
    if isinstance(exc, TooManyJobs):
        response.headers["Retry-After"] = "10"


def _json(body: dict[str, Any], code: int = 200) -> Response:
    return Response(orjson.dumps(body), status=code, mimetype=common.JSON)


def _time(seconds: float) -> str | None:
    if not seconds:
        return None
    return (
        datetime.fromtimestamp(seconds, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )
