"""``POST /v1/ocr`` (app/protocols/rest.py): parse -> cache (with extraction subset reuse)
-> render; errors answered from ``rest.ERRORS``."""

from __future__ import annotations

from app.protocols import rest, trust
from app.protocols.errors import lookup
from app.routes import common
from app.routes.common import JSON, Answer, Call
from app.service import OcrService


def handle(service: OcrService, call: Call) -> Answer:
    settings = service.settings
    try:
        req = rest.parse(call.request, service.min_score)
        params = req.params(
            service.default_params, service.default_task, settings.hunyuan.target_language
        )
        outcome = service.cache.get_or_compute(req.data, params, common.controls(call))
    except rest.CAUGHT as exc:
        status = lookup(rest.ERRORS, exc) or 500
        common.observe(call, "rest", status, "none")
        return common.error(rest.error_body(exc.code, str(exc)), status, exc)
    common.observe(call, "rest", 200, outcome.status.value)
    body = rest.render(
        outcome,
        service.engine_description,
        req.min_score,
        params.task,
        show_cache=trust.shows_cache_status(call.trusted, settings.controls),
    )
    headers = [("Content-Type", JSON), *common.cache_headers(outcome.status.value, outcome.tier)]
    return Answer(200, body, [*headers, *outcome.details])
