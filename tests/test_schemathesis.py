"""Schemathesis against the real app (WSGI, real engine, real Redis) and its own OpenAPI
document: ``POST /v1/ocr`` and ``POST /ocr``, positive and negative cases, every phase
(schema examples, coverage, fuzzing). No response may be a 5xx, every response must match the
documented status codes, content types, headers and schemas, data that breaks the schema must be
rejected, and an error response must leave nothing in Redis. ``test_cases_were_run`` reports
how many generated cases ran."""

from __future__ import annotations

import base64
import io
import json
import re
from collections import Counter
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from PIL import Image
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    missing_required_header,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from app.routes.ops import OPENAPI
from tests.conftest import WORD_EN

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_EXAMPLES = 250  # fuzzing phase, per operation; examples and coverage cases come on top
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    missing_required_header,
    unsupported_method,
]
OPERATIONS = ["POST /v1/ocr", "POST /ocr", "POST /v2/models/{model}/infer"]

CASES: Counter[tuple[str, str, str, int]] = Counter()  # (operation, phase, mode, status)


# The document is the one the app serves (test_openapi_document_is_served_... checks the bytes);
# it is loaded at import so that pytest can parametrize over its operations, and each case is
# sent to a fresh app built from the fixtures. (schemathesis.pytest.from_fixture, the lazy
# loader, relies on a pytest node attribute that pytest 9.2 no longer has.)
schema = schemathesis.openapi.from_dict(
    json.loads(OPENAPI),
    config=schemathesis.Config.from_dict(
        {"generation": {"database": "none", "deterministic": True}, "seed": 5}
    ),
).include(path=["/v1/ocr", "/ocr", "/v2/models/{model}/infer"], method="POST")


@pytest.fixture()
def api_app(make_app: Any) -> Any:
    app = make_app()
    return app


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_openapi_operations(case: Any, api_app: Any, redis_client: Any) -> None:
    keys_before = redis_client.dbsize()
    response = case.call(app=api_app)
    meta = case.meta
    phase = meta.phase.name.value if meta is not None else "explicit"
    mode = meta.generation.mode.value if meta is not None else "positive"
    CASES[(case.operation.label, phase, mode, response.status_code)] += 1
    case.validate_response(response, checks=CHECKS, transport_kwargs={"app": api_app})
    if response.status_code >= 400:
        assert redis_client.dbsize() == keys_before, "an error response wrote to Redis"
    assert api_app.test_client().get("/readyz").status_code == 200


def test_other_documented_routes_conform(make_app: Any, redis_client: Any) -> None:
    """Explicit requests to every documented route, including the successful shapes (lines,
    visualize, PDF pages) that generated data rarely reaches, match the document."""
    app = make_app()
    document = schemathesis.openapi.from_dict(json.loads(OPENAPI))
    word = base64.b64encode(WORD_EN.read_bytes()).decode()
    buf = io.BytesIO()
    Image.open(WORD_EN).convert("RGB").save(buf, "PDF")
    pdf = base64.b64encode(buf.getvalue()).decode()
    paddlex_body = json.dumps({"file": word, "fileType": 1, "visualize": False})
    v2_body = {"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1, 1],
                           "data": [[paddlex_body]]}]}  # fmt: skip
    requests: list[tuple[Any, ...]] = [
        ("/health", "GET", None, 200),
        ("/healthz", "GET", None, 200),
        ("/readyz", "GET", None, 200),
        ("/metrics", "GET", None, 200),
        ("/openapi.json", "GET", None, 200),
        ("/v1/ocr", "POST", {"image": word, "min_score": 0}, 200),
        ("/ocr", "POST", {"file": word, "fileType": 1, "visualize": True}, 200),
        ("/ocr", "POST", {"file": pdf, "fileType": 0}, 200),
        ("/ocr/prediction", "POST", {"key": ["image"], "value": [word]}, 200),
        ("/ocr/prediction", "POST", {"key": ["image"], "value": ["@@"]}, 200),
        ("/ocr/prediction", "POST", {"key": ["a", "b"], "value": [word, word]}, 200),
        ("/v2", "GET", None, 200),
        ("/v2/health/live", "GET", None, 200),
        ("/v2/health/ready", "GET", None, 200),
        ("/v2/models/{model}", "GET", None, 200, {"model": "ocr"}),
        (
            "/v2/models/{model}/versions/{version}",
            "GET",
            None,
            200,
            {"model": "ocr-image", "version": "1"},
        ),
        ("/v2/models/{model}/config", "GET", None, 200, {"model": "ocr"}),
        (
            "/v2/models/{model}/versions/{version}/ready",
            "GET",
            None,
            200,
            {"model": "ocr", "version": "1"},
        ),
        ("/v2/repository/index", "POST", None, 200),
        ("/v2/models/{model}/infer", "POST", v2_body, 200, {"model": "ocr"}),
        (
            "/v2/models/{model}/versions/{version}/infer",
            "POST",
            {"inputs": []},
            400,
            {"model": "ocr", "version": "1"},
        ),
        (
            "/v2/models/{model}/infer",
            "POST",
            {"inputs": [{"name": "image"}]},
            400,
            {"model": "ocr-image"},
        ),
    ]
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
    ]
    for path, method, body, status, *parameters in requests:
        operation = document[path][method]
        given = {"path_parameters": parameters[0]} if parameters else {}
        case = (
            operation.Case(**given)
            if body is None
            else operation.Case(body=body, media_type="application/json", **given)
        )
        response = case.call(app=app)
        assert response.status_code == status, (path, response.text[:300])
        case.validate_response(response, checks=checks, transport_kwargs={"app": app})


