"""OCR_ENGINE=hunyuan: HunyuanOCR behind vLLM's OpenAI-compatible API, cached by our front.

vLLM and the HunyuanOCR weights cannot run here (no GPU, no hub). The engine's real client
code (the official ``openai`` client, its pooled HTTP client, our retries and timeouts) talks
to ``tests/fake_vllm.py``: a local stand-in that implements the chat-completions protocol,
rejects what vLLM would reject, and answers recorded-style outputs written by hand for two
corpus images. These tests therefore check the request shape, the parsing, coordinate
conversion, rendering, keys, reuse and failure handling, never the model's accuracy.
Redis is the real private server from conftest.
"""

from __future__ import annotations

import ast
import io
import threading
import time

import grpc
import openai
import pytest

from app.cache.keys import digest_image
from app.config import ConfigError, Settings
from app.engines.hunyuan import HunyuanEngine
from app.engines.hunyuan_output import (
    parse_extraction,
    parse_spotting,
    strip_repeated_tail,
    to_pixels,
)
from app.engines.paddle import PaddleOcrEngine
from app.engines.serving import ServingEngine
from app.engines.tasks import task_params
from app.vocabulary import EngineError, OcrLine, OcrParams, OcrResult, UnsupportedParams
from app.web import create_app
from tests.conftest import CORPUS, PHOTOTEST
from tests.fake_vllm import SPOTTING_10, FakeVllm
from tests.fleet import wait_for
from tests.helpers import b64, stored_keys

pytestmark = pytest.mark.integration  # an OpenAI-protocol server (tests/fake_vllm.py)

REVISION = "47644ecc4fc854efa4f505155158831f36773ee4"
OTHER_REVISION = "449e7d471a8a1ef5bd5d652e4881183d7252cbc7"
PASSPORT = CORPUS / "passporteye_pass_fin.png"
EXIF_ROTATED = CORPUS / "rapidocr_img_exif_orientation.jpg"
PHOTOTEST_LINES = PHOTOTEST.with_suffix(".txt").read_text().split("\n")


@pytest.fixture(scope="module")
def fake():  # type: ignore[no-untyped-def]
    server = FakeVllm(CORPUS).start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _fresh_fake(fake):  # type: ignore[no-untyped-def]
    fake.reset()
    fake.api_key = None


def hunyuan_settings(base_settings: Settings, fake: FakeVllm, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "ocr_engine": "hunyuan",
        "hunyuan_base_url": fake.url,
        "hunyuan_model_revision": REVISION,
        "hunyuan_timeout_seconds": 5.0,
        "hunyuan_retries": 2,
        "hunyuan_startup_wait_seconds": 0.0,
    }
    values.update(overrides)
    return base_settings.with_overrides(**values)


@pytest.fixture()
def front(base_settings, fake, redis_client):  # type: ignore[no-untyped-def]
    def build(**overrides: object):  # type: ignore[no-untyped-def]
        settings = hunyuan_settings(base_settings, fake, **overrides)
        app = create_app(settings, engine=HunyuanEngine.from_settings(settings))
        app.testing = True
        client = app.test_client()
        wait_for(lambda: client.get("/readyz").status_code == 200, 60, "ready",
                 lambda: str(client.get("/readyz").get_json()))  # fmt: skip
        return app, client

    return build


def ocr(client, data: bytes, **fields: object):  # type: ignore[no-untyped-def]
    return client.post("/v1/ocr", json={"image": b64(data), **fields})


def pipeline(client, data: bytes):  # type: ignore[no-untyped-def]
    return client.post("/ocr/prediction", data=f'{{"key":["image"],"value":["{b64(data)}"]}}')


def entry_keys(redis_client) -> list[str]:  # type: ignore[no-untyped-def]
    return sorted(k.decode() for k in redis_client.keys("*") if b"extraction_index" not in k)


def expected_phototest_box(n: int) -> list[list[int]]:
    """Line n's box as the card converts it: int(v * size / 1000), 640 x 480 pixels."""
    top = 187 + round(n * 61.5)
    right = [919, 967, 394, 914, 914, 930, 878, 883][n]
    (x1, y1), (x2, y2) = to_pixels(56, top, 640, 480), to_pixels(right, top + 60, 640, 480)
    return [[x1, y1], [x2, y1], [x2, y2], [x1, y2]]


