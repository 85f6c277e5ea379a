"""The edge (nginx) in front of the front's server: ``Settings.edge``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app import env as e
from app.env import RateLimit, Section, env


@dataclass(frozen=True)
class EdgeSettings(Section):
    TITLE = "The edge (nginx)"
    INTRO = "`python -m app serve` puts nginx on `HOST:HTTP_PORT` in front of the front server's unix socket (`app/edge.py` renders `app/nginx.conf.j2`); see [DEPLOYMENT.md](DEPLOYMENT.md#the-edge-nginx)."

    mode: str = env(
        "EDGE",
        e.choice("nginx", "external", "none"),
        "nginx",
        "`nginx`: `serve` runs nginx in front; `external`: nginx runs apart (`python -m app edge`); `none`: no nginx",
    )
    socket: str = env(
        "EDGE_SOCKET",
        e.absolute_path,
        "",
        "the front server's unix socket; unset: a private folder (`EDGE=nginx`); required with `EDGE=external`",
    )
    nginx: str = env(
        "EDGE_NGINX",
        e.text,
        "",
        "the nginx binary; unset: found on `PATH`, in the venv or at `/usr/sbin/nginx`",
    )
    workers: int = env("EDGE_WORKERS", e.integer(1, 64), 1, "nginx worker processes")
    access_log: bool = env(
        "EDGE_ACCESS_LOG",
        e.boolean,
        True,
        "one JSON line per request on stdout",
    )
    header_timeout_seconds: float = env(
        "HTTP_HEADER_TIMEOUT_SECONDS",
        e.number(0.1, 3600.0),
        10.0,
        "a request's head must arrive within this, else nginx closes the connection",
    )
    body_timeout_seconds: float = env(
        "HTTP_BODY_TIMEOUT_SECONDS",
        e.number(0.1, 3600.0),
        60.0,
        "each read of a body, and each write of an answer, within this",
    )
    real_ip_from: tuple[Any, ...] = env(
        "EDGE_REAL_IP_FROM",
        e.networks,
        (),
        "CIDRs of your proxies (an Ingress, a load balancer) whose `X-Forwarded-For` names the client",
    )
    rate_limit: RateLimit | None = env(
        "RATE_LIMIT",
        e.rate_limit,
        None,
        "`RPS[:BURST]` per client address, hits and misses alike (429 + `Retry-After`)",
    )
    tls_cert_file: str = env(
        "TLS_CERT_FILE",
        e.existing_file,
        "",
        "with `TLS_KEY_FILE`: nginx serves https with HTTP/2 on `HTTP_PORT`",
    )
    tls_key_file: str = env("TLS_KEY_FILE", e.existing_file, "", "the certificate's private key")
