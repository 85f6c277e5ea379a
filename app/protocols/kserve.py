"""The Open Inference Protocol (KServe v2, as Triton speaks it): the served models, their
tensors and the protocol's errors, whichever transport carries them (HTTP/REST:
``app/routes/kserve.py``; gRPC ``inference.GRPCInferenceService``: ``app/grpc_kserve.py``; the
models at work: ``kserve_models.py``).

Two models, one version each (``1``):

- ``ocr``: PaddleX high-stability serving's general OCR pipeline. Input ``input`` and output
  ``output``, BYTES, shape [1, 1]: the compact JSON of a basic-serving ``POST /ocr`` body in,
  that endpoint's envelope (``logId``, ``errorCode``, ``errorMsg``, ``result``) out. As
  PaddleX's HPS server does, a request that fails validation is an answer whose envelope
  carries ``errorCode`` 422, and a failure inside one with 500; load, quotas and keys are the
  protocol's own errors (503, 429, 401).
- ``ocr-image``: any v2 client. Input ``image``, BYTES, shape [-1] (encoded images); output
  ``result``, the same shape, each element the JSON of ``POST /v1/ocr``'s answer for its
  image (each image its own cache entry).

BYTES elements travel as Triton serializes them in raw contents and in the HTTP binary data
extension: each a 4-byte little-endian length, then its bytes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from app.vocabulary import OcrCacheError

BYTES = "BYTES"
VERSION = "1"
SERVER_NAME = "ocr-cache"
SERVER_VERSION = "2.73.0"  # the Triton protocol release whose clients the tests run
EXTENSIONS = ("binary_tensor_data", "model_repository", "model_configuration")
PLATFORM = "ocr_cache"
_LENGTH = struct.Struct("<I")

# HTTP status -> gRPC status code name, as Triton maps its errors.
GRPC_CODES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


class V2Error(OcrCacheError):
    """A protocol error: HTTP ``status`` (``{"error": message}``), the gRPC code of the same
    meaning, and ``retry_after`` seconds for load and quotas (0: none)."""

    code = "kserve_error"

    def __init__(self, message: str, status: int = 400, retry_after: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after

    @property
    def grpc_code(self) -> str:
        return GRPC_CODES.get(self.status, "INTERNAL")

    def body(self) -> bytes:
        return error_body(str(self))


def error_body(message: str) -> bytes:
    """Triton's error form over HTTP."""
    return orjson.dumps({"error": message})


@dataclass(frozen=True)
class TensorSpec:
    """A model's input or output as its metadata declares it."""

    name: str
    shape: tuple[int, ...]  # -1: any size
    datatype: str = BYTES

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True)
class Model:
    name: str
    input: TensorSpec
    output: TensorSpec
    description: str
    batch: bool  # its first dimension is the batch (``max_batch_size`` > 0 in its config)

    def metadata(self, fingerprint: str) -> dict[str, Any]:
        """``GET /v2/models/{name}``, ``ModelMetadata``: the engine's fingerprint among the
        parameters (in gRPC's form there, a map of strings)."""
        return {
            "name": self.name,
            "versions": [VERSION],
            "platform": PLATFORM,
            "inputs": [self.input.metadata()],
            "outputs": [self.output.metadata()],
            "parameters": {"engine_fingerprint": fingerprint, "description": self.description},
        }

    def max_elements(self, max_images: int) -> int:
        """The most elements its input may hold: one request for ``ocr`` (max_batch_size
        1), ``MAX_IMAGES_PER_REQUEST`` images for ``ocr-image``."""
        return 1 if self.batch else max_images

    def config(self, fingerprint: str) -> dict[str, Any]:
        """Triton's model configuration in its JSON form (``GET .../config``); the gRPC
        answer is the same fields as a ``ModelConfig`` message. A batching model's dims leave
        out the batch dimension; the engine's fingerprint is among its parameters."""
        dims = list(self.input.shape[1:] if self.batch else self.input.shape)
        out_dims = list(self.output.shape[1:] if self.batch else self.output.shape)
        return {
            "name": self.name,
            "platform": PLATFORM,
            "backend": "python",
            "max_batch_size": 1 if self.batch else 0,
            "input": [{"name": self.input.name, "data_type": "TYPE_STRING", "dims": dims}],
            "output": [{"name": self.output.name, "data_type": "TYPE_STRING", "dims": out_dims}],
            "version_policy": {"specific": {"versions": [int(VERSION)]}},
            "parameters": {"engine_fingerprint": {"string_value": fingerprint}},
        }


