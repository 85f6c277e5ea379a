"""Mutation fuzzing of the image decoders over real corpus files of every accepted format
(issue 11 §3): 0 uncaught exceptions, 0 5xx. ``make test`` runs a fixed number of cases;
``make fuzz`` many more (``FUZZ_CASES``, ``FUZZ_PROTOCOL_CASES``, ``FUZZ_SEED``). A failure
names its (seed, index): ``tests.image_fuzz.case(seed, index)`` rebuilds the input."""

from __future__ import annotations

import base64
import io
import os
from collections import Counter

import grpc
import pytest

from app.imaging import ImageTooLarge, InvalidImage, decode_image
from app.protocols.pipeline_stubs import pb2, pb2_grpc
from tests.helpers import b64
from tests.image_fuzz import SEEDS, case, cases

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEED = int(os.environ.get("FUZZ_SEED", "1"))
CASES = int(os.environ.get("FUZZ_CASES", "3000"))
PROTOCOL_CASES = int(os.environ.get("FUZZ_PROTOCOL_CASES", "40"))
LIMIT = 60_000_000


def test_seeds_cover_every_accepted_format() -> None:
    from PIL import Image

    from app.imaging import FORMATS

    formats = {Image.open(io.BytesIO(data)).format for _, data in SEEDS}
    assert set(FORMATS) <= formats | {"MPO"} and "MPO" in formats
    for _, data in SEEDS:
        decode_image(data, LIMIT)  # every seed is a valid image


def test_decoder_never_raises_anything_but_invalid_image() -> None:
    outcomes: Counter[str] = Counter()
    uncaught: list[str] = []
    for index, name, data in cases(SEED, CASES):
        try:
            image = decode_image(data, LIMIT)
        except ImageTooLarge:
            outcomes["refused: too large"] += 1
        except InvalidImage:
            outcomes["refused: invalid"] += 1
        except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
            uncaught.append(f"case({SEED}, {index}) from {name}: {type(exc).__name__}: {exc}")
        else:
            assert image.pixels.shape == (image.height, image.width, 3)
            outcomes["decoded"] += 1
    print(f"\nimage fuzz (decoder): {CASES} cases from {len(SEEDS)} seeds, seed {SEED}: "
          f"{dict(outcomes)}, uncaught {len(uncaught)}")  # fmt: skip
    assert not uncaught, uncaught[:20]


def test_protocols_answer_mutated_images_without_server_errors(grpc_front, redis_client) -> None:
    """Every case over REST, pipeline HTTP, PaddleX and gRPC: a result or the protocol's
    client error, never a 5xx or a gRPC error status."""
    app, endpoint = grpc_front()
    client = app.test_client()
    stub = pb2_grpc.PipelineServiceStub(grpc.insecure_channel(endpoint))
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    for index in range(PROTOCOL_CASES):
        name, data = case(SEED + 1000, index)
        where = f"case({SEED + 1000}, {index}) from {name}"
        rest = client.post("/v1/ocr", json={"image": b64(data)})
        pipeline = client.post("/ocr/prediction", json={"key": ["image"], "value": [b64(data)]})
        paddlex = client.post("/ocr", json={"file": b64(data), "fileType": 1})
        try:
            reply = stub.inference(
                pb2.Request(key=["image"], value=[base64.b64encode(data).decode()]), timeout=120
            )
            grpc_outcome = f"err_no {reply.err_no}"
        except grpc.RpcError as exc:
            grpc_outcome = f"status {exc.code().name}"
        seen = (
            f"REST {rest.status_code}",
            f"pipeline err_no {pipeline.get_json()['err_no']}",
            f"PaddleX {paddlex.status_code}",
            f"gRPC {grpc_outcome}",
        )
        outcomes.update(seen)
        if seen not in (
            ("REST 200", "pipeline err_no 0", "PaddleX 200", "gRPC err_no 0"),
            ("REST 400", "pipeline err_no 10000", "PaddleX 422", "gRPC err_no 10000"),
        ):
            failures.append(f"{where}: {seen}")
    print(f"\nimage fuzz (protocols): {PROTOCOL_CASES} cases x 4 protocols: {dict(outcomes)}")
    assert not failures, failures[:20]
    assert client.get("/readyz").status_code == 200


def _pdf_seeds() -> list[bytes]:
    """PDFs (PaddleX ``fileType 0``): a corpus word crop saved by Pillow as a one-page PDF
    (an embedded JPEG stream), and as two pages."""
    from PIL import Image

    from tests.conftest import WORD_EN

    word = Image.open(WORD_EN).convert("RGB")
    out = []
    for extra in ({}, {"save_all": True, "append_images": [word.rotate(180)]}):
        buf = io.BytesIO()
        word.save(buf, "PDF", resolution=72.0, **extra)
        out.append(buf.getvalue())
    return out


def test_paddlex_answers_mutated_pdfs_without_server_errors(make_app, redis_client) -> None:
    import random

    from tests.image_fuzz import mutate

    client = make_app().test_client()
    seeds = _pdf_seeds()
    outcomes: Counter[int] = Counter()
    failures = []
    for index in range(PROTOCOL_CASES):
        data = mutate(random.Random(f"pdf:{SEED}:{index}"), seeds[index % len(seeds)])
        resp = client.post("/ocr", json={"file": b64(data), "fileType": 0})
        outcomes[resp.status_code] += 1
        if resp.status_code not in (200, 422):
            failures.append(f"pdf case {index} (seed {SEED}): {resp.status_code}")
    print(f"\nimage fuzz (PaddleX PDFs): {PROTOCOL_CASES} cases: {dict(outcomes)}")
    assert not failures, failures[:20]
