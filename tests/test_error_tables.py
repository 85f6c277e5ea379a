"""One exception root, and each protocol's error mapping as a table (issue 13 §3-4): the
tables answer each error as the routes always have, read through one lookup."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import app
from app.imaging import ImageTooLarge, InvalidImage
from app.protocols import paddlex, pipeline, rest
from app.protocols.errors import BadRequest, lookup
from app.protocols.pipeline_http import GatewayError
from app.vocabulary import (
    ClientError,
    EngineBusy,
    EngineError,
    EngineTimeout,
    OcrCacheError,
    UnsupportedParams,
)

pytestmark = pytest.mark.unit

# Control flow private to a process of its own (the CLI client, the trace receiver).
OUTSIDE_THE_ROOT = {"app.cli.CliError", "app.cli_jobs.Transient", "app.trace_receiver.Refused"}


def test_every_error_of_the_service_joins_the_root():
    found = set()
    for info in pkgutil.walk_packages(app.__path__, "app."):
        if info.name == "app.__main__":
            continue
        module = importlib.import_module(info.name)
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and issubclass(cls, BaseException):
                found.add(f"{info.name}.{name}")
                if f"{info.name}.{name}" not in OUTSIDE_THE_ROOT:
                    assert issubclass(cls, OcrCacheError), f"{info.name}.{name}"
    assert {"app.protocols.pipeline.PipelineError", "app.engines.retry.Transient"} <= found


def test_lookup_takes_the_nearest_class():
    assert lookup({InvalidImage: "a", ClientError: "b"}, ImageTooLarge("x")) == "a"
    assert lookup({ClientError: "b"}, BadRequest("x")) == "b"
    assert lookup({EngineError: 1}, ValueError("x")) is None


def test_rest_statuses_and_codes():
    cases = [
        (BadRequest("x", "invalid_field"), 400, "invalid_field"),
        (InvalidImage("x"), 400, "invalid_image"),
        (UnsupportedParams("x"), 400, "unsupported_params"),
        (EngineBusy("x", 1), 503, "engine_busy"),
        (EngineTimeout("x"), 504, "engine_timeout"),
        (EngineError("x"), 503, "engine_error"),
    ]
    for exc, status, code in cases:
        assert isinstance(exc, rest.CAUGHT)
        assert (lookup(rest.ERRORS, exc), exc.code) == (status, code)


def test_paddlex_statuses_and_messages():
    assert lookup(paddlex.ERRORS, ImageTooLarge("x")) == (422, None)
    assert lookup(paddlex.ERRORS, InvalidImage("x")) == (422, paddlex.INVALID_FILE)
    assert lookup(paddlex.ERRORS, UnsupportedParams("x")) == (422, None)
    assert lookup(paddlex.ERRORS, EngineBusy("x", 1)) == (503, None)
    assert lookup(paddlex.ERRORS, EngineTimeout("x")) == (500, None)


def test_pipeline_err_no():
    req = pipeline.PipelineRequest(images=[("image", "")], logid=7)
    assert pipeline.failure(req, EngineTimeout("slow")).err_no == pipeline.TIMEOUT
    assert "FunctionName: process" in pipeline.failure(req, EngineTimeout("slow")).err_msg
    failed = pipeline.failure(req, InvalidImage("bad"))
    assert (failed.err_no, "FunctionName: preprocess" in failed.err_msg) == (
        pipeline.UNKNOWN_ERROR,
        True,
    )
    own = pipeline.PipelineError(pipeline.TYPE_ERROR, "no")
    assert pipeline.failure(req, own).err_no == pipeline.TYPE_ERROR
    assert pipeline.refused(BadRequest("ttl")).err_no == pipeline.INPUT_PARAMS_ERROR
    assert pipeline.refused(own).err_no == pipeline.TYPE_ERROR
    assert issubclass(GatewayError, ClientError)