# --- spotting ---------------------------------------------------------------------------------


def test_spotting_text_form_request_shape_and_pixel_boxes(front, fake):
    _, client = front(hunyuan_model_generation="1.0")
    resp = ocr(client, PHOTOTEST.read_bytes())
    assert resp.status_code == 200 and resp.headers["X-Cache"] == "MISS", resp.get_json()
    body = resp.get_json()
    assert body["task"] == "spotting" and "text" not in body
    assert [ln["text"] for ln in body["lines"]] == [t for t in PHOTOTEST_LINES if t][:8]
    assert (
        body["lines"][0]["box"]
        == expected_phototest_box(0)
        == [[35, 89], [588, 89], [588, 118], [35, 118]]
    )
    assert all(ln["score"] == 1.0 and ln["angle"] == -1 for ln in body["lines"])
    # The request as the card prescribes it.
    (sent,) = fake.bodies
    system, user = sent["messages"]
    assert system == {"role": "system", "content": ""}
    image, prompt = user["content"]
    assert image == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + b64(PHOTOTEST.read_bytes())},
    }
    assert prompt == {"type": "text", "text": SPOTTING_10}
    assert sent["model"] == "tencent/HunyuanOCR" and sent["max_tokens"] == 16384
    assert (sent["temperature"], sent["top_k"], sent["repetition_penalty"]) == (0.0, 1, 1.0)


def test_spotting_json_form_matches_text_form_and_renders_in_every_protocol(front, fake):
    from app import grpc_server

    _, old = front(hunyuan_model_generation="1.0")
    app, client = front(hunyuan_model_generation="1.5")
    data = PHOTOTEST.read_bytes()
    lines_10 = ocr(old, data).get_json()["lines"]
    first = ocr(client, data)
    assert first.headers["X-Cache"] == "MISS" and first.get_json()["lines"] == lines_10
    sent = fake.bodies[-1]
    assert sent["messages"][1]["content"][1]["text"].startswith("检测并识别图中所有的文字行")
    assert (sent["temperature"], sent["top_p"], sent["top_k"]) == (0.0, 1.0, -1)
    assert sent["repetition_penalty"] == 1.08 and sent["skip_special_tokens"] is True
    calls = fake.calls
    # pdserving string over HTTP, same entry.
    pipe = pipeline(client, data)
    assert pipe.headers["X-Cache"] == "HIT"
    value = ast.literal_eval(pipe.get_json()["value"][0])
    assert value[0] == [
        (lines_10[0]["text"], 1.0),
        [[float(x), float(y)] for x, y in expected_phototest_box(0)],
    ]
    assert len(value) == 8
    # PaddleX /ocr, same entry.
    paddlex = client.post("/ocr", json={"file": b64(data), "fileType": 1})
    assert paddlex.status_code == 200 and paddlex.headers["X-Cache"] == "HIT"
    pruned = paddlex.get_json()["result"]["ocrResults"][0]["prunedResult"]
    assert pruned["rec_texts"] == [ln["text"] for ln in lines_10]
    assert pruned["rec_polys"][0] == expected_phototest_box(0)
    assert pruned["rec_boxes"][0] == [35, 89, 588, 118]
    # gRPC PipelineService, same entry.
    ocr_ext = app.extensions["ocr"]
    server, port = grpc_server.start(
        ocr_ext["cache"], ocr_ext["settings"].with_overrides(host="127.0.0.1"), port=0
    )
    try:
        stub = grpc_server.pb2_grpc.PipelineServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        reply, call = stub.inference.with_call(
            grpc_server.pb2.Request(key=["image"], value=[b64(data)]), timeout=10
        )
    finally:
        server.stop(grace=None)
    assert reply.err_no == 0 and list(reply.value) == pipe.get_json()["value"]
    assert dict(call.trailing_metadata())["x-cache"] == "HIT"
    assert fake.calls == calls


