"""The Flask application factory: HTTP routes over the cache front door."""

from __future__ import annotations

import logging
import time
from typing import Any

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from app import metrics
from app.cache.breaker import CircuitBreaker
from app.cache.region import CacheControls, OcrCache
from app.cache.store import RedisStore
from app.config import Settings
from app.engine_state import EngineState
from app.engines import build_engine
from app.engines.base import Engine, EngineError
from app.imaging import DecodedImage, InvalidImage, decode_image
from app.protocols import pdserving, pipeline_http, rest
from app.protocols.errors import BadRequest

log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None,
    engine: Engine | None = None,
    store: RedisStore | None = None,
) -> Flask:
    """Build the app; ``engine``/``store`` may be passed in (tests share one loaded engine)."""
    settings = settings or Settings.from_env()
    logging.getLogger("app").setLevel(settings.log_level)
    engine = engine or build_engine(settings)
    if store is None and settings.cache_enabled and settings.redis_url:
        store = RedisStore(
            settings.redis_url,
            settings.redis_timeout_ms,
            settings.redis_connect_timeout_ms,
            CircuitBreaker(
                settings.redis_breaker_failures, settings.redis_breaker_cooldown_seconds
            ),
        )
    if settings.cache_enabled and store is None:
        log.warning("REDIS_URL is not set: every request goes to the engine")
    engine.prepare()
    state = EngineState(engine, wait_seconds=float(settings.request_timeout_seconds))
    state.start()
    if store is not None:
        _warn_if_not_evicting(store)

    def decode(data: bytes) -> DecodedImage:
        return decode_image(data, settings.max_image_pixels)

    cache = OcrCache(settings, engine, store, decode, wait_for_engine=state.wait)
    engine_description = engine.describe()

    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.extensions["ocr"] = {"cache": cache, "engine_state": state, "settings": settings}

    @app.before_request
    def _start_timer() -> None:
        g.started = time.perf_counter()

    def observe(protocol: str, status: int, cache_status: str) -> None:
        metrics.REQUESTS.labels(protocol=protocol, status=str(status)).inc()
        metrics.REQUEST_SECONDS.labels(protocol=protocol, cache=cache_status).observe(
            time.perf_counter() - g.started
        )

    @app.post("/v1/ocr")
    def v1_ocr() -> Any:
        try:
            data = rest.parse_image(request)
            outcome = cache.get_or_compute(data, controls=_cache_controls())
        except (BadRequest, InvalidImage) as exc:
            code = getattr(exc, "code", "invalid_image")
            observe("rest", 400, "none")
            return jsonify(rest.error_body(code, str(exc))), 400
        except EngineError as exc:
            observe("rest", 503, "none")
            return jsonify(rest.error_body("engine_error", str(exc))), 503
        observe("rest", 200, outcome.status.value)
        return Response(
            rest.render(outcome, engine_description),
            mimetype="application/json",
            headers={"X-Cache": outcome.status.value},
        )

    @app.post("/<name>/<method>")
    def pipeline(name: str, method: str) -> Response:
        err_no, err_msg, keys, values, status = 0, "", [], [], "none"
        try:
            if name != settings.pipeline_service_name:
                raise pipeline_http.PipelineError(
                    pipeline_http.SERVICE_NAME_ERROR, "Failed to inference: Service name error."
                )
            req = pipeline_http.parse(request.get_data())
            log.debug("pipeline %s/%s logid=%s clientip=%s", name, method, req.logid, req.clientip)
            images = pipeline_http.decode_images(req)
            controls = CacheControls(bypass=req.profile)
            started = time.perf_counter()
            try:
                outcomes = cache.get_or_compute_many(images, controls=controls)
            except InvalidImage as exc:
                raise pipeline_http.PipelineError(
                    pipeline_http.UNKNOWN_ERROR, pipeline_http.op_error(req.logid, str(exc))
                ) from None
            except EngineError as exc:
                raise pipeline_http.PipelineError(
                    pipeline_http.UNKNOWN_ERROR,
                    pipeline_http.op_error(req.logid, str(exc), "process"),
                ) from None
            keys = pipeline_http.response_keys(req)
            values = [pdserving.result_string(o.result) for o in outcomes]
            status = ",".join(sorted({o.status.value for o in outcomes}))
            if req.profile:
                keys.append(pipeline_http.PROFILE_KEY)
                values.append(f"total_ms:{(time.perf_counter() - started) * 1000:.3f}")
        except pipeline_http.PipelineError as exc:
            err_no, err_msg = exc.err_no, str(exc)
        observe("pipeline_http", 200, status if err_no == 0 else "none")
        response = Response(
            pipeline_http.render(err_no, err_msg, keys, values), mimetype="application/json"
        )
        if err_no == 0:
            response.headers["X-Cache"] = status
        return response

    @app.get("/healthz")
    def healthz() -> Any:
        return jsonify({"status": "alive"})

    @app.get("/readyz")
    def readyz() -> Any:
        body: dict[str, Any] = {
            "engine": "ready" if state.ready else ("failed" if state.error else "loading"),
            "fingerprint": engine.fingerprint,
        }
        if state.error:
            body["engine_error"] = state.error
        if store is None:
            body["redis"] = {"state": "disabled"}
        else:
            body["redis"] = {
                "state": "up" if store.ping() else "down",
                "breaker": store.breaker_state,
            }
        return jsonify(body), (200 if state.ready else 503)

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        payload, content_type = metrics.render()
        return Response(payload, content_type=content_type)

    @app.errorhandler(RequestEntityTooLarge)
    def too_large(exc: RequestEntityTooLarge) -> Any:
        limit = settings.max_request_bytes
        return jsonify(rest.error_body("too_large", f"request body over {limit} bytes")), 413

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Any:
        code = exc.name.lower().replace(" ", "_")
        return jsonify(rest.error_body(code, exc.description or "")), exc.code

    return app


def _cache_controls() -> CacheControls:
    directives = {d.strip().lower() for d in request.headers.get("Cache-Control", "").split(",")}
    return CacheControls(no_cache="no-cache" in directives, no_store="no-store" in directives)


def _warn_if_not_evicting(store: RedisStore) -> None:
    policy = store.eviction_policy()
    if policy is not None and policy == "noeviction":
        log.warning(
            "Redis maxmemory-policy is 'noeviction': writes will fail when memory is full; "
            "use allkeys-lru (docker/redis.conf)"
        )
