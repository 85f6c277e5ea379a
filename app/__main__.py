"""``python -m app serve``: validate the configuration, start the private Redis when
``REDIS_URL`` is unset, and run the HTTP service under gunicorn in the foreground."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile

from app.config import ConfigError, Settings


def _prepare_metrics_dir() -> str:
    """A clean prometheus multiprocess directory (stale files would double-count)."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.path.join(
        tempfile.gettempdir(), f"ocr-cache-metrics-{os.getpid()}"
    )
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


def serve(settings: Settings) -> int:
    from app.embedded_redis import EmbeddedRedis
    from app.gunicorn_app import GunicornApp

    log = logging.getLogger("app")
    embedded = None
    if settings.cache_enabled and not settings.redis_url:
        embedded = EmbeddedRedis().start()
        os.environ["REDIS_URL"] = embedded.url
        log.info("REDIS_URL unset: started a private Redis at %s (docker/redis.conf)", embedded.url)
    metrics_dir = _prepare_metrics_dir()
    try:
        GunicornApp(settings).run()
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        if embedded is not None:
            embedded.cleanup()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app", description="OCR inference cache")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the HTTP service (gunicorn) in the foreground")
    sub.add_parser("check-config", help="validate the environment and print the settings")
    sub.add_parser("prepare-models", help="locate/generate the model folders and print them")
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        return serve(settings)
    if args.command == "check-config":
        for key, value in sorted(vars(settings).items()):
            shown = "<set>" if settings.is_secret(key) and value else value
            print(f"{settings.env_name(key)}={shown}")
        return 0
    from app.engines import build_engine

    engine = build_engine(settings)
    print(engine.fingerprint, engine.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
