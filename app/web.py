"""The Flask application factory: wiring only. The protocol endpoints are served in front of
Flask (``app.routes.endpoints``), the operations, admin API and web page are blueprints, the
shared objects one extension (``app.service``)."""

from __future__ import annotations

import logging

from flask import Flask

from app import admin, logsafe, metrics, service, ui
from app.cache.store import RedisStore
from app.config import Settings
from app.engines import build_engine
from app.engines.base import Engine
from app.engines.direct import EngineProxy
from app.engines.redacting import with_redaction
from app.routes import endpoints, jobs, kserve, lifecycle, ops, paddlex


def create_app(
    settings: Settings | None = None,
    engine: Engine | None = None,
    store: RedisStore | None = None,
    role: str = "combined",
) -> Flask:
    """Build the app; ``engine``/``store`` may be passed in (tests share one loaded engine).
    ``role="front"``: the engine is a proxy to the engine processes (``create_front``);
    ``combined``: the engine runs in this process and consumes the queue too."""
    settings = settings or Settings.from_env()
    logsafe.install()
    logging.getLogger("app").setLevel(settings.server.log_level)
    engine = with_redaction(
        engine or build_engine(settings), settings.redaction.types, settings.redaction.patterns_file
    )
    if role == "front":
        processes = settings.processes
        engine = EngineProxy(
            engine, processes.engine_urls, processes.engine_token,
            settings.engine.timeout_seconds, processes.engine_wait_seconds,
            connections=settings.engine_callers(),
        )  # fmt: skip
    metrics.initialise(engine.kind)
    shared = service.build(settings, engine, store, role=role)

    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.server.max_request_bytes
    app.extensions["ocr"] = shared
    lifecycle.register(app, settings)
    admin.register(app, settings.server.admin_token, shared.cache, shared.engine_state)
    for blueprint in (
        paddlex.blueprint,
        ops.blueprint,
        ui.blueprint,
        jobs.blueprint,
        kserve.blueprint,
    ):
        app.register_blueprint(blueprint)
    prefixes = {rule.rule.split("/")[1] for rule in app.url_map.iter_rules()}
    app.wsgi_app = endpoints.Endpoints(shared, app.wsgi_app, prefixes)  # type: ignore[method-assign]
    shared.engine_state.start()  # the routes exist (``service.build``)
    return app


def create_front(settings: Settings | None = None) -> Flask:
    """A front worker's app: no engine is loaded here (``python -m app front``; with
    granian's own CLI: ``granian --interface wsgi --factory app.front_server:load_worker``,
    which also starts the worker's gRPC server)."""
    return create_app(settings, role="front")