def test_exif_rotated_image_is_sent_as_the_decoded_pixels(front, fake):
    _, client = front()
    fake.respond = lambda image, prompt: '[{"box": [0, 0, 1000, 1000], "text": "whole"}]'
    body = ocr(client, EXIF_ROTATED.read_bytes()).get_json()
    url = fake.bodies[0]["messages"][1]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")  # not the JPEG whose EXIF says rotate
    assert body["lines"][0]["box"] == [[0, 0], [752, 0], [752, 306], [0, 306]]


# --- text tasks --------------------------------------------------------------------------------


def test_parsing_and_translation_answer_text_and_key_their_arguments(front, fake, redis_client):
    _, client = front()
    data = PHOTOTEST.read_bytes()
    parsed = ocr(client, data, task="parsing")
    assert parsed.status_code == 200 and parsed.headers["X-Cache"] == "MISS"
    body = parsed.get_json()
    assert body["task"] == "parsing" and body["lines"] == []
    assert body["text"].startswith("This is a lot of 12 point text") and "\n\n" in body["text"]
    assert ocr(client, data, task="PARSING").headers["X-Cache"] == "HIT"
    zh = ocr(client, data, task="translation", target_language="Chinese")
    assert zh.get_json()["text"].startswith("这是一段") and zh.headers["X-Cache"] == "MISS"
    assert (
        ocr(client, data, task="translation", target_language="zh-CN").headers["X-Cache"] == "HIT"
    )
    en = ocr(client, data, task="translation")  # HUNYUAN_TARGET_LANGUAGE=en
    assert en.headers["X-Cache"] == "MISS" and en.get_json()["text"].startswith("This is")
    form = client.post(
        "/v1/ocr",
        data={"file": (io.BytesIO(data), "p.png"), "task": "translation", "target_language": "en"},
        content_type="multipart/form-data",
    )
    assert form.headers["X-Cache"] == "HIT"
    assert fake.calls == 3
    segments = sorted(key.split(":")[3].split("-")[0] for key in entry_keys(redis_client))
    assert segments == ["parsing", "translation", "translation"]
    # The pipeline protocol still serves spotting.
    assert ast.literal_eval(pipeline(client, data).get_json()["value"][0])[0][0][0].startswith(
        "This is a lot"
    )


def test_hunyuan_task_sets_the_rest_default(front):
    _, client = front(hunyuan_task="parsing")
    body = ocr(client, PHOTOTEST.read_bytes()).get_json()
    assert body["task"] == "parsing" and body["text"].startswith("This is a lot")


# --- extraction and field-level reuse -------------------------------------------------------


def test_extraction_fields_are_normalised_and_subsets_reuse_the_entry(front, fake, redis_client):
    _, client = front()
    data = PASSPORT.read_bytes()
    first = ocr(
        client,
        data,
        task="extraction",
        fields=["Surname", " given   names", "PASSPORT NUMBER", "surname"],
    )
    assert first.status_code == 200 and first.headers["X-Cache"] == "MISS", first.get_json()
    body = first.get_json()
    assert body["data"] == {
        "given names": "Maria Olivia",
        "passport number": "XP8271602",
        "surname": "Virtanen",
    }
    assert (
        body["text"] == '{"given names":"Maria Olivia","passport number":"XP8271602",'
        '"surname":"Virtanen"}'
    )
    prompt = fake.bodies[0]["messages"][1]["content"][1]["text"]
    assert prompt == (
        "Extract the content of the fields: ['given names', 'passport number', 'surname'] "
        "from the image and return it in JSON format."
    )
    same = ocr(
        client, data, task="extraction", fields=["surname", "passport number", "Given Names"]
    )
    assert same.headers["X-Cache"] == "HIT"
    subset = ocr(client, data, task="extraction", fields=["passport number", "SURNAME"])
    assert subset.headers["X-Cache"] == "HIT"
    assert subset.get_json()["data"] == {"passport number": "XP8271602", "surname": "Virtanen"}
    form = client.post(
        "/v1/ocr",
        data={"file": (io.BytesIO(data), "p.png"), "task": "extraction", "fields": "surname"},
        content_type="multipart/form-data",
    )
    assert form.headers["X-Cache"] == "HIT" and form.get_json()["data"] == {"surname": "Virtanen"}
    assert fake.calls == 1
    # Not a subset: computed, then its own subsets reuse it.
    wider = ocr(client, data, task="extraction", fields=["surname", "sex"])
    assert wider.headers["X-Cache"] == "MISS" and wider.get_json()["data"]["sex"] == "F"
    assert ocr(client, data, task="extraction", fields=["sex"]).headers["X-Cache"] == "HIT"
    assert fake.calls == 2
    # no-cache recomputes the exact entry; subset reuse is a read, so it is skipped too.
    again = client.post(
        "/v1/ocr",
        json={"image": b64(data), "task": "extraction", "fields": ["sex"]},
        headers={"Cache-Control": "no-cache"},
    )
    assert again.headers["X-Cache"] == "MISS" and fake.calls == 3
    assert len(entry_keys(redis_client)) == 3


