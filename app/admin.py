"""The admin API: ``POST /admin/purge``, ``GET /admin/stats`` and ``GET /admin/queue``.

Only with ``Authorization: Bearer $ADMIN_TOKEN`` (compared in constant time); without a
configured token the routes do not exist (404). Purges never block Redis (SCAN + UNLINK in
batches) and tell every process to drop its L1; one not confirmed on every replica (or cut
short by a failure) is a 503 ``purge_unconfirmed``, to be repeated (``app/cache/purging.py``).
The queue's picture (``app/queue/inspect.py``) names tenants, which only an operator may see.
"""

from __future__ import annotations

import hmac
import re
from typing import Any

from flask import Blueprint, Flask, Response, jsonify, request

from app.cache.purging import PurgeUnconfirmed
from app.cache.region import OcrCache
from app.cache.store import RedisStore
from app.engine_state import EngineState
from app.protocols.errors import error_envelope
from app.queue import inspect
from app.vocabulary import TENANT_NAME

_MD5 = re.compile(r"[0-9a-f]{32}")
RETRY_AFTER = 1  # seconds before an unconfirmed purge is worth repeating


def register(app: Flask, token: str, cache: OcrCache, state: EngineState) -> None:
    if not token:
        return
    admin = Blueprint("admin", __name__, url_prefix="/admin")
    expected = f"Bearer {token}".encode()

    @admin.before_request
    def _authorize() -> Any:
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return _error(401, "unauthorized", "a valid Authorization: Bearer token is required")
        return None

    @admin.post("/purge")
    def purge() -> Any:
        body = request.get_json(silent=True)
        if not isinstance(body, dict):
            return _error(
                400, "invalid_json", 'body must be {"namespace": ...} and/or {"md5": ...}'
            )
        namespace = body.get("namespace", "")
        md5 = body.get("md5")
        if not isinstance(namespace, str) or (namespace and not TENANT_NAME.fullmatch(namespace)):
            return _error(
                400, "invalid_namespace", "namespace: a tenant name, or empty for the default"
            )
        if md5 is not None and (not isinstance(md5, str) or not _MD5.fullmatch(md5)):
            return _error(400, "invalid_md5", "md5: 32 lower-case hex digits")
        if not isinstance(cache.store, RedisStore):
            return _error(409, "no_cache", "caching is disabled on this service")
        try:
            removed = cache.purge(namespace=namespace or None, md5=md5)
        except PurgeUnconfirmed as exc:
            answer, status = _error(
                503, exc.code,
                f"removed {exc.removed} entries, but the purge is not confirmed complete on "
                f"every replica ({exc.reason}): repeat it",
            )  # fmt: skip
            answer.headers["Retry-After"] = str(RETRY_AFTER)
            return answer, status
        return jsonify({"removed": removed, "prefix": cache.prefix(namespace), "md5": md5})

    @admin.get("/stats")
    def stats() -> Any:
        store = cache.store
        return jsonify(
            {
                "engine": {**cache.engine.describe(), "status": state.status},
                "l1": {"entries": len(cache.l1), "bytes": cache.l1.size_bytes},
                "redis": (
                    {"breaker": store.breaker_state, **store.stats()}
                    if isinstance(store, RedisStore)
                    else {"state": "disabled"}
                ),
                "l3": (
                    {
                        "bucket": cache.l3.bucket,
                        "prefix": cache.l3.prefix,
                        "breaker": cache.l3.breaker_state,
                    }
                    if cache.l3 is not None
                    else {"state": "disabled"}
                ),
            }
        )

    @admin.get("/queue")
    def queue() -> Any:
        store, tickets = cache.store, cache.misses.queue
        if not isinstance(store, RedisStore) or tickets is None:
            return _error(409, "no_queue", "no global miss queue: caching is disabled here")
        shards, live_ms = tickets.shards, tickets.live_ms
        ok, views = store.run("dispatch", lambda c: inspect.read_shards(c, shards, live_ms=live_ms))
        if not ok:
            return _error(503, "redis_unavailable", "Redis did not answer; try again")
        return jsonify(inspect.combined([view.as_json() for view in views]))

    app.register_blueprint(admin)


def _error(status: int, code: str, message: str) -> tuple[Response, int]:
    return jsonify(error_envelope(code, message)), status
