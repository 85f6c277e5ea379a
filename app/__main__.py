"""``python -m app``: the service's roles and tools. ``serve`` runs the whole service on one
machine (``app.supervisor``: private Redis, engine processes, the front); ``front`` the edge
and the front's server and workers (no engine); ``engine`` one engine process
(``app.engine_process``)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING

from app import logformat, logsafe, memory, tracing
from app.config import ConfigError, Settings

if TYPE_CHECKING:
    from app.edge import Edge


def front(settings: Settings) -> int:
    """nginx on HOST:HTTP_PORT and the front's server (granian, ``app.front_server``) behind it
    on a private unix socket (``EDGE=nginx``), the server alone on EDGE_SOCKET (``external``)
    or on HOST:HTTP_PORT (``none``). The server's main process supervises nginx: it starts it
    once its socket is bound, stops it gracefully before its own workers, and stops the
    service should nginx die. Its workers hold no engine: misses go to the engine processes
    (the queue, else ``ENGINE_URLS``)."""
    memory.start_with_front_allocators()
    from app.edge import find_nginx
    from app.front_server import FrontServer, prepare_metrics_dir

    log = logging.getLogger("app")
    refusal = edge_refusal(settings)
    if refusal:
        print(f"configuration error: {refusal}", file=sys.stderr)
        return 2
    binary = find_nginx(settings.edge.nginx) if settings.edge.mode == "nginx" else None
    if settings.edge.mode == "nginx" and binary is None:
        _without_edge(settings, log)
    owner = os.getpid()  # the workers are forks: one that unwinds must leave what is ours
    socket_dir = ""  # the server's private socket folder, when EDGE_SOCKET does not name one
    socket = settings.edge.socket if binary or settings.edge.mode == "external" else ""
    if binary and not socket:
        socket_dir = tempfile.mkdtemp(prefix="ocr-front-")
        socket = os.path.join(socket_dir, "front.sock")
    edge = _checked_edge(settings, socket, binary) if binary else None
    if binary and edge is None:
        return 2
    if settings.edge.rate_limit and settings.edge.mode == "none":
        log.warning("RATE_LIMIT applies to gRPC only with EDGE=none: limit HTTP in your proxy")
    metrics_dir = prepare_metrics_dir()
    try:
        FrontServer(settings, socket, edge).run()
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        if os.getpid() == owner:
            if edge is not None:
                edge.quit()  # normally done already, before the workers stopped
            if socket_dir:
                shutil.rmtree(socket_dir, ignore_errors=True)
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def edge_refusal(settings: Settings) -> str:
    """Why the front cannot start with these edge settings ("" when it can): ``EDGE=nginx``
    with an ``EDGE_NGINX`` that cannot run, or with no nginx here while TLS or a rate limit,
    which only the edge serves, is asked for. ``serve`` asks before it starts anything."""
    from app.edge import find_nginx

    if settings.edge.mode != "nginx" or find_nginx(settings.edge.nginx) is not None:
        return ""
    if settings.edge.nginx:
        return f"EDGE_NGINX: cannot run {settings.edge.nginx!r}"
    wanted = [name for name, on in (("TLS_CERT_FILE", settings.edge.tls_cert_file),
                                    ("RATE_LIMIT", settings.edge.rate_limit)) if on]  # fmt: skip
    if wanted:
        return (
            f"{', '.join(wanted)}: served by the nginx edge, and no nginx is on PATH "
            "(install Debian's nginx-light)"
        )
    return ""


def _without_edge(settings: Settings, log: logging.Logger) -> None:
    """``EDGE=nginx`` and no nginx here: the front's server serves the port itself, said in
    one line."""
    log.warning(
        "EDGE=nginx but no nginx on PATH: the front's server serves %s:%d itself; off: slow-client "
        "buffering, edge request ids and JSON access log, RATE_LIMIT, TLS "
        "(install Debian's nginx-light, or set EDGE=none behind your own buffering proxy)",
        settings.server.host,
        settings.server.http_port,
    )


def edge(settings: Settings) -> int:
    """``python -m app edge``: nginx alone in front of the front's server on EDGE_SOCKET (the
    Kubernetes pod's edge container; the app container runs ``serve`` with EDGE=external)."""
    from app.edge import find_nginx

    if settings.edge.mode != "external":
        print("configuration error: EDGE: `edge` runs with EDGE=external", file=sys.stderr)
        return 2
    binary = find_nginx(settings.edge.nginx)
    if binary is None:
        print("configuration error: EDGE: no nginx on PATH (or EDGE_NGINX)", file=sys.stderr)
        return 2
    proxy = _checked_edge(settings, settings.edge.socket, binary)
    return proxy.run() if proxy is not None else 2


