"""The Flask application factory: HTTP routes over the cache front door."""

from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path
from typing import Any

from flask import Flask, Response, g, jsonify, request
from PIL import Image
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from app import admin, logsafe, metrics, stats, ui
from app.cache import near_dup
from app.cache.breaker import CircuitBreaker
from app.cache.engine_runner import EngineBusy
from app.cache.extraction_index import ExtractionIndex
from app.cache.region import OcrCache
from app.cache.store import RedisStore
from app.config import Settings
from app.engine_state import EngineState
from app.engines import build_engine
from app.engines.base import Engine
from app.engines.redacting import with_redaction
from app.imaging import DecodedImage, ImageTooLarge, InvalidImage, decode_image
from app.pdf import render_pages
from app.protocols import (
    controls,
    fetch,
    paddlex,
    paddlex_images,
    pipeline,
    pipeline_http,
    rest,
    trust,
)
from app.protocols.b64 import decode_base64
from app.protocols.errors import BadRequest
from app.vocabulary import (
    CacheControls,
    ClientError,
    EngineError,
    EngineTimeout,
    OcrResult,
    UnsupportedParams,
    tiers_of,
)

log = logging.getLogger(__name__)

JSON = "application/json"
PADDLEX_PATHS = ("/ocr", "/health")  # PaddleX basic serving's routes
OPENAPI = Path(__file__).with_name("openapi.json").read_bytes()  # served at /openapi.json
COUNTER_PATHS = frozenset({"/metrics", "/v1/stats"})  # hidden with the cache status


def build_cache(
    settings: Settings, engine: Engine, store: RedisStore | None
) -> tuple[OcrCache, EngineState]:
    """The cache front door and the engine's loader, shared by HTTP and gRPC."""
    if store is None and settings.cache_enabled and settings.redis_url:
        store = RedisStore(
            settings.redis_url,
            settings.redis_timeout_ms,
            settings.redis_connect_timeout_ms,
            CircuitBreaker(
                settings.redis_breaker_failures,
                settings.redis_breaker_cooldown_seconds,
                on_change=metrics.REDIS_BREAKER_OPEN.set,
            ),
            username=settings.redis_username,
            password=settings.redis_password,
            tls_ca_file=settings.redis_tls_ca_file,
            tls_cert_file=settings.redis_tls_cert_file,
            tls_key_file=settings.redis_tls_key_file,
        )
    if settings.cache_enabled and store is None:
        log.warning("REDIS_URL is not set: every request goes to the engine")
    if store is not None:
        _warn_if_not_evicting(store)

    def decode(data: bytes) -> DecodedImage:
        return decode_image(data, settings.max_image_pixels)

    engine.prepare()
    state = EngineState(
        engine,
        wait_seconds=float(settings.request_timeout_seconds),
        unready_after=settings.engine_unready_after_failures,
    )
    state.start()
    cache = OcrCache(
        settings, engine, store, decode, wait_for_engine=state.wait, on_engine_outcome=state.record
    )
    return cache, state


