"""The reference servers the benchmarks measure the front against: gunicorn, as the front
ran before granian (``gthread``) and as the seed design ran (``sync``). gunicorn stays in the
project for these alone (docs/PERFORMANCE.md)."""

from __future__ import annotations

import sys

from app.config import Settings

# gunicorn's options as the front used them (2 workers x WEB_THREADS gthread threads, the
# hung-worker timeout 30 s past the request timeout, keep-alive longer than nginx's).
KEEPALIVE_SECONDS = 65


def gunicorn_args(
    app: str, bind: str, workers: int, threads: int, worker_class: str = "gthread"
) -> list[str]:
    """The command line of ``app`` under gunicorn on ``bind`` (``unix:/path`` or host:port)."""
    timeout = Settings.from_env({}).server.request_timeout_seconds
    return [
        sys.executable, "-m", "gunicorn", app,
        "--bind", bind, "--workers", str(workers),
        "--worker-class", worker_class, "--threads", str(threads),
        "--timeout", str(timeout + 30), "--graceful-timeout", str(timeout),
        "--keep-alive", str(KEEPALIVE_SECONDS), "--log-level", "warning",
    ]  # fmt: skip
