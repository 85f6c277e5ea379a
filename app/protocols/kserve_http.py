"""The Open Inference Protocol's HTTP/REST body (``POST /v2/models/{name}[/versions/{v}]/infer``):
JSON tensors, and Triton's binary tensor data extension, which ``tritonclient.http`` uses by
default for BYTES: the header ``Inference-Header-Content-Length`` gives the JSON's length, and
the binary data of the inputs that declare ``parameters.binary_data_size`` follows it, in
their order. An answer's outputs are binary when the request asks so (an output's
``parameters.binary_data``, or the request's ``parameters.binary_data_output``), else JSON.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import orjson

from app.protocols.kserve import (
    BYTES,
    VERSION,
    Model,
    Tensor,
    V2Error,
    checked_shape,
    decode_bytes,
    element_count,
    encode_bytes,
)

HEADER_LENGTH = "Inference-Header-Content-Length"
OCTETS = "application/octet-stream"
JSON = "application/json"


_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}  # deflate: zlib's format


def decompressed(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body a client compressed (``Content-Encoding`` gzip or deflate, which
    ``tritonclient.http`` offers), at most ``limit`` bytes once inflated."""
    encoding = (encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return body
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise V2Error(f"Unsupported compression type {encoding[:40]!r}: gzip or deflate")
    inflater = zlib.decompressobj(wbits)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise V2Error(f"the {encoding} body could not be inflated: {exc}") from None
    if len(data) > limit or inflater.unconsumed_tail:
        raise V2Error(f"the {encoding} body inflates past {limit} bytes (MAX_REQUEST_BYTES)")
    if not inflater.eof:
        raise V2Error(f"the {encoding} body is cut short")
    return data


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    inputs: list[Tensor]
    outputs: dict[str, bool]  # requested outputs: name -> binary
    binary_output: bool  # the request's default for outputs not named


def parse(body: bytes, header_length: str | None, max_elements: int) -> InferRequest:
    """The request's tensors; any malformation is a 400 that says what. A tensor whose shape
    holds more than ``max_elements`` is refused before its data is read."""
    view = memoryview(body)
    if header_length is None:
        head, rest = view, view[len(view) :]
    else:
        try:
            length = int(header_length)
        except ValueError:
            raise V2Error(f"{HEADER_LENGTH} is not an integer: {header_length[:40]!r}") from None
        if not 0 <= length <= len(view):
            raise V2Error(f"{HEADER_LENGTH} {length} is past the body's {len(view)} bytes")
        head, rest = view[:length], view[length:]
    try:
        request = orjson.loads(head)
    except orjson.JSONDecodeError as exc:
        raise V2Error(f"failed to parse the request JSON: {exc}") from None
    if not isinstance(request, dict):
        raise V2Error("the request JSON must be an object")
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise V2Error("the request needs 'inputs', a non-empty list")
    tensors: list[Tensor] = []
    offset = 0
    for raw in inputs:
        tensor, used = _input(raw, rest[offset:], max_elements)
        tensors.append(tensor)
        offset += used
    if offset != len(rest):
        raise V2Error(
            f"{len(rest) - offset} bytes of binary data past what the inputs' binary_data_size "
            "declare"
        )
    outputs: dict[str, bool] = {}
    for raw in _list(request.get("outputs", []), "outputs"):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise V2Error("each requested output needs a 'name'")
        outputs[raw["name"]] = _flag(_parameters(raw).get("binary_data", False), "binary_data")
    parameters = _parameters(request)
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise V2Error("'id' must be a string")
    return InferRequest(
        request_id,
        tensors,
        outputs,
        _flag(parameters.get("binary_data_output", False), "binary_data_output"),
    )


def _input(raw: Any, binary: memoryview, max_elements: int) -> tuple[Tensor, int]:
    """One input and how many bytes of the binary data it took."""
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise V2Error("each input needs a 'name' (a string)")
    name = raw["name"]
    datatype = raw.get("datatype")
    if not isinstance(datatype, str):
        raise V2Error(f"input '{name}' needs a 'datatype'")
    if datatype != BYTES:
        raise V2Error(f"input '{name}': datatype {datatype!r}; this server's models take BYTES")
    shape = checked_shape(name, raw.get("shape"))
    count = element_count(shape)
    if count > max_elements:
        raise V2Error(
            f"input '{name}': shape {list(shape)} holds more than {max_elements} elements"
        )
    size = _parameters(raw).get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise V2Error(f"input '{name}': binary_data_size must be a non-negative integer")
        if size > len(binary):
            raise V2Error(
                f"input '{name}': binary_data_size {size} is past the {len(binary)} bytes of "
                "binary data left"
            )
        if "data" in raw:
            raise V2Error(f"input '{name}' has both 'data' and binary_data_size")
        return Tensor(name, datatype, shape, decode_bytes(binary[:size], count, name)), size
    data = raw.get("data")
    if data is None:
        raise V2Error(f"input '{name}' has neither 'data' nor binary_data_size")
    elements = _flatten(data, name, shape)
    if len(elements) != count:
        held = "more" if len(elements) > count else str(len(elements))
        raise V2Error(
            f"input '{name}': {held} elements in 'data', {count} in its shape {list(shape)}"
        )
    return Tensor(name, datatype, shape, elements), 0


def _flatten(data: Any, name: str, shape: tuple[int, ...]) -> list[bytes]:
    """JSON BYTES data: strings, in a flat or a nested (row-major) list no deeper than the
    shape; no more than the shape's count of them read (a loop, not recursion: JSON may nest
    past Python's stack)."""
    count, rank = element_count(shape), max(1, len(shape))
    found: list[bytes] = []
    pending: list[tuple[Any, int]] = [(data, 0)]
    while pending and len(found) <= count:
        item, depth = pending.pop()
        if isinstance(item, str):
            found.append(item.encode())
        elif not isinstance(item, list):
            raise V2Error(f"input '{name}': BYTES data must be strings")
        elif depth >= rank:
            raise V2Error(f"input '{name}': 'data' nested deeper than its shape {list(shape)}")
        else:
            pending.extend((child, depth + 1) for child in reversed(item))
    return found


def _parameters(raw: dict[str, Any]) -> dict[str, Any]:
    parameters = raw.get("parameters", {})
    if not isinstance(parameters, dict):
        raise V2Error("'parameters' must be an object")
    return parameters


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise V2Error(f"'{what}' must be a list")
    return value


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise V2Error(f"'{what}' must be true or false")
    return value


def render(
    model: Model, request: InferRequest, outputs: list[Tensor]
) -> tuple[bytes, list[tuple[str, str]]]:
    """The answer's body and headers: JSON, or JSON then the binary outputs."""
    described: list[dict[str, Any]] = []
    binary: list[bytes] = []
    for tensor in outputs:
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if request.outputs.get(tensor.name, request.binary_output):
            data = encode_bytes(tensor.elements)
            entry["parameters"] = {"binary_data_size": len(data)}
            binary.append(data)
        else:
            entry["data"] = [e.decode("utf-8", "replace") for e in tensor.elements]
        described.append(entry)
    answer: dict[str, Any] = {"model_name": model.name, "model_version": VERSION}
    if request.id:  # as Triton: an empty id is not echoed
        answer["id"] = request.id
    answer["outputs"] = described
    head = orjson.dumps(answer)
    if not binary:
        return head, [("Content-Type", JSON)]
    headers = [("Content-Type", OCTETS), (HEADER_LENGTH, str(len(head)))]
    return head + b"".join(binary), headers