def create_app(
    settings: Settings | None = None,
    engine: Engine | None = None,
    store: RedisStore | None = None,
) -> Flask:
    """Build the app; ``engine``/``store`` may be passed in (tests share one loaded engine)."""
    settings = settings or Settings.from_env()
    logsafe.install()
    logging.getLogger("app").setLevel(settings.log_level)
    engine = with_redaction(
        engine or build_engine(settings), settings.cache_redact, settings.cache_redact_patterns_file
    )
    metrics.initialise(engine.kind)
    cache, state = build_cache(settings, engine, store)
    extractions = ExtractionIndex(cache, settings)
    engine_description = engine.describe()
    min_score = settings.ocr_rec_score_thresh

    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.extensions["ocr"] = {"cache": cache, "settings": settings, "engine_state": state}
    admin.register(app, settings.admin_token, cache, state)
    stats.register(app, cache)
    app.register_blueprint(ui.blueprint)

    @app.before_request
    def _start_timer() -> None:
        g.started = time.perf_counter()
        g.request_id = secrets.token_hex(8)
        address = trust.http_client_address(request.environ)
        g.trusted = trust.is_trusted(address, request.headers, settings)

    @app.before_request
    def _counters_need_trust() -> Any:
        """With the cache status hidden, the hit counters must be too: comparing them before
        and after one's own request would tell whether an image was seen before."""
        if request.path in COUNTER_PATHS and not trust.shows_cache_status(g.trusted, settings):
            message = "metrics are for trusted callers (CACHE_STATUS_VISIBLE=trusted)"
            return Response(rest.error_body("forbidden", message), status=403, mimetype=JSON)
        return None

    @app.after_request
    def _hide_cache_status(response: Response) -> Response:
        if not trust.shows_cache_status(g.get("trusted", False), settings):
            response.headers.pop("X-Cache", None)
            response.headers.pop(TIER_HEADER, None)
            for name in DETAIL_HEADERS:
                response.headers.pop(name, None)
        return response

    @app.before_request
    def _limit_streamed_body() -> None:
        # A chunked body (no Content-Length) is cut at MAX_CONTENT_LENGTH by werkzeug without
        # an error; reaching the limit means it went on (multipart parsing raises by itself).
        if (
            request.method == "POST"
            and request.content_length is None
            and request.mimetype != "multipart/form-data"
        ):
            if len(request.get_data(cache=True)) >= settings.max_request_bytes:
                raise RequestEntityTooLarge()

    def observe(protocol: str, status: int, cache_status: str) -> None:
        metrics.REQUESTS.labels(protocol=protocol, status=str(status)).inc()
        metrics.REQUEST_SECONDS.labels(protocol=protocol, cache=cache_status).observe(
            time.perf_counter() - g.started
        )

    @app.post("/v1/ocr")
    def v1_ocr() -> Any:
        try:
            req = rest.parse(request, min_score)
            params = req.params(
                engine.default_params, settings.default_task(), settings.hunyuan_target_language
            )
            outcome = extractions.get_or_compute(req.data, params, _controls(settings))
        except ClientError as exc:  # BadRequest, InvalidImage, UnsupportedParams
            observe("rest", 400, "none")
            return Response(rest.error_body(exc.code, str(exc)), status=400, mimetype=JSON)
        except EngineBusy as exc:
            observe("rest", 503, "none")
            body = rest.error_body("engine_busy", str(exc))
            return Response(body, status=503, mimetype=JSON, headers=_retry_after(exc))
        except EngineTimeout as exc:
            observe("rest", 504, "none")
            return Response(rest.error_body("engine_timeout", str(exc)), status=504, mimetype=JSON)
        except EngineError as exc:
            observe("rest", 503, "none")
            return Response(rest.error_body("engine_error", str(exc)), status=503, mimetype=JSON)
        observe("rest", 200, outcome.status.value)
        return Response(
            rest.render(
                outcome,
                engine_description,
                req.min_score,
                params.task,
                show_cache=trust.shows_cache_status(g.trusted, settings),
            ),  # fmt: skip
            mimetype=JSON,
            headers={**_cache_headers(outcome.status.value, outcome.tier), **dict(outcome.details)},
        )

    @app.post("/<name>/<method>")
    def pipeline_route(name: str, method: str) -> Response:
        if name != settings.pipeline_service_name:
            answer = pipeline.PipelineAnswer(
                err_no=pipeline.SERVICE_NAME_ERROR, err_msg=pipeline.SERVICE_NAME_MESSAGE
            )
        else:
            try:
                req = pipeline_http.parse(request.get_data())
                cache_controls = _controls(settings)
            except pipeline_http.GatewayError as exc:
                observe("pipeline_http", 400, "none")
                body = pipeline_http.gateway_error(str(exc))
                return Response(body, status=400, mimetype=JSON)
            except pipeline.PipelineError as exc:
                answer = pipeline.PipelineAnswer(err_no=exc.err_no, err_msg=str(exc))
            except BadRequest as exc:
                answer = pipeline.PipelineAnswer(
                    err_no=pipeline.INPUT_PARAMS_ERROR, err_msg=str(exc)
                )
            else:
                log.debug("pipeline %s/%s logid=%s", name, method, req.logid)
                try:
                    answer = pipeline.answer(
                        cache, req, min_score, settings.max_images_per_request, cache_controls
                    )
                except EngineBusy as exc:
                    observe("pipeline_http", 503, "none")
                    busy = pipeline.PipelineAnswer(err_no=pipeline.UNKNOWN_ERROR, err_msg=str(exc))
                    return Response(
                        pipeline_http.render(busy),
                        status=503,
                        mimetype=JSON,
                        headers=_retry_after(exc),
                    )
        observe("pipeline_http", 200, answer.cache_status)
        response = Response(pipeline_http.render(answer), mimetype=JSON)
        if answer.err_no == 0:
            response.headers.extend(_cache_headers(answer.cache_status, answer.cache_tier))
        return response

    @app.post("/ocr")
    def paddlex_ocr() -> Response:
        log_id = paddlex.new_log_id()
        try:
            req = paddlex.parse(
                request.get_data(), engine.default_params, settings.paddlex_rec_score_thresh
            )
            log_id = req.log_id
            images, is_pdf = _paddlex_images(req, settings)
            outcomes = cache.get_or_compute_many(images, req.params, _controls(settings))
            visualize = settings.paddlex_visualize if req.visualize is None else req.visualize
            pages = [
                _paddlex_page(data, outcome.result, req, visualize, settings)
                for data, outcome in zip(images, outcomes, strict=True)
            ]
        except ImageTooLarge as exc:  # upstream also says why
            observe("paddlex", 422, "none")
            return Response(paddlex.error(log_id, 422, str(exc)), status=422, mimetype=JSON)
        except InvalidImage as exc:  # upstream's words for any unreadable file
            log.info("paddlex logId=%s: invalid input file: %s", log_id, exc)
            observe("paddlex", 422, "none")
            body = paddlex.error(log_id, 422, paddlex.INVALID_FILE)
            return Response(body, status=422, mimetype=JSON)
        except (BadRequest, UnsupportedParams) as exc:
            observe("paddlex", 422, "none")
            return Response(paddlex.error(log_id, 422, str(exc)), status=422, mimetype=JSON)
        except EngineBusy as exc:
            observe("paddlex", 503, "none")
            body = paddlex.error(log_id, 503, str(exc))
            return Response(body, status=503, mimetype=JSON, headers=_retry_after(exc))
        except EngineError as exc:
            observe("paddlex", 500, "none")
            return Response(paddlex.error(log_id, 500, str(exc)), status=500, mimetype=JSON)
        sizes = [{"width": o.result.width, "height": o.result.height} for o in outcomes]
        data_info = (
            {"numPages": len(sizes), "pages": sizes, "type": "pdf"}
            if is_pdf
            else {**sizes[0], "type": "image"}
        )
        status = ",".join(sorted({o.status.value for o in outcomes}))
        observe("paddlex", 200, status)
        body = paddlex.success(log_id, {"ocrResults": pages, "dataInfo": data_info})
        return Response(body, mimetype=JSON, headers=_cache_headers(status, tiers_of(outcomes)))

    @app.get("/health")
    def paddlex_health() -> Response:
        body = {"logId": paddlex.new_log_id(), "errorCode": 0, "errorMsg": "Healthy"}
        return jsonify(body)

    @app.get("/healthz")
    def healthz() -> Any:
        return jsonify({"status": "alive"})

    @app.get("/readyz")
    def readyz() -> Any:
        status = state.status  # read once: the code and the body must agree
        body: dict[str, Any] = {"engine": status, "fingerprint": engine.fingerprint}
        if state.error:
            body["engine_error"] = state.error
        store_ = cache.store
        if not isinstance(store_, RedisStore):
            body["redis"] = {"state": "disabled"}
        else:
            body["redis"] = {
                "state": "up" if store_.ping() else "down",
                "breaker": store_.breaker_state,
            }
        return jsonify(body), (200 if status == "ready" else 503)

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        payload, content_type = metrics.render()
        return Response(payload, content_type=content_type)

    @app.get("/openapi.json")
    def openapi_document() -> Response:
        return Response(OPENAPI, mimetype=JSON)

    @app.errorhandler(RequestEntityTooLarge)
    def too_large(exc: RequestEntityTooLarge) -> Any:
        message = f"request body over {settings.max_request_bytes} bytes"
        if request.path == "/ocr":  # PaddleX clients read the envelope
            body = paddlex.error(paddlex.new_log_id(), 413, message)
            return Response(body, status=413, mimetype=JSON)
        return Response(rest.error_body("too_large", message), status=413, mimetype=JSON)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Any:
        code = exc.name.lower().replace(" ", "_")
        body = rest.error_body(code, exc.description or "")
        if request.path in PADDLEX_PATHS:  # upstream's envelope, as its clients read it
            body = paddlex.error(paddlex.new_log_id(), exc.code or 500, exc.name)
        # Keep the exception's own headers (a 405 must list the allowed methods in Allow).
        headers = [(k, v) for k, v in exc.get_headers() if k.lower() != "content-type"]
        return Response(body, status=exc.code or 500, mimetype=JSON, headers=headers)

    @app.errorhandler(Exception)
    def unexpected_error(exc: Exception) -> Response:
        """Last resort: a bug, never the client's fault. Answered in the route's own form,
        logged with a request id (also sent as ``X-Request-Id``) and counted."""
        request_id = g.get("request_id") or secrets.token_hex(8)
        protocol = _PROTOCOL_OF.get(request.endpoint or "", "rest")
        log.exception("unexpected error request_id=%s path=%s", request_id, request.path)
        metrics.UNEXPECTED_ERRORS.labels(protocol=protocol).inc()
        if g.get("started") is not None:
            observe(protocol, 500, "none")
        message = f"internal error (request id {request_id})"
        if protocol == "paddlex":
            body = paddlex.error(request_id, 500, message)
        elif protocol == "pipeline_http":
            body = pipeline_http.render(
                pipeline.PipelineAnswer(err_no=pipeline.UNKNOWN_ERROR, err_msg=message)
            )
        else:
            body = rest.error_body("internal_error", message)
        return Response(body, status=500, mimetype=JSON, headers={"X-Request-Id": request_id})

    return app


