"""``POST /{name}/{method}``, Paddle Serving's pipeline over HTTP (app/protocols/pipeline_http.py):
parse -> the shared pipeline call (``pipeline.answer``, as gRPC) -> render. Errors are HTTP 200
with ``err_no`` (``pipeline``'s tables) except the gateway's own 400, overload's 503 and a
tenant's 401/429 (``err_no`` 10000, as the edge's own 429)."""

from __future__ import annotations

import logging

from app.protocols import pipeline, pipeline_http
from app.protocols.errors import BadRequest
from app.routes import common
from app.routes.common import JSON, Answer, Call
from app.service import OcrService
from app.vocabulary import EngineBusy, Refused

log = logging.getLogger("app.web")  # the name its log lines have always carried


def handle(service: OcrService, call: Call) -> Answer:
    settings = service.settings
    _, name, method = call.request.path.split("/", 2)
    if name != settings.protocols.pipeline_service_name:
        answer = pipeline.service_name_error()
    else:
        try:
            req = pipeline_http.parse(call.request.get_data())
            cache_controls = common.controls(call)
        except pipeline_http.GatewayError as exc:
            common.observe(call, "pipeline_http", 400, "none")
            return common.error(pipeline_http.gateway_error(str(exc)), 400, exc)
        except (pipeline.PipelineError, BadRequest) as exc:
            answer = pipeline.refused(exc)
        else:
            log.debug("pipeline %s/%s logid=%s", name, method, req.logid)
            try:
                answer = pipeline.answer(
                    service.cache, req, service.min_score,
                    settings.protocols.max_images_per_request, cache_controls,
                )  # fmt: skip
            except (EngineBusy, Refused) as exc:
                status = exc.status if isinstance(exc, Refused) else 503
                common.observe(call, "pipeline_http", status, "none")
                return common.error(refusal(str(exc)), status, exc)
    common.observe(call, "pipeline_http", 200, answer.cache_status)
    headers = [("Content-Type", JSON)]
    if answer.err_no == 0:
        headers.extend(common.cache_headers(answer.cache_status, answer.cache_tier))
    return Answer(200, pipeline_http.render(answer), headers)


def refusal(message: str) -> bytes:
    """The body of an answer the transport gives (503, 401, 429): ``err_no`` 10000."""
    return pipeline_http.render(
        pipeline.PipelineAnswer(err_no=pipeline.UNKNOWN_ERROR, err_msg=message)
    )