PADDLEX_OCR = Model(
    "ocr",
    TensorSpec("input", (-1, 1)),
    TensorSpec("output", (-1, 1)),
    "PaddleX high-stability serving: the JSON of a POST /ocr body in, its envelope out",
    batch=True,
)
OCR_IMAGE = Model(
    "ocr-image",
    TensorSpec("image", (-1,)),
    TensorSpec("result", (-1,)),
    "encoded images in, the JSON of POST /v1/ocr's answer for each out",
    batch=False,
)
MODELS = {model.name: model for model in (PADDLEX_OCR, OCR_IMAGE)}


def find(name: str, version: str = "") -> Model:
    """The model ``name`` at ``version`` ("" or "1"); anything else is 404 / NOT_FOUND."""
    model = MODELS.get(name)
    if model is None:
        raise V2Error(f"Request for unknown model: '{name}' is not found", 404)
    if version not in ("", VERSION):
        raise V2Error(f"Request for unknown model: '{name}' version {version} is not found", 404)
    return model


def server_metadata() -> dict[str, Any]:
    return {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": list(EXTENSIONS)}


def repository_index() -> list[dict[str, str]]:
    return [{"name": name, "version": VERSION, "state": "READY"} for name in MODELS]


@dataclass(frozen=True)
class Tensor:
    """A BYTES tensor: its elements in row-major order."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    elements: list[bytes] = field(default_factory=list)


def element_count(shape: Sequence[int]) -> int:
    return math.prod(shape)


def decode_bytes(raw: bytes | memoryview, count: int, name: str) -> list[bytes]:
    """``count`` BYTES elements from their serialized form (4-byte little-endian length,
    then the bytes, each), which must be exactly ``raw``."""
    view = memoryview(raw)
    elements: list[bytes] = []
    offset = 0
    while offset < len(view):
        if offset + 4 > len(view):
            raise V2Error(f"input '{name}': a BYTES element's length is cut short")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > len(view):
            raise V2Error(f"input '{name}': a BYTES element runs past its data")
        elements.append(bytes(view[offset : offset + length]))
        offset += length
        if len(elements) > count:
            break
    if len(elements) != count:
        held = "more" if len(elements) > count else str(len(elements))
        raise V2Error(f"input '{name}': its data holds {held} BYTES elements, its shape {count}")
    return elements


def encode_bytes(elements: Sequence[bytes]) -> bytes:
    return b"".join(_LENGTH.pack(len(e)) + e for e in elements)


def checked_shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list | tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise V2Error(f"input '{name}': shape must be a list of non-negative integers")
    return tuple(shape)


def the_input(model: Model, inputs: Sequence[Tensor]) -> Tensor:
    """The model's one input, its datatype and shape checked against the model's."""
    if len(inputs) != 1 or inputs[0].name != model.input.name:
        names = [t.name for t in inputs]
        raise V2Error(f"model '{model.name}' expects one input '{model.input.name}', got {names}")
    tensor = inputs[0]
    if tensor.datatype != BYTES:
        raise V2Error(
            f"inference input '{tensor.name}' data-type is '{tensor.datatype}', but model "
            f"'{model.name}' expects '{BYTES}'"
        )
    expected = model.input.shape
    fits = len(tensor.shape) == len(expected) and all(
        want in (-1, got) for want, got in zip(expected, tensor.shape, strict=True)
    )
    if not fits or element_count(tensor.shape) == 0:
        raise V2Error(
            f"unexpected shape for input '{tensor.name}' for model '{model.name}'. Expected "
            f"{list(expected)}, got {list(tensor.shape)} (at least one element)"
        )
    if model.batch and tensor.shape[0] > 1:  # max_batch_size 1, as PaddleX's HPS config
        raise V2Error(
            f"inference request batch-size must be <= 1 for '{model.name}' (got {tensor.shape[0]})"
        )
    return tensor


def requested_outputs(model: Model, names: Sequence[str]) -> None:
    """Requested outputs must be the model's (none requested: all of them)."""
    for name in names:
        if name != model.output.name:
            raise V2Error(f"model '{model.name}' has no output '{name}'")


def output(model: Model, shape: tuple[int, ...], elements: list[bytes]) -> Tensor:
    return Tensor(model.output.name, BYTES, shape, elements)