def test_a_listed_superset_whose_entry_expired_is_a_miss(front, fake, redis_client):
    _, client = front()
    data = PASSPORT.read_bytes()
    ocr(client, data, task="extraction", fields=["surname", "sex"])
    for key in entry_keys(redis_client):
        redis_client.delete(key)  # evicted; the index still lists the field set
    resp = ocr(client, data, task="extraction", fields=["sex"])
    assert resp.headers["X-Cache"] == "MISS" and resp.get_json()["data"] == {"sex": "F"}
    assert fake.calls == 2


# --- keys ---------------------------------------------------------------------------------------


def test_keys_separate_tasks_arguments_revisions_and_prompt_tables(base_settings, fake):
    from app.cache.keys import KeySpace

    class Keys:  # the key space an engine's front door uses (its prefix and fingerprint)
        def __init__(self, engine: HunyuanEngine) -> None:
            self.engine = engine
            self._keys = KeySpace("ocr", engine.fingerprint)

        def key_for(self, digest, params):  # type: ignore[no-untyped-def]
            return self._keys.entry(digest, self._keys.task(params))

    def cache(**overrides: object) -> Keys:
        return Keys(HunyuanEngine.from_settings(hunyuan_settings(base_settings, fake, **overrides)))

    digest = digest_image(PHOTOTEST.read_bytes())
    base = cache()
    spot = base.engine.default_params
    keys = {
        base.key_for(digest, task_params(spot, "spotting")),
        base.key_for(digest, task_params(spot, "parsing")),
        base.key_for(digest, task_params(spot, "extraction", ["a"])),
        base.key_for(digest, task_params(spot, "extraction", ["a", "b"])),
        base.key_for(digest, task_params(spot, "translation", None, "en")),
        base.key_for(digest, task_params(spot, "translation", None, "zh")),
        cache(hunyuan_model_revision=OTHER_REVISION).key_for(digest, spot),
        cache(hunyuan_model_generation="1.0").key_for(digest, spot),
        cache(hunyuan_model="tencent/HunyuanOCR-other").key_for(digest, spot),
        cache(hunyuan_max_tokens=4096).key_for(digest, spot),
    }
    assert len(keys) == 10
    # Same model anywhere, same entries: the URL is not part of the fingerprint.
    assert cache(hunyuan_base_url="http://10.0.0.1:8000").key_for(digest, spot) == base.key_for(
        digest, spot
    )
    assert task_params(spot, "extraction", ["B", "a", "a "]) == task_params(
        spot, "extraction", ["a", "b"]
    )
    # PaddleOCR's task "ocr" keeps the digests (so the keys) it had before tasks existed.
    assert OcrParams().digest() == "62f08dc5d1f8"
    assert OcrParams(det_limit_side_len=736).digest() == "d718f06fb790"
    assert OcrParams(task="spotting").digest() != OcrParams().digest()


# --- failures -----------------------------------------------------------------------------------


def test_503_and_429_are_retried_with_backoff(front, fake, redis_client):
    _, client = front()
    fake.fail_next(2, 503)
    resp = ocr(client, PHOTOTEST.read_bytes())
    assert resp.status_code == 200 and resp.headers["X-Cache"] == "MISS"
    assert fake.calls == 3
    fake.fail_next(1, 429, retry_after="0.3")
    started = time.monotonic()
    assert ocr(client, PHOTOTEST.read_bytes(), task="parsing").status_code == 200
    assert time.monotonic() - started >= 0.3 and fake.calls == 5


