"""Operations: ``/healthz``, ``/readyz``, ``/metrics``, ``/v1/stats`` and ``/openapi.json``
(the admin API is ``app.admin``, the web page ``app.ui``). Errors answer in the REST form."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flask import Blueprint, Response, jsonify

from app import metrics, stats
from app.cache.store import RedisStore
from app.queue import backlog
from app.routes.common import JSON
from app.service import current

blueprint = Blueprint("ops", __name__)

OPENAPI = (Path(__file__).parent.parent / "openapi.json").read_bytes()  # served at /openapi.json


@blueprint.get("/healthz")
def healthz() -> Any:
    return jsonify({"status": "alive"})


@blueprint.get("/readyz")
def readyz() -> Any:
    service = current()
    status = service.engine_state.status  # read once: the code and the body must agree
    body: dict[str, Any] = {"engine": status, "fingerprint": service.cache.engine.fingerprint}
    if service.engine_state.error:
        body["engine_error"] = service.engine_state.error
    store = service.cache.store
    if not isinstance(store, RedisStore):
        body["redis"] = {"state": "disabled"}
    else:
        body["redis"] = {
            "state": "up" if store.ping() else "down",
            "breaker": store.breaker_state,
        }
    if (waiting := backlog.read(service)) is not None:
        body["queue"] = waiting.as_json()  # ready with no engine: misses wait for one
    return jsonify(body), (200 if status == "ready" else 503)


@blueprint.get("/metrics")
def metrics_endpoint() -> Response:
    waiting = backlog.read(current())
    if waiting is not None:  # back to what the queue holds, 0 too, with no engine reporting
        metrics.DISPATCH_QUEUE_DEPTH.set(waiting.queued)
    payload, content_type = metrics.render()
    return Response(payload + backlog.exposition(waiting), content_type=content_type)


@blueprint.get("/v1/stats")
def service_stats() -> Any:
    payload, _ = metrics.render()
    return jsonify(stats.summarize(payload.decode(), current().cache))


@blueprint.get("/openapi.json")
def openapi_document() -> Response:
    return Response(OPENAPI, mimetype=JSON)
