"""Which requests the HTTP front may answer itself (app/front_hits.py ``screen``): only those
a worker would answer the same way; everything else is forwarded. Unit layer: no servers."""

from __future__ import annotations

import pytest

from app.config import Settings
from app.front_hits import FrontHits, HitSpec

JSON = [(b"content-type", b"application/json"), (b"content-length", b"20")]


@pytest.fixture()
def front(tmp_path) -> FrontHits:
    settings = Settings.from_env(
        {"CACHE_TENANT_HEADER": "X-Tenant", "CACHE_CONTROL_TOKEN": "t" * 20}
    )
    hits = FrontHits(settings, str(tmp_path / "spec.json"))
    hits._spec = HitSpec("ocr", "fp", "ocr-x", "ocr", 0.5, {}, "ocr-x", "ocr")
    return hits


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (b"/v1/ocr", "rest"),
        (b"/ocr/prediction", "pipeline_http"),
        (b"/ocr/anything2", "pipeline_http"),  # the worker's route takes any method name
        (b"/v1/ocr?x=1", None),
        (b"/v1/ocr/", None),
        (b"/ocr/predic%2Ftion", None),  # werkzeug decodes it to another path
        (b"/%6Fcr/prediction", None),
        (b"/other/prediction", None),
        (b"/ocr/a/b", None),
        (b"/ocr", None),  # PaddleX
        (b"/ocr/" + b"p" * 3000, None),  # past gunicorn's request line
    ],
)
def test_paths(front, target, expected):
    assert front.screen(b"POST", target, JSON) == expected


@pytest.mark.parametrize("method", [b"GET", b"HEAD", b"PUT", b"OPTIONS"])
def test_only_post(front, method):
    assert front.screen(method, b"/v1/ocr", JSON) is None


@pytest.mark.parametrize(
    "extra",
    [
        [(b"cache-control", b"no-store")],
        [(b"x-cache-ttl", b"60")],
        [(b"x-cache-similar", b"on")],
        [(b"x-tenant", b"acme")],
        [(b"transfer-encoding", b"chunked")],
        [(b"x-cache-control-token", b"a"), (b"x-cache-control-token", b"b")],
        [(b"x-pad", b"v" * 9000)],
        [(f"x-pad-{i}".encode(), b"v") for i in range(100)],
    ],
)
def test_forwarded_headers(front, extra):
    assert front.screen(b"POST", b"/v1/ocr", JSON + extra) is None


def test_multipart_is_forwarded(front):
    multipart = [(b"content-type", b"multipart/form-data; boundary=x")]
    assert front.screen(b"POST", b"/v1/ocr", multipart) is None
    assert front.screen(b"POST", b"/ocr/prediction", multipart) is None


def test_one_token_header_and_plain_headers_are_answered(front):
    headers = JSON + [(b"x-cache-control-token", b"t" * 20), (b"user-agent", b"paddle")]
    assert front.screen(b"POST", b"/v1/ocr", headers) == "rest"


def test_a_pipeline_name_shared_with_another_route_is_not_answered(front):
    front._spec = HitSpec("ocr", "fp", "ocr-x", "ocr", 0.5, {}, "ocr-x", "")
    assert front.screen(b"POST", b"/ocr/prediction", JSON) is None
    assert front.screen(b"POST", b"/v1/ocr", JSON) == "rest"


def test_the_spec_marks_a_shared_pipeline_name():
    from types import SimpleNamespace

    from app.cache.keys import KeySpace
    from app.vocabulary import OcrParams

    class Engine:
        default_params = OcrParams()

        def check_params(self, params):
            pass

    settings = Settings.from_env({"PIPELINE_SERVICE_NAME": "admin"})
    service = SimpleNamespace(
        settings=settings, min_score=0.5, default_params=OcrParams(), default_task="ocr",
        engine_description={"kind": "x"},
        cache=SimpleNamespace(engine=Engine(), keys=KeySpace("ocr", "fp")),
    )  # fmt: skip
    assert HitSpec.of(service, ["/admin/purge", "/v1/ocr"]).pipeline_name == ""
    assert HitSpec.of(service, ["/v1/ocr", "/<name>/<method>"]).pipeline_name == "admin"