def test_retries_are_bounded_and_failures_are_not_cached(front, fake, redis_client):
    _, client = front(hunyuan_retries=1)
    fake.fail_next(2, 503)
    resp = ocr(client, PHOTOTEST.read_bytes())
    assert resp.status_code == 503 and "unavailable" in resp.get_json()["error"]["message"]
    assert fake.calls == 2
    fake.fail_next(2, 429)
    assert pipeline(client, PHOTOTEST.read_bytes()).get_json()["err_no"] == 10000
    assert stored_keys(redis_client) == []
    fake.fail_next(1, 500)  # not a retried status: one call, an error
    assert ocr(client, PHOTOTEST.read_bytes()).status_code == 503 and fake.calls == 5
    assert ocr(client, PHOTOTEST.read_bytes()).headers["X-Cache"] == "MISS"


def test_timeouts_are_not_retried_and_not_cached(front, fake, redis_client):
    _, client = front(hunyuan_timeout_seconds=0.4)
    fake.delay = 1.0
    resp = ocr(client, PHOTOTEST.read_bytes())
    # 504, not the answer the server sends after 1 s: the call ended at its 0.4 s timeout.
    assert resp.status_code == 504 and "in time" in resp.get_json()["error"]["message"]
    assert fake.calls == 1  # not retried
    assert pipeline(client, PHOTOTEST.read_bytes()).get_json()["err_no"] == 6000
    assert stored_keys(redis_client) == []


@pytest.mark.parametrize(
    ("task", "fields", "answer"),
    [
        ("spotting", None, "some words without any coordinates"),
        ("spotting", None, '[{"box": [1, 2, 3], "text": "three numbers"}]'),
        ("spotting", None, '[{"box": [1, 2, 3, 4], "text": "cut off'),
        ("extraction", ["surname"], "Surname: Virtanen"),
        ("extraction", ["surname"], '```json\n["Virtanen"]\n```'),
    ],
)
def test_unusable_answers_are_engine_errors_never_cached(
    front, fake, redis_client, task, fields, answer
):
    _, client = front()
    fake.respond = lambda image, prompt: answer
    extra = {"task": task, **({"fields": fields} if fields else {})}
    resp = ocr(client, PASSPORT.read_bytes(), **extra)
    assert resp.status_code == 503 and "unusable" in resp.get_json()["error"]["message"]
    assert stored_keys(redis_client) == []
    fake.respond = None
    assert ocr(client, PASSPORT.read_bytes(), **extra).headers["X-Cache"] == "MISS"


# --- what the stand-in and the front refuse ---------------------------------------------------


def test_the_stand_in_rejects_what_vllm_rejects(fake):
    client = openai.OpenAI(base_url=f"{fake.url}/v1", api_key="EMPTY", max_retries=0)
    image = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + b64(PHOTOTEST.read_bytes())},
    }
    good = [
        {"role": "system", "content": ""},
        {"role": "user", "content": [image, {"type": "text", "text": SPOTTING_10}]},
    ]

    def create(**overrides: object) -> object:
        kwargs: dict = {"model": "tencent/HunyuanOCR", "messages": good, "temperature": 0.0}
        kwargs.update(overrides)
        return client.chat.completions.create(**kwargs)

    assert create().choices[0].message.content.startswith("This is a lot")  # type: ignore
    with pytest.raises(openai.NotFoundError):
        create(model="tencent/HunyuanOCR-1.5")
    bad_url = {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}
    bad_b64 = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}
    not_image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}
    for messages in (
        [{"role": "wizard", "content": "hi"}],
        [{"role": "user", "content": [bad_url]}],
        [{"role": "user", "content": [bad_b64]}],
        [{"role": "user", "content": [not_image]}],
        [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}],
        [],
    ):
        with pytest.raises(openai.BadRequestError):
            create(messages=messages)
    for overrides in (
        {"temperature": 3.0},
        {"top_p": 0.0},
        {"max_tokens": 10**6},
        {"extra_body": {"top_k": -2}},
        {"extra_body": {"repetition_penalty": 0}},
    ):
        with pytest.raises(openai.BadRequestError):
            create(**overrides)
    assert len(fake.refusals) == 12 and {status for status, _ in fake.refusals} == {400, 404}


