"""The web page at ``/``: upload an image or PDF, see its boxes and lines, and the service's
own figures. Plain HTML/CSS/JS shipped in the package (no CDN, no build step), talking to the
public REST, PaddleX and ``/v1/stats`` endpoints like any other client. Imported by fronts
(and the combined role) only."""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response, send_from_directory

STATIC = Path(__file__).with_name("static")

blueprint = Blueprint("ui", __name__, static_folder=str(STATIC), static_url_path="/ui")


@blueprint.get("/")
def index() -> Response:
    response = send_from_directory(STATIC, "index.html")
    # The page loads only its own files; nothing from elsewhere may run in it.
    response.headers["Content-Security-Policy"] = (
        "default-src 'self'; img-src 'self' blob: data:; style-src 'self'; script-src 'self'; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    )
    return response
