"""Fetching ``file`` URLs for PaddleX requests — off unless hosts are allow-listed (SSRF).

Only http(s), only hosts named in ``URL_INPUT_ALLOWED_HOSTS`` (``host`` or ``host:port``),
no redirects (a redirect could point anywhere), a timeout and a size limit.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import requests

from app.protocols.errors import BadRequest


def is_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))


def fetch(url: str, allowed_hosts: frozenset[str], max_bytes: int, timeout: float = 10.0) -> bytes:
    if not allowed_hosts:
        raise BadRequest("URL input is disabled on this service; send the file as base64")
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    netloc = f"{host}:{parts.port}" if parts.port else host
    if parts.scheme not in ("http", "https") or (
        host not in allowed_hosts and netloc not in allowed_hosts
    ):
        raise BadRequest(f"URL host {netloc!r} is not allowed")
    try:
        with requests.get(url, timeout=timeout, stream=True, allow_redirects=False) as resp:
            if resp.status_code != 200:
                raise BadRequest(f"fetching the URL gave HTTP {resp.status_code}")
            data = bytearray()
            for chunk in resp.iter_content(64 * 1024):
                data.extend(chunk)
                if len(data) > max_bytes:
                    raise BadRequest(f"the file at the URL is over {max_bytes} bytes")
            return bytes(data)
    except requests.RequestException as exc:
        raise BadRequest(f"could not fetch the URL: {exc.__class__.__name__}") from None