def test_wrong_model_name_or_key_fails_the_load(base_settings, fake, tmp_path):
    wrong = HunyuanEngine.from_settings(
        hunyuan_settings(base_settings, fake, hunyuan_model="other/model")
    )
    with pytest.raises(EngineError, match="not HUNYUAN_MODEL='other/model'"):
        wrong.load()
    fake.api_key = "s3cret"
    with pytest.raises(EngineError, match="HTTP 401"):
        HunyuanEngine.from_settings(hunyuan_settings(base_settings, fake)).load()
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    from_file = Settings.from_env({"HUNYUAN_API_KEY_FILE": str(key_file)}).hunyuan.api_key
    keyed = HunyuanEngine.from_settings(
        hunyuan_settings(base_settings, fake, hunyuan_api_key=from_file)
    )
    keyed.load()
    assert (
        HunyuanEngine.from_settings(
            hunyuan_settings(base_settings, fake, hunyuan_api_key="s3cret")
        ).load()
        is None
    )


def test_unreachable_vllm_delays_readiness_then_misses_fail_and_hits_are_served(
    base_settings, fake, redis_client
):
    from app.ports import free_port

    settings = hunyuan_settings(base_settings, fake)
    app = create_app(settings, engine=HunyuanEngine.from_settings(settings))
    client = app.test_client()
    assert ocr(client, PHOTOTEST.read_bytes()).headers["X-Cache"] == "MISS"  # one entry
    # That process is gone: its healthy engine would otherwise take the next miss (dispatch).
    app.extensions["ocr"]["cache"].close()
    down = hunyuan_settings(
        base_settings,
        fake,
        hunyuan_base_url=f"http://127.0.0.1:{free_port()}",
        hunyuan_startup_wait_seconds=0.5,
    )
    engine = HunyuanEngine.from_settings(down)
    started = time.monotonic()
    engine.load()  # waits, then gives up without failing
    assert 0.5 <= time.monotonic() - started < 3
    client = create_app(down, engine=engine).test_client()
    wait_for(lambda: client.get("/readyz").status_code == 200, 60, "ready",
             lambda: str(client.get("/readyz").get_json()))  # fmt: skip
    assert ocr(client, PHOTOTEST.read_bytes()).headers["X-Cache"] == "HIT"
    miss = ocr(client, PHOTOTEST.read_bytes(), task="parsing")
    assert miss.status_code == 503 and "connection failed" in miss.get_json()["error"]["message"]


def test_free_text_prompts_and_unsupported_tasks_are_client_errors(front, fake):
    _, client = front()
    data = PHOTOTEST.read_bytes()
    cases = [
        ({"prompt": "Describe this image"}, "prompt_not_accepted"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "prompt_not_accepted"),
        ({"task": "summarise"}, "unsupported_params"),
        ({"task": "ocr"}, "unsupported_params"),
        ({"task": "extraction"}, "unsupported_params"),
        ({"task": "extraction", "fields": ["it's"]}, "unsupported_params"),
        ({"task": "extraction", "fields": [f"f{i}" for i in range(40)]}, "unsupported_params"),
        ({"task": "parsing", "fields": ["a"]}, "unsupported_params"),
        ({"task": "translation", "target_language": "fr"}, "unsupported_params"),
        ({"task": "extraction", "fields": "name"}, "invalid_field"),
    ]
    for extra, code in cases:
        resp = ocr(client, data, **extra)
        assert resp.status_code == 400 and resp.get_json()["error"]["code"] == code, extra
    form = client.post(
        "/v1/ocr",
        data={"file": (io.BytesIO(data), "p.png"), "prompt": "anything"},
        content_type="multipart/form-data",
    )
    assert form.status_code == 400
    paddlex = client.post("/ocr", json={"file": b64(data), "fileType": 1, "textDetThresh": 0.2})
    assert paddlex.status_code == 422 and "OCR_ENGINE=hunyuan" in paddlex.get_json()["errorMsg"]
    assert fake.calls == 0


