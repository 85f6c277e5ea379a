"""A result never crosses inputs, also under concurrency (issue 11 §1).

Two different images with one MD5 share a Redis key, but nothing may share a *result* across
them: not the in-process single-flight, not the cross-process queue, not L1. Each round
builds a fresh colliding pair from two real corpus JPEGs with different text
(``tests/md5_collisions.py``), sends both images several times at once over one protocol,
and checks every answer against the one the plain source image gets.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from app.imaging import decode_image
from app.protocols.pipeline_stubs import pb2, pb2_grpc
from tests.conftest import CORPUS
from tests.helpers import b64
from tests.md5_collisions import at_once, colliding_jpegs, shared_pairs

pytestmark = pytest.mark.integration

# Two real word crops with different text and sizes (both recognized by the engine).
FIRST = (CORPUS / "mmocr_rec_1036169.jpg").read_bytes()  # "03/09/2009", 119x25
SECOND = (CORPUS / "paddleocr_word_ru_1.jpg").read_bytes()  # Cyrillic word, 552x48
ROUNDS = 6
COPIES = 3  # of each image of the pair, all sent at once

Send = Callable[[bytes], Any]


def _rest(client) -> Send:  # type: ignore[no-untyped-def]
    def send(data: bytes) -> Any:
        resp = client.post("/v1/ocr", json={"image": b64(data)})
        assert resp.status_code == 200, resp.text
        body = resp.get_json()
        return body["width"], body["height"], body["lines"]

    return send


def _pipeline(client) -> Send:  # type: ignore[no-untyped-def]
    def send(data: bytes) -> Any:
        resp = client.post("/ocr/prediction", json={"key": ["image"], "value": [b64(data)]})
        body = resp.get_json()
        assert body["err_no"] == 0, body
        return body["value"]

    return send


def _paddlex(client) -> Send:  # type: ignore[no-untyped-def]
    def send(data: bytes) -> Any:
        resp = client.post("/ocr", json={"file": b64(data), "fileType": 1})
        assert resp.status_code == 200, resp.text
        result = resp.get_json()["result"]
        pruned = result["ocrResults"][0]["prunedResult"]
        return result["dataInfo"], pruned["rec_texts"], pruned["rec_polys"]

    return send


def _grpc(endpoint: str) -> Send:
    stub = pb2_grpc.PipelineServiceStub(grpc.insecure_channel(endpoint))

    def send(data: bytes) -> Any:
        request = pb2.Request(key=["image"], value=[base64.b64encode(data).decode()])
        reply = stub.inference(request, timeout=120)
        assert reply.err_no == 0, reply.err_msg
        return list(reply.value)

    return send


def crossed(sends: list[Send], rounds: int = ROUNDS, tag: str = "") -> int:
    """Fire ``COPIES`` of each image of a fresh colliding pair at once, ``rounds`` times;
    the number of answers that differ from the source image's own answer."""
    expected = {FIRST: sends[0](FIRST), SECOND: sends[0](SECOND)}
    assert expected[FIRST] != expected[SECOND]  # otherwise a crossing could not show

    def right(job: tuple[int, bytes, bytes]) -> bool:
        sender, data, source = job
        return sends[sender % len(sends)](data) == expected[source]

    wrong = 0
    for r in range(rounds):
        a, b = colliding_jpegs(FIRST, SECOND, nonce=f"{tag}{r}".encode())
        pairs = [(a, FIRST), (b, SECOND)] * COPIES
        wrong += at_once(right, [(i, data, source) for i, (data, source) in enumerate(pairs)])
        # Later requests for the pair (hits, or recomputations) answer right too.
        wrong += (sends[0](a) != expected[FIRST]) + (sends[-1](b) != expected[SECOND])
    return wrong


def test_generated_pairs_collide_and_decode_to_their_sources():
    for n in range(20):
        a, b = colliding_jpegs(FIRST, SECOND, nonce=n.to_bytes(2, "big"))
        assert hashlib.md5(a).digest() == hashlib.md5(b).digest()
        assert hashlib.sha256(a).digest() != hashlib.sha256(b).digest()
        for data, source in ((a, FIRST), (b, SECOND)):
            got, want = decode_image(data, 10**7), decode_image(source, 10**7)
            assert (got.pixels == want.pixels).all()