# Route endpoint -> the protocol whose error form the last-resort handler answers in.
_PROTOCOL_OF = {
    "v1_ocr": "rest",
    "pipeline_route": "pipeline_http",
    "paddlex_ocr": "paddlex",
    "paddlex_health": "paddlex",
}


def _paddlex_images(req: paddlex.InferRequest, settings: Settings) -> tuple[list[bytes], bool]:
    """The images a PaddleX request names: one image, or the pages of a PDF (True)."""
    file_type = req.file_type
    if fetch.is_url(req.file):
        if file_type is None:
            path = req.file.split("?", 1)[0].lower()
            file_type = 0 if path.endswith(".pdf") else 1
        data = fetch.fetch(
            req.file,
            settings.url_hosts(),
            settings.max_request_bytes,
            settings.url_input_timeout_seconds,
        )
    else:
        if file_type is None:
            raise BadRequest("File type cannot be determined")
        try:
            data = decode_base64(req.file)
        except BadRequest as exc:
            raise InvalidImage(str(exc)) from None
    if file_type == 1:
        return [data], False
    pages = render_pages(
        data, settings.pdf_max_pages, settings.pdf_render_scale, settings.max_image_pixels
    )
    return pages, True


TIER_HEADER = "X-Cache-Tier"
DETAIL_HEADERS = (near_dup.SOURCE_HEADER, near_dup.FIGURES_HEADER)  # "similar" hits