def test_paddle_and_serving_engines_only_offer_ocr(base_settings):
    spotting = OcrParams(task="spotting")
    paddle = PaddleOcrEngine.__new__(PaddleOcrEngine)  # check_params needs no model
    paddle.check_params(OcrParams())
    serving = ServingEngine.from_settings(
        base_settings.with_overrides(serving_url="http://127.0.0.1:9")
    )
    for engine in (paddle, serving):
        with pytest.raises(UnsupportedParams, match="not offered"):
            engine.check_params(spotting)
        with pytest.raises(UnsupportedParams):
            engine.check_params(task_params(OcrParams(), "extraction", ["a"]))


def test_pool_is_sized_to_the_threads_that_call_the_engine(front, fake, base_settings):
    # Six callers through the test client, more than 2 threads would bring: room to queue.
    app, _ = front(web_threads=2, grpc_enabled=False, dispatch_queue_max=6)
    assert app.extensions["ocr"]["cache"].engine.pool_size == 2
    both = HunyuanEngine.from_settings(
        hunyuan_settings(base_settings, fake, web_threads=3, grpc_threads=4)
    )
    assert both.pool_size == 7  # HTTP and gRPC threads
    fake.delay = 0.3
    data = PHOTOTEST.read_bytes()
    requests = [
        {"task": "parsing"},
        {"task": "spotting"},
        {"task": "translation"},
        {"task": "translation", "target_language": "zh"},
        {"task": "extraction", "fields": ["a"]},
        {"task": "extraction", "fields": ["b"]},
    ]
    codes: list[int] = []
    threads = [
        threading.Thread(
            target=lambda r=r: codes.append(ocr(app.test_client(), data, **r).status_code)
        )
        for r in requests
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert codes == [200] * 6 and fake.max_in_flight == 2


# --- configuration ------------------------------------------------------------------------------


def test_configuration_is_validated():
    env = {"OCR_ENGINE": "hunyuan", "HUNYUAN_BASE_URL": "http://vllm:8000/"}
    with pytest.raises(ConfigError, match="HUNYUAN_MODEL_REVISION: required"):
        Settings.from_env(env)
    for bad in (
        {"HUNYUAN_MODEL_REVISION": "main"},
        {"HUNYUAN_MODEL_REVISION": "47644ec"},
        {"HUNYUAN_BASE_URL": "vllm:8000"},
        {"HUNYUAN_TASK": "summarise"},
        {"HUNYUAN_MODEL_GENERATION": "2"},
        {"HUNYUAN_TARGET_LANGUAGE": "fr"},
        {"HUNYUAN_API_KEY_FILE": "/nonexistent"},
    ):
        with pytest.raises(ConfigError):
            Settings.from_env({**env, "HUNYUAN_MODEL_REVISION": REVISION, **bad})
    settings = Settings.from_env(
        {**env, "HUNYUAN_MODEL_REVISION": REVISION.upper(), "HUNYUAN_API_KEY": "s3cret"}
    )
    assert settings.hunyuan.base_url == "http://vllm:8000"
    assert settings.hunyuan.model_revision == REVISION
    assert settings.default_task() == "spotting" and Settings().default_task() == "ocr"
    secrets = {var for var, _, secret in settings.variables() if secret}
    assert "HUNYUAN_API_KEY" in secrets and "s3cret" not in repr(settings)
    with pytest.raises(ConfigError, match="cannot read"):
        Settings.from_env({**env, "HUNYUAN_API_KEY_FILE": "/nonexistent"})


def test_check_config_hides_the_api_key(monkeypatch, capsys):
    from app import logformat
    from app.__main__ import main

    # Left alone, it would bind the root logger to this test's captured stderr, closed after
    # it, for every later test of this process.
    monkeypatch.setattr(logformat, "configure", lambda *args, **kwargs: None)
    for key, value in {
        "OCR_ENGINE": "hunyuan",
        "HUNYUAN_BASE_URL": "http://vllm:8000",
        "HUNYUAN_MODEL_REVISION": REVISION,
        "HUNYUAN_API_KEY": "s3cret",
    }.items():
        monkeypatch.setenv(key, value)
    assert main(["check-config"]) == 0
    out = capsys.readouterr().out
    assert "HUNYUAN_API_KEY=<set>" in out and "s3cret" not in out


# --- output hygiene and the canonical result ------------------------------------------------


def test_output_hygiene():
    looped = "Intro text. " * 180 + "ab" * 60
    assert strip_repeated_tail(looped).endswith("Intro text. ab")
    assert strip_repeated_tail("....." * 10) == "....." * 10  # short: left as it is
    fenced = (
        '```json\n[{"box": [500, 500, 100, 100], "text": "Cafe\u0301"},\n'
        '{"box": [500, 500, 100, 100], "text": "Cafe\u0301"},\n'
        '{"box": [0, 0, 2000, 10], "text": "wide"}]\n```'
    )
    lines = parse_spotting(fenced, 200, 100)
    assert lines == (
        OcrLine("wide", 1.0, ((0, 0), (200, 0), (200, 1), (0, 1))),
        OcrLine("Café", 1.0, ((20, 10), (100, 10), (100, 50), (20, 50))),  # corners swapped
    )
    text_form = "Hello (world)(10,20),(300,40)\n第二行(0,500),(1000,600)"
    assert [ln.text for ln in parse_spotting(text_form, 1000, 1000)] == ["Hello (world)", "第二行"]
    assert parse_spotting("", 10, 10) == () and parse_spotting("[]", 10, 10) == ()
    assert (
        parse_extraction('```json\n{"Surname": " Virtanen ", "extra": 1}\n```', ["sex", "surname"])
        == '{"sex":null,"surname":"Virtanen"}'
    )


def test_result_text_round_trips_and_line_results_are_unchanged():
    text_result = OcrResult(10, 20, text="# Title")
    assert OcrResult.from_dict(text_result.to_dict()) == text_result
    line_result = OcrResult(10, 20, (OcrLine("a", 0.5, ((0, 0), (1, 0), (1, 1), (0, 1))),))
    assert "text" not in line_result.to_dict()
    assert OcrResult.from_dict(line_result.to_dict()) == line_result
    with pytest.raises(ValueError):
        OcrResult.from_dict({**text_result.to_dict(), "text": 5})


# --- deployment ---------------------------------------------------------------------------------


def test_deployment_pins_one_revision_for_vllm_and_the_front():
    import yaml

    from tests.conftest import ROOT

    compose = yaml.safe_load((ROOT / "docker" / "docker-compose.yml").read_text())
    vllm, front = compose["services"]["vllm"], compose["services"]["front-hunyuan"]
    command = vllm["command"]
    revision = command[command.index("--revision") + 1]
    assert front["environment"]["HUNYUAN_MODEL_REVISION"] == revision
    assert command[0] == front["environment"]["HUNYUAN_MODEL"] == "tencent/HunyuanOCR"
    for flag in ("--no-enable-prefix-caching", "--mm-processor-cache-gb"):
        assert flag in command
    assert command[command.index("--mm-processor-cache-gb") + 1] == "0"
    assert not vllm["image"].endswith(":latest") and "gpu" in str(vllm["deploy"])

    overlay = ROOT / "k8s" / "overlays" / "hunyuan"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    (env,) = [g for g in kustomization["configMapGenerator"] if g["name"] == "ocr-cache-env"]
    literals = dict(item.split("=", 1) for item in env["literals"])
    assert literals["HUNYUAN_MODEL_REVISION"] == revision
    assert literals["HUNYUAN_MODEL_GENERATION"] == front["environment"]["HUNYUAN_MODEL_GENERATION"]
    settings = Settings.from_env(literals)  # the overlay's values pass validation
    assert settings.hunyuan.model_revision == revision
    deployment = yaml.safe_load((overlay / "vllm-deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--revision") + 1] == "$(HUNYUAN_MODEL_REVISION)"
    assert (
        "--no-enable-prefix-caching" in args
        and container["resources"]["limits"]["nvidia.com/gpu"] == 1
    )