def _checked_edge(settings: Settings, socket: str, binary: str) -> Edge | None:
    """nginx with the configuration these settings render, once ``nginx -t`` accepts it
    (None: refused, said in one line)."""
    from app.edge import Edge

    edge = Edge(settings, socket, binary)
    try:
        edge.check()
    except RuntimeError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        edge.quit()
        return None
    return edge


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app", description="OCR inference cache")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the whole service: Redis if unset, engines, the front")
    sub.add_parser("front", help="run the edge and the front workers (HTTP, gRPC; no engine)")
    sub.add_parser("engine", help="run one engine process on the miss queue (ENGINE_PORT)")
    sub.add_parser("edge", help="run the nginx edge alone (EDGE=external, EDGE_SOCKET)")
    sub.add_parser("edge-config", help="print the nginx configuration these settings render")
    sub.add_parser("check-config", help="validate the environment and print the settings")
    sub.add_parser("config-doc", help="print docs/CONFIGURATION.md (generated from app/config/)")
    sub.add_parser("prepare-models", help="locate/generate the model folders and print them")
    sub.add_parser("trace-receiver", help="run the OTLP/HTTP trace receiver and its web page")
    callback = sub.add_parser(
        "callback-secret", help="print a tenant's job-callback secret (from JOBS_CALLBACK_SECRET)"
    )
    callback.add_argument("tenant", nargs="?", default="", help="the tenant (none: the default)")
    args = parser.parse_args(argv)
    if args.command == "config-doc":  # the declarations, whatever this environment says
        from app.config import markdown

        print(markdown(), end="")
        return 0
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    refusal = tracing.check(os.environ)
    if refusal:
        print(f"configuration error: {refusal}", file=sys.stderr)
        return 2
    logsafe.install()
    logformat.configure(settings.server.log_level, settings.server.log_format)
    if args.command == "serve":
        from app.supervisor import serve

        refusal = edge_refusal(settings)  # before any process starts: one line, exit 2
        if refusal:
            print(f"configuration error: {refusal}", file=sys.stderr)
            return 2
        return serve(settings)
    if args.command == "front":
        return front(settings)
    if args.command == "engine":
        dispatch = settings.dispatch
        if dispatch.shards > 1 and dispatch.shard < 0:  # which shard's tickets: say it
            print("configuration error: DISPATCH_SHARD: required in an engine process when "
                  f"DISPATCH_SHARDS={dispatch.shards} (0 to {dispatch.shards - 1})",
                  file=sys.stderr)  # fmt: skip
            return 2
        # Alone (a container of its own), its metrics folder may not exist yet: prometheus-
        # client opens its files there at import.
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
        from app import engine_process

        return engine_process.run(settings)
    if args.command == "edge":
        return edge(settings)
    if args.command == "edge-config":
        from app.edge import render

        socket = settings.edge.socket or "/tmp/ocr-front-XXXXXX/front.sock"
        print(render(settings, socket, "/tmp/ocr-edge-XXXXXX", ()), end="")
        return 0
    if args.command == "trace-receiver":  # HOST, TRACE_RECEIVER_PORT (app/trace_receiver.py)
        from app import trace_receiver

        return trace_receiver.run(settings.server.host)
    if args.command == "callback-secret":  # for the operator to hand to the tenant
        from app.jobs.callback import tenant_secret

        if not settings.jobs.callback_secret:
            print("configuration error: JOBS_CALLBACK_SECRET is unset", file=sys.stderr)
            return 2
        print(tenant_secret(settings.jobs.callback_secret, args.tenant))
        return 0
    if args.command == "check-config":
        for var, value, secret in sorted(settings.variables()):
            print(f"{var}={'<set>' if secret and value else value}")
        return 0
    from app.engines import build_engine

    engine = build_engine(settings)
    print(engine.fingerprint, engine.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