def test_openapi_document_is_served_and_names_every_route(make_app: Any) -> None:
    app = make_app()
    resp = app.test_client().get("/openapi.json")
    assert resp.status_code == 200 and resp.mimetype == "application/json"
    document = resp.get_json()
    assert resp.data == OPENAPI and document["openapi"].startswith("3.1")
    documented = {
        (path, method.upper()) for path, ops in document["paths"].items() for method in ops
    }
    assert {
        ("/v1/ocr", "POST"),
        ("/ocr", "POST"),
        ("/ocr/prediction", "POST"),
        ("/health", "GET"),
        ("/healthz", "GET"),
        ("/readyz", "GET"),
    } <= documented
    routes = {
        (re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule), method)  # /v1/jobs/<job_id> -> {job_id}
        for rule in app.url_map.iter_rules()
        for method in rule.methods or ()
        if method in ("GET", "POST", "DELETE")
    }
    for path, method in documented:
        # The protocol endpoints are served in front of Flask (app/routes/endpoints.py).
        served = method == "POST" and app.wsgi_app.match(path) is not None
        assert served or (path, method) in routes, (path, method)
    # Every response status a route can give for bad input is documented (401 and 429:
    # AUTH=keys and the tenants' quotas, the edge's RATE_LIMIT).
    assert set(document["paths"]["/v1/ocr"]["post"]["responses"]) == {
        "200", "400", "401", "413", "429", "500", "503", "504",
    }  # fmt: skip
    assert set(document["paths"]["/ocr"]["post"]["responses"]) == {
        "200", "401", "413", "422", "429", "500", "503",
    }  # fmt: skip
    schemes = document["components"]["securitySchemes"]
    assert {schemes["bearerAuth"]["scheme"], schemes["apiKey"]["name"]} == {"bearer", "X-Api-Key"}
    assert {} in document["security"]  # optional: with AUTH unset no key is asked for
    json.dumps(document)  # plain JSON, no YAML leftovers


def test_cases_were_run() -> None:
    """Report generated cases per operation, phase and outcome (visible with ``-s``)."""
    if not CASES:
        pytest.skip("run with test_openapi_operations to count its cases")
    per_operation: Counter[str] = Counter()
    for (operation, phase, mode, status), n in sorted(CASES.items()):
        per_operation[operation] += n
        print(f"schemathesis: {operation:13s} {phase:9s} {mode:9s} HTTP {status}: {n}")
    server_errors = sum(n for (_, _, _, status), n in CASES.items() if status >= 500)
    total = sum(per_operation.values())
    print(f"schemathesis: {total} cases ({dict(per_operation)}), 5xx: {server_errors}")
    assert server_errors == 0
    assert set(per_operation) == set(OPERATIONS)