@pytest.mark.parametrize("pair", shared_pairs(), ids=lambda p: p[0].name)
def test_shared_pairs_are_two_decodable_pictures(pair):
    a, b = (path.read_bytes() for path in pair)
    assert a != b and hashlib.md5(a).digest() == hashlib.md5(b).digest()
    first, second = decode_image(a, 10**7), decode_image(b, 10**7)
    assert first.pixels.shape == second.pixels.shape
    assert (first.pixels != second.pixels).any()


@pytest.mark.parametrize("protocol", ["rest", "pipeline", "paddlex"])
def test_concurrent_colliding_pairs_never_cross_one_process(make_app, protocol):
    client = make_app().test_client()
    send = {"rest": _rest, "pipeline": _pipeline, "paddlex": _paddlex}[protocol](client)
    assert crossed([send], tag=protocol) == 0


def test_concurrent_colliding_pairs_never_cross_grpc(grpc_front):
    _, endpoint = grpc_front()
    assert crossed([_grpc(endpoint)], tag="grpc") == 0


def test_concurrent_colliding_pairs_never_cross_with_l1(make_app):
    client = make_app(cache_l1_bytes=1 << 20).test_client()
    assert crossed([_rest(client)], tag="l1") == 0


def test_colliding_pairs_never_cross_between_caches_sharing_redis(make_app):
    """Two app instances share only Redis (like two workers or replicas); each sends one
    image of the pair, so the only sharing path is the global queue (a ticket per key and
    SHA-256) and the entry its waiter reads, which must not be the other image's."""
    clients = [make_app(cache_l1_bytes=1 << 20).test_client() for _ in range(2)]
    assert crossed([_rest(clients[0]), _rest(clients[1])], tag="two") == 0


# --- HunyuanOCR extraction: field-subset reuse ---------------------------------------------


@pytest.fixture()
def hunyuan_client(base_settings, redis_client):  # type: ignore[no-untyped-def]
    """A hunyuan front whose stand-in model answers each field with the SHA-256 of the image
    it was sent, so an answer taken from the other image of a pair shows."""
    from app.engines.hunyuan import HunyuanEngine
    from app.web import create_app
    from tests.conftest import CORPUS as corpus
    from tests.fake_vllm import FakeVllm
    from tests.test_hunyuan import hunyuan_settings

    def respond(image: bytes, prompt: str) -> str:
        names = ast.literal_eval(prompt[prompt.index("[") : prompt.rindex("]") + 1])
        identity = hashlib.sha256(image).hexdigest()
        return json.dumps({name: identity for name in names})

    fake = FakeVllm(corpus).start()
    fake.respond = respond
    settings = hunyuan_settings(base_settings, fake)
    app = create_app(settings, engine=HunyuanEngine.from_settings(settings))
    app.testing = True
    yield app.test_client()
    fake.stop()


def test_extraction_subset_reuse_never_crosses_a_colliding_pair(hunyuan_client):
    def extract(data: bytes, fields: list[str]):  # type: ignore[no-untyped-def]
        resp = hunyuan_client.post(
            "/v1/ocr", json={"image": b64(data), "task": "extraction", "fields": fields}
        )
        assert resp.status_code == 200, resp.get_json()
        return resp.headers["X-Cache"], resp.get_json()["data"]

    for r in range(ROUNDS):
        a, b = colliding_jpegs(FIRST, SECOND, nonce=f"hunyuan{r}".encode())
        sha_a, sha_b = (hashlib.sha256(x).hexdigest() for x in (a, b))
        # A's wide extraction lists its field set under the shared (MD5) index key.
        assert extract(a, ["name", "number"]) == ("MISS", {"name": sha_a, "number": sha_a})
        # B asks for a subset: A's entry must not be projected onto B.
        assert extract(b, ["name"]) == ("MISS", {"name": sha_b})
        assert extract(a, ["number"])[1] == {"number": sha_a}
        # Both images at once, wide and narrow.
        wide, narrow = ["name", "number", "date"], ["date"]
        jobs = [(a, wide, sha_a), (b, wide, sha_b), (a, narrow, sha_a), (b, narrow, sha_b)] * 2
        assert (
            at_once(lambda job: extract(job[0], job[1])[1] == dict.fromkeys(job[1], job[2]), jobs)
            == 0
        )
