"""``POST /v1/ocr`` (app/protocols/rest.py): parse -> cache (with extraction subset reuse)
-> render; errors answered from ``rest.ERRORS``."""

from __future__ import annotations

from flask import Blueprint, Response, g, request

from app.protocols import rest, trust
from app.protocols.errors import lookup
from app.routes import common
from app.service import current

blueprint = Blueprint("rest", __name__)


@blueprint.post("/v1/ocr")
def v1_ocr() -> Response:
    service = current()
    settings = service.settings
    try:
        req = rest.parse(request, service.min_score)
        params = req.params(
            service.default_params, service.default_task, settings.hunyuan_target_language
        )
        outcome = service.extractions.get_or_compute(req.data, params, common.controls(settings))
    except rest.CAUGHT as exc:
        status = lookup(rest.ERRORS, exc) or 500
        common.observe("rest", status, "none")
        return common.error(rest.error_body(exc.code, str(exc)), status, exc)
    common.observe("rest", 200, outcome.status.value)
    return Response(
        rest.render(
            outcome,
            service.engine_description,
            req.min_score,
            params.task,
            show_cache=trust.shows_cache_status(g.trusted, settings),
        ),  # fmt: skip
        mimetype=common.JSON,
        headers={
            **common.cache_headers(outcome.status.value, outcome.tier),
            **dict(outcome.details),
        },
    )
