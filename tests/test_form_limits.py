"""Multipart uploads whose form is over werkzeug's limits or odd (issue 25): ``POST /v1/ocr``
is the only endpoint that reads a form (``app/protocols/rest.py``). A 2 MB non-file field next
to a normal image, 10,000 tiny fields, fields without a name: each is answered as the REST
API answers the client's errors (4xx, ``{"error": {"code", "message"}}`` JSON, never HTML),
nothing is cached, and the worker serves the next request. Through the Flask app here; through
nginx and granian in tests/test_served_overload.py (the issue's 502 came from the front
reading none of the body before answering)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import WORD_EN
from tests.helpers import stored_keys

pytestmark = pytest.mark.integration

BOUNDARY = "issue25boundary"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"
IMAGE = WORD_EN.read_bytes()


def part(disposition: str, body: bytes, content_type: str | None = None) -> bytes:
    head = f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n"
    if content_type:
        head += f"Content-Type: {content_type}\r\n"
    return head.encode() + b"\r\n" + body + b"\r\n"


def form(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


FILE = part('form-data; name="file"; filename="word.png"', IMAGE, "image/png")

# (case, body, status, error code, words of the message); status 200: answered as if the
# odd part were not there (a part without a name names none of the API's fields).
CASES: list[tuple[str, bytes, int, str, str]] = [
    (
        "2 MB min_score beside an image",
        form(FILE, part('form-data; name="min_score"', b"1" * (2 * 1024 * 1024))),
        413, "too_large", "a field over 500000 bytes",
    ),
    (
        "10,000 tiny fields beside an image",
        form(FILE, *(part(f'form-data; name="f{i}"', b"v") for i in range(10_000))),
        413, "too_large", "over 1000 parts",
    ),
    (
        "a 2 MB field without a name",
        form(FILE, part("form-data", b"1" * (2 * 1024 * 1024))),
        413, "too_large", "a field over 500000 bytes",
    ),
    ("a field without a name", form(FILE, part("form-data", b"0.99")), 200, "", ""),
    ("a field with an empty name", form(FILE, part('form-data; name=""', b"0.99")), 200, "", ""),
    (
        "the image without a name",
        form(part('form-data; filename="word.png"', IMAGE, "image/png")),
        400, "missing_field", "'file'",
    ),
]  # fmt: skip


def check_answer(case: str, status: int, headers: Any, data: Any, want: tuple) -> None:
    """The REST form of the expected answer: JSON, an error code and a message (4xx), or
    the image's lines (200)."""
    want_status, code, words = want
    assert status == want_status, (case, status, data)
    assert headers["Content-Type"] == "application/json", (case, headers["Content-Type"])
    if status == 200:
        assert data["lines"], (case, data)
    else:
        assert set(data) == {"error"}, (case, data)
        assert data["error"]["code"] == code and words in data["error"]["message"], (case, data)
        assert "X-Cache" not in headers, case


@pytest.mark.parametrize("case,body,status,code,words", CASES, ids=[c[0] for c in CASES])
def test_odd_multipart_forms_are_answered_in_the_rest_form(
    make_app, redis_client, case, body, status, code, words
):
    client = make_app().test_client()
    answer = client.post("/v1/ocr", data=body, content_type=CONTENT_TYPE)
    check_answer(case, answer.status_code, answer.headers, answer.get_json(), (status, code, words))
    if status != 200:
        assert stored_keys(redis_client) == []  # nothing cached for a refused request
    assert client.get("/readyz").status_code == 200
    # The worker serves the next request: the same image, uploaded plainly.
    following = client.post("/v1/ocr", data=form(FILE), content_type=CONTENT_TYPE)
    assert following.status_code == 200 and following.get_json()["lines"]
