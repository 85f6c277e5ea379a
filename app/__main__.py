"""``python -m app serve``: validate the configuration, start the private Redis when
``REDIS_URL`` is unset, and run the HTTP service under gunicorn in the foreground."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from app import logsafe, memory
from app.config import ConfigError, Settings


def serve(settings: Settings) -> int:
    from app.embedded_redis import EmbeddedRedis
    from app.gunicorn_app import GunicornApp, prepare_metrics_dir

    memory.keep_large_buffers()  # before gunicorn forks: the workers inherit it
    log = logging.getLogger("app")
    owner = os.getpid()  # gunicorn's workers are forks that unwind through this function
    embedded = None
    if settings.cache_enabled and not settings.redis_url:
        embedded = EmbeddedRedis().start()
        os.environ["REDIS_URL"] = embedded.url
        log.info("REDIS_URL unset: started a private Redis at %s (docker/redis.conf)", embedded.url)
    metrics_dir = prepare_metrics_dir()
    front = FrontProcess(settings) if settings.http_front else None
    try:
        GunicornApp(settings, bind=front.bind if front else None).run()
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        # A worker that exits unwinds here too (gunicorn forks inside run()): it must leave
        # the fronts, the private Redis and the metrics folder to the serving process.
        if os.getpid() == owner:
            if front is not None:
                front.stop()  # after gunicorn: the requests it finished have been answered
            if embedded is not None:
                embedded.cleanup()
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


class FrontProcess:
    """``python -m app.front`` on HOST:HTTP_PORT, gunicorn behind it on a private unix socket
    (see app/front.py for why). If the front dies, the service stops (and is restarted by
    its supervisor) rather than serve gRPC alone; the front stops when this process dies."""

    def __init__(self, settings: Settings) -> None:
        self._dir = tempfile.mkdtemp(prefix="ocr-front-")
        upstream = os.path.join(self._dir, "gunicorn.sock")
        self.bind = f"unix:{upstream}"
        self._stopping = False
        from app.front_hits import SPEC_ENV

        hits: list[str] = []
        os.environ.pop(SPEC_ENV, None)  # the workers publish only where this process says
        if settings.http_front_hits and settings.cache_enabled:
            os.environ[SPEC_ENV] = os.path.join(self._dir, "hit-spec.json")  # for the workers
            hits = ["--hit-spec", os.environ[SPEC_ENV]]
        # Several front processes share HTTP_PORT (SO_REUSEPORT) once they answer hits
        # themselves; together they hold the bodies one front would (8 x MAX_REQUEST_BYTES).
        count = settings.http_front_processes or (settings.web_concurrency if hits else 1)
        buffered = max(settings.max_request_bytes, 8 * settings.max_request_bytes // count)
        command = [
            sys.executable, "-m", "app.front",
            "--host", settings.host, "--port", str(settings.http_port),
            "--upstream", upstream,
            "--max-body-bytes", str(settings.max_request_bytes),
            "--max-buffered-bytes", str(buffered),
            "--header-timeout", str(settings.http_header_timeout_seconds),
            "--body-timeout", str(settings.http_body_timeout_seconds),
            "--upstream-timeout", str(settings.request_timeout_seconds + 30),
            "--parent", str(os.getpid()),
            *hits,
            *(["--reuse-port"] if count > 1 else []),
        ]  # fmt: skip
        self._procs = [subprocess.Popen(command) for _ in range(count)]
        for proc in self._procs:
            watch = threading.Thread(target=self._watch, args=(proc,), name="front-watch")
            watch.daemon = True
            watch.start()

    def _watch(self, proc: subprocess.Popen) -> None:
        # Any exit we did not ask for (a second SIGTERM to a stopping gunicorn is harmless).
        # The exit status is not trusted: gunicorn's reaper may collect the child first.
        proc.wait()
        if not self._stopping:
            logging.getLogger("app").error("the HTTP front exited; stopping the service")
            os.kill(os.getpid(), signal.SIGTERM)

    def stop(self) -> None:
        self._stopping = True
        for proc in self._procs:
            proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


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
    logsafe.install()
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