def _cache_headers(status: str, tier: str) -> dict[str, str]:
    """``X-Cache`` and, for hits, ``X-Cache-Tier`` (l1, l2, ...); both hidden together from
    untrusted callers when ``CACHE_STATUS_VISIBLE=trusted``."""
    headers = {"X-Cache": status}
    if tier:
        headers[TIER_HEADER] = tier
    return headers


def _retry_after(exc: EngineBusy) -> dict[str, str]:
    return {"Retry-After": str(exc.retry_after)}


def _paddlex_page(
    data: bytes, result: OcrResult, req: paddlex.InferRequest, visualize: bool, settings: Settings
) -> dict[str, Any]:
    """One ``ocrResults`` item; the pictures are drawn from the (cached) result."""
    item: dict[str, Any] = {
        "prunedResult": paddlex.pruned_result(result, req.params, req.rec_score_thresh)
    }
    if visualize:
        page = decode_image(data, settings.max_image_pixels)
        shown = paddlex.shown_lines(result, req.params, req.rec_score_thresh)
        item.update(paddlex_images.pictures(Image.fromarray(page.pixels), shown))
    return item


def _controls(settings: Settings) -> CacheControls:
    return controls.parse(request.headers, settings, trusted=g.trusted)


def _warn_if_not_evicting(store: RedisStore) -> None:
    policy = store.eviction_policy()
    if policy == "noeviction":
        log.warning(
            "Redis maxmemory-policy is 'noeviction': writes will fail when memory is full; "
            "use allkeys-lru (docker/redis.conf)"
        )
