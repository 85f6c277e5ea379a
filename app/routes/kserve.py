"""The Open Inference Protocol over HTTP/REST: ``POST /v2/models/{name}[/versions/{v}]/infer``
served in front of Flask (``app.routes.endpoints``, as the other protocols' hot paths: the
body ``app/protocols/kserve_http.py``, the models ``app/protocols/kserve_models.py``), the
rest (health, metadata, configuration, the repository index) as Flask routes, every error
Triton's ``{"error": "..."}``."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from app.protocols import kserve, kserve_http, kserve_models, trust
from app.protocols.kserve import V2Error
from app.routes import common
from app.routes.common import Answer, Call
from app.service import OcrService, current
from app.vocabulary import OcrCacheError

PROTOCOL = "kserve_http"


def handle(service: OcrService, call: Call) -> Answer:
    """``POST /v2/models/{name}[/versions/{version}]/infer``."""
    name, version = _model_path(call.request.path)
    try:
        model = kserve.find(name, version)
        body = kserve_http.decompressed(
            call.request.get_data(),
            call.headers.get("Content-Encoding"),
            service.settings.server.max_request_bytes,
        )
        most = model.max_elements(service.settings.protocols.max_images_per_request)
        parsed = kserve_http.parse(body, call.headers.get(kserve_http.HEADER_LENGTH), most)
        tensor = kserve.the_input(model, parsed.inputs)
        kserve.requested_outputs(model, list(parsed.outputs))
        show = trust.shows_cache_status(call.trusted, service.settings.controls)
        inferred = kserve_models.infer(service, model, tensor, lambda: common.controls(call), show)
    except V2Error as exc:
        return error(call, exc)
    except OcrCacheError as exc:  # a cache control header the client got wrong
        return error(call, kserve_models.protocol_error(exc))
    common.observe(call, PROTOCOL, 200, inferred.cache_status)
    body, headers = kserve_http.render(model, parsed, [inferred.output])
    if inferred.cache_status != "none":  # an ocr envelope with an error: no cache status
        headers += common.cache_headers(inferred.cache_status, inferred.tiers)
    return Answer(200, body, headers)


def error(call: Call, exc: V2Error) -> Answer:
    common.observe(call, PROTOCOL, exc.status, "none")
    headers = [("Content-Type", kserve_http.JSON)]
    if exc.retry_after:
        headers.append(("Retry-After", str(exc.retry_after)))
    if exc.status == 401:
        headers.append(("WWW-Authenticate", 'Bearer realm="ocr"'))
    return Answer(exc.status, exc.body(), headers)


def _model_path(path: str) -> tuple[str, str]:
    """(model, version) of ``/v2/models/{name}[/versions/{version}]/infer``."""
    parts = path.split("/")  # "", "v2", "models", name, ["versions", v,] "infer"
    if len(parts) == 7:
        return parts[3], parts[5]
    return parts[3], ""


def is_infer_path(path: str) -> bool:
    parts = path.split("/")
    return (
        path.startswith("/v2/models/")
        and parts[-1] == "infer"
        and (len(parts) == 5 or (len(parts) == 7 and parts[4] == "versions"))
        and bool(parts[3])
    )


# Health, metadata, configuration and the repository: Flask routes, in the protocol's form.
blueprint = Blueprint("kserve", __name__)


def _json(body: object, status: int = 200) -> Response:
    response = jsonify(body)
    response.status_code = status
    return response


@blueprint.errorhandler(V2Error)
def _v2_error(exc: V2Error) -> Response:
    return Response(exc.body(), status=exc.status, mimetype=kserve_http.JSON)


@blueprint.get("/v2")
def server_metadata() -> Response:
    return _json(kserve.server_metadata())


@blueprint.get("/v2/health/live")
def live() -> Response:
    return Response(status=200)


@blueprint.get("/v2/health/ready")
def ready() -> Response:
    return Response(status=200 if current().engine_state.status == "ready" else 400)


@blueprint.get("/v2/models/<model>")
@blueprint.get("/v2/models/<model>/versions/<version>")
def model_metadata(model: str, version: str = "") -> Response:
    found = kserve.find(model, version)
    return _json(found.metadata(current().cache.engine.fingerprint))


@blueprint.get("/v2/models/<model>/ready")
@blueprint.get("/v2/models/<model>/versions/<version>/ready")
def model_ready(model: str, version: str = "") -> Response:
    """As Triton: an unknown model or version is not ready (400), not an error."""
    try:
        kserve.find(model, version)
    except V2Error as exc:
        return Response(exc.body(), status=400, mimetype=kserve_http.JSON)
    if current().engine_state.status != "ready":
        body = kserve.error_body("Model version not ready")
        return Response(body, 400, mimetype=kserve_http.JSON)
    return Response(status=200)


@blueprint.get("/v2/models/<model>/config")
@blueprint.get("/v2/models/<model>/versions/<version>/config")
def model_config(model: str, version: str = "") -> Response:
    return _json(kserve.find(model, version).config(current().cache.engine.fingerprint))


@blueprint.post("/v2/repository/index")
def repository_index() -> Response:
    if request.get_data():
        try:
            body = request.get_json(force=True)
        except HTTPException:
            raise V2Error("the request JSON could not be parsed") from None
        if not isinstance(body, dict):
            raise V2Error("the request JSON must be an object")
    return _json(kserve.repository_index())
