"""Redaction (CACHE_REDACT): the patterns on generated numbers, then the guarantee end to end on
a generated ID-card-like image through the real engine and a real Redis, over every protocol:
masked answers on miss and hit, nothing raw in Redis or in the logs, and the policy in the key."""

from __future__ import annotations

import ast
import base64
import logging
import os
import random
from pathlib import Path

import grpc
import pytest
from PIL import Image, ImageDraw, ImageFont

from app import logsafe
from app.cache.codec import MAGIC, plaintext
from app.config import ConfigError, Settings
from app.protocols.pipeline_stubs import pb2, pb2_grpc
from app.redaction import (
    BUILTIN,
    build_policy,
    cn_id_valid,
    install_log_redaction,
    luhn_valid,
    parse_names,
)
from tests.conftest import ROOT
from tests.fleet import wait_for
from tests.helpers import b64

pytestmark = pytest.mark.unit

ALL = tuple(BUILTIN)
FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")

# What the generated card holds, and what must never be seen again once the policy is on.
RAW_ID = "11010519491231002X"
RAW_MOBILE = "13812345678"
RAW_CARD = "4111 1111 1111 1111"
RAW_EMAIL = "zhang.san@example.com"
CARD_LINES = [
    "Name: Zhang San",
    f"ID: {RAW_ID}",
    f"Mobile: {RAW_MOBILE}",
    f"Card: {RAW_CARD}",
    f"Email: {RAW_EMAIL}",
    "Total: 42.50",
]
SECRETS = (RAW_ID, RAW_MOBILE, RAW_CARD, RAW_CARD.replace(" ", ""), RAW_EMAIL, "zhang.san")


def _id_number(rng: random.Random) -> str:
    body = "".join(rng.choice("0123456789") for _ in range(17))
    for check in "0123456789X":
        if cn_id_valid(body + check):
            return body + check
    raise AssertionError("no check character")


def _card_number(rng: random.Random, length: int) -> str:
    body = rng.choice("3456") + "".join(rng.choice("0123456789") for _ in range(length - 2))
    for last in "0123456789":
        if luhn_valid(body + last):
            return body + last
    raise AssertionError("no Luhn digit")


def _grouped(number: str, sep: str) -> str:
    return sep.join(number[i : i + 4] for i in range(0, len(number), 4))


def test_generated_resident_ids_are_masked_only_with_a_valid_check() -> None:
    policy = build_policy(("cn_id",), "")
    rng = random.Random(7)
    for _ in range(300):
        number = _id_number(rng)
        assert policy.redact(f"ID {number} ok") == "ID " + "*" * 18 + " ok"
        assert policy.redact(f"号码{number.lower()}") == "号码" + "*" * 18
        wrong = number[:17] + next(c for c in "0123456789X" if c != number[17])
        assert policy.redact(f"ID {wrong}") == f"ID {wrong}"  # checksum fails: left alone
        assert policy.redact(f"ID {number}7") == f"ID {number}7"  # 19 digits: not an ID


def test_generated_bank_cards_are_masked_only_when_luhn_valid() -> None:
    policy = build_policy(("bank_card",), "")
    rng = random.Random(11)
    for _ in range(300):
        number = _card_number(rng, rng.randint(13, 19))
        for written in (number, _grouped(number, " "), _grouped(number, "-")):
            masked = policy.redact(f"card {written}.")
            assert masked == "card " + "".join("*" if c.isdigit() else c for c in written) + "."
        wrong = number[:-1] + str((int(number[-1]) + 1) % 10)
        assert policy.redact(f"card {wrong}") == f"card {wrong}"


def test_phones_and_emails() -> None:
    policy = build_policy(("phone", "email"), "")
    masked = {
        "Tel 13812345678": "Tel ***********",
        "Tel 138-1234-5678": "Tel ***-****-****",
        "Tel +86 138 1234 5678": "Tel +** *** **** ****",
        "电话: 010-62345678": "电话: ***-********",
        "Fax (0755) 12345678": "Fax (****) ********",
        "Call +44 20 7946 0958": "Call +** ** **** ****",
        "mail a.b-c+d@mail.example.co.uk.": "mail *.*-*+*@****.*******.**.**.",
    }
    for raw, expected in masked.items():
        assert policy.redact(raw) == expected
    for plain in ("Total: 42.50", "2024-05-01", "Invoice 12345", "v1.2.3", "a@b", "12:30"):
        assert policy.redact(plain) == plain


def test_policy_configuration() -> None:
    assert parse_names("all") == ALL
    assert parse_names(" Phone , email,phone") == ("phone", "email")
    with pytest.raises(ConfigError, match="^CACHE_REDACT: unknown type 'passport'"):
        Settings.from_env({"CACHE_REDACT": "phone,passport"})
    assert Settings.from_env({"CACHE_REDACT": "all"}).redaction.types == ALL
    assert Settings.from_env({}).redaction.types == ()
    assert build_policy((), "") is None


def test_custom_patterns_file(tmp_path: Path) -> None:
    good = tmp_path / "patterns.txt"
    good.write_text("# employee numbers and plates\nemployee = EMP-\\d{6}\nplate = 京[A-Z]\\w{5}\n")
    settings = Settings.from_env({"CACHE_REDACT_PATTERNS_FILE": str(good)})
    policy = build_policy(settings.redaction.types, settings.redaction.patterns_file)
    assert policy.names == ("employee", "plate")
    assert policy.redact("by EMP-123456 in 京A12345") == "by ***-****** in *******"
    for bad, message in (
        ("employee = EMP-(\\d{6}\n", "bad regex for employee"),
        ("phone = \\d+\n", "new lowercase name"),
        ("Employee = x\n", "new lowercase name"),
        ("maybe = \\d*\n", "matches empty text"),
        ("just a line\n", "expected `name = regex`"),
    ):
        path = tmp_path / "bad.txt"
        path.write_text(bad)
        with pytest.raises(ConfigError, match=f"^CACHE_REDACT_PATTERNS_FILE: line 1: .*{message}"):
            Settings.from_env({"CACHE_REDACT_PATTERNS_FILE": str(path)})


def test_policy_digest_names_what_is_masked(tmp_path: Path) -> None:
    digests = {
        build_policy(("phone",), "").digest,
        build_policy(("phone", "email"), "").digest,
        build_policy(ALL, "").digest,
    }
    custom = tmp_path / "p.txt"
    custom.write_text("employee = EMP-\\d{6}\n")
    digests.add(build_policy(("phone",), str(custom)).digest)
    custom.write_text("employee = EMP-\\d{7}\n")
    digests.add(build_policy(("phone",), str(custom)).digest)
    assert len(digests) == 5
    assert build_policy(("phone",), "").digest == build_policy(("phone",), "").digest


# ------------------------------------------------------------- values glued to their labels
# OCR routinely drops the space between a label and its value (issue 25): the patterns look
# for "no digit" around a number, never "no letter", so a glued label changes nothing.


def _masked(text: str) -> str:
    return "".join("*" if c.isalnum() else c for c in text)


def test_resident_ids_glued_to_latin_and_chinese_labels_are_masked() -> None:
    policy = build_policy(("cn_id",), "")
    assert policy.redact(f"ID{RAW_ID}") == "ID" + "*" * 18  # the case
    rng = random.Random(25)
    for _ in range(300):
        number = _id_number(rng)
        stars = "*" * 18
        for label, value, after in (
            ("ID", number, ""),
            ("No.", number, ""),
            ("IDNo", number.lower(), ""),
            ("ID", number, "Name"),  # a trailing X followed by letters is still the ID's
            ("", number, "Sex:M"),
            ("身份证号", number, ""),
            ("公民身份号码", number, "性别男"),
        ):
            assert policy.redact(f"{label}{value}{after}") == f"{label}{stars}{after}"
        spaced = f"{number[:6]} {number[6:14]} {number[14:]}"
        assert policy.redact(f"ID{spaced}X") == "ID****** ******** ****X"  # length, separators
        wrong = number[:17] + next(c for c in "0123456789X" if c != number[17])
        assert policy.redact(f"ID{wrong}") == f"ID{wrong}"  # checksum fails: left alone
        # A longer digit run is another number (an account, a tracking number), not an ID
        # with a digit glued on: OCR keeps the gap between two numbers.
        for longer in (f"ID{number}7", f"7{number}", f"ID{number}12Name", f"SN12{number}"):
            assert policy.redact(longer) == longer


def test_bank_cards_glued_to_labels_are_masked() -> None:
    policy = build_policy(("bank_card",), "")
    card = "6222021234567894"
    assert luhn_valid(card)
    for label, value, after in (
        ("Card", card, ""),
        ("No.", card, ""),
        ("卡号", card, ""),
        ("", card, "CNY"),
        ("Card", "4111-1111-1111-1111", "Exp"),
        ("Acct", "4111 1111 1111 1111", "账户"),
    ):
        assert policy.redact(f"{label}{value}{after}") == f"{label}{_masked(value)}{after}"
    for plain in (
        "Card6222021234567895",  # Luhn fails
        "SN62220212345678941",  # 17 digits, Luhn fails
        "Card12346222021234567894",  # 20 digits: longer than any card
        "Build20240501123456789",  # 17 digits, Luhn fails
    ):
        assert policy.redact(plain) == plain


def test_phones_glued_to_labels_are_masked() -> None:
    policy = build_policy(("phone",), "")
    for label, value, after in (
        ("Tel", "13812345678", ""),
        ("Mobile", "138-1234-5678", ""),
        ("手机", "13812345678", ""),
        ("", "13812345678", "Tel"),
        ("Tel", "+8613812345678", ""),
        ("Tel", "010-62345678", ""),
        ("电话", "(0755)12345678", ""),
        ("Phone", "+44 20 7946 0958", ""),
        ("电话", "+44 20 7946 0958", "传真"),
        ("Tel:", "+1 415 555 0132", "ext"),
    ):
        assert policy.redact(f"{label}{value}{after}") == f"{label}{_masked(value)}{after}"
    for plain in ("ABC12345678", "SKU1381234567890", "Tel1381234567", "v1.2.3+4", "C++11"):
        assert policy.redact(plain) == plain


def test_emails_glued_to_labels_are_masked() -> None:
    """A Latin label glued to the local part (or to the top-level domain) cannot be told from
    the address: it is masked with it, which keeps the address out. A label in another script
    stays readable."""
    policy = build_policy(("email",), "")
    for raw, expected in (
        ("Mailalice@example.com", "*********@*******.***"),
        ("E-mail:alice@example.com", "E-mail:*****@*******.***"),
        ("邮箱alice@example.com", "邮箱*****@*******.***"),
        ("电子邮件zhang.san@example.com.cn电话", "电子邮件*****.***@*******.***.**电话"),
        ("alice@example.comTel", "*****@*******.******"),
        ("josé.alice@example.com", "josé.*****@*******.***"),
    ):
        assert policy.redact(raw) == expected
    for plain in ("a@b", "user@localhost", "v1.2.3", "Mail alice at example dot com"):
        assert policy.redact(plain) == plain


def test_ordinary_words_and_identifiers_are_left_alone() -> None:
    policy = build_policy(ALL, "")
    for plain in (
        "Product code ABC12345678",
        "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "uuid 123e4567-e89b-12d3-a456-426614174000",
        "Invoice INV2024-0501-77",
        "Model RTX4090Ti, 24GB",
        "Total: 42.50 (VAT 13%)",
        "Order 1234567890123456789012",  # 22 digits: no card, no ID
    ):
        assert policy.redact(plain) == plain


# Digests of the first built-in patterns (PATTERNS_VERSION 1), which let a value glued to a
# Latin label through: entries made under them must never be served again.
LEAKY_V1_DIGESTS = {
    ("cn_id",): "aa2a67fef0dc5db8",
    ("bank_card",): "e02287f34e2d35c3",
    ("phone",): "e7e9821d17473955",
    ("email",): "944bb53c63fff1a3",
    ALL: "c3a08459a2172c47",
}


def test_the_leaky_patterns_entries_are_other_keys() -> None:
    for names, leaky in LEAKY_V1_DIGESTS.items():
        assert build_policy(names, "").digest != leaky, names


def test_policy_digest_changes_with_the_patterns_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import app.redaction

    before = build_policy(ALL, "").digest
    monkeypatch.setattr(app.redaction, "PATTERNS_VERSION", app.redaction.PATTERNS_VERSION + 1)
    assert build_policy(ALL, "").digest != before


def test_log_records_are_masked_whoever_logs() -> None:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    logsafe.install()  # as create_app does: escaping first, then masking
    install_log_redaction(build_policy(ALL, ""))
    logger = logging.getLogger("some.library")
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning("lookup failed for %s / %s", RAW_ID, RAW_EMAIL)
        logger.warning("client said %s", "x\nFAKE LINE 13812345678")
        logger.warning("logid=%s", f"\n{RAW_ID}")  # escaped to \\n: still masked
        logger.warning("ids %(a)s %(b)s", {"a": f"\t{RAW_ID}", "b": 7})
        try:
            raise ValueError(f"bad card {RAW_CARD}")
        except ValueError:
            logger.exception("engine said")
    finally:
        logger.removeHandler(handler)
    text = "\n".join(records)
    assert "lookup failed for ****************** / *****.***@*******.***" in text
    assert "ValueError: bad card **** **** **** ****" in text  # the traceback too
    assert "client said x\\nFAKE LINE ***********" in text  # escaped and masked
    assert "logid=\\n******************" in text
    assert "ids \\t****************** 7" in text
    assert not _leaks(text)
    assert "engine said" in text


# ------------------------------------------------------------------ end to end, real engine


@pytest.fixture(scope="module")
def card_png() -> bytes:
    font = ImageFont.truetype(str(FONT), 30) if FONT.exists() else ImageFont.load_default(size=30)
    image = Image.new("RGB", (760, 60 * len(CARD_LINES) + 40), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(CARD_LINES):
        draw.text((30, 30 + 60 * i), line, fill="black", font=font)
    out = Path(os.environ.get("TEST_ARTIFACTS_DIR", ROOT / "test-artifacts"))
    out.mkdir(parents=True, exist_ok=True)
    image.save(out / "redaction-card.png")  # kept for a person to look at
    return (out / "redaction-card.png").read_bytes()


def _stored_plaintext(redis_client) -> str:  # type: ignore[no-untyped-def]
    """Every cache entry's envelope as text (decompressed; entries are not encrypted here)."""
    texts = []
    for key in redis_client.scan_iter("ocr:*"):
        if redis_client.type(key) != b"string" or b":px2:" in key:
            continue
        value = redis_client.get(key)
        assert value[:4] == MAGIC, value[:8]
        texts.append(plaintext(value).decode("utf-8", "replace"))  # decompressed JSON
    return "\n".join(texts)


def _leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


@pytest.mark.integration
def test_every_protocol_answers_masked_text_and_nothing_raw_is_stored_or_logged(
    make_app, grpc_front, redis_client, card_png, caplog
):  # type: ignore[no-untyped-def]
    caplog.set_level(logging.DEBUG)
    app, endpoint = grpc_front(cache_redact=ALL)
    client = app.test_client()

    first = client.post("/v1/ocr", json={"image": b64(card_png)})
    assert first.status_code == 200 and first.headers["X-Cache"] == "MISS"
    texts = [line["text"] for line in first.get_json()["lines"]]
    assert texts[0] == "Name: Zhang San" and texts[-1].replace(" ", "") == "Total:42.50"
    joined = "\n".join(texts)
    assert not _leaks(joined), joined
    for masked in ("*" * 18, "*" * 11, "**** **** **** ****", "*****.***@*******.***"):
        assert masked in joined, joined

    second = client.post("/v1/ocr", json={"image": b64(card_png)})
    assert (
        second.headers["X-Cache"] == "HIT"
        and second.get_json()["lines"] == first.get_json()["lines"]
    )

    pipeline = client.post(
        "/ocr/prediction", data=f'{{"key": ["image"], "value": ["{b64(card_png)}"]}}'
    ).get_json()
    assert pipeline["err_no"] == 0
    assert [t for (t, _), _ in ast.literal_eval(pipeline["value"][0])] == texts

    paddlex = client.post("/ocr", json={"file": b64(card_png), "fileType": 1}).get_json()
    assert paddlex["result"]["ocrResults"][0]["prunedResult"]["rec_texts"] == texts

    stub = pb2_grpc.PipelineServiceStub(grpc.insecure_channel(endpoint))
    answer = stub.inference(
        pb2.Request(key=["image"], value=[base64.b64encode(card_png).decode()], name="ocr"),
        timeout=60,
    )
    assert answer.err_no == 0
    assert [t for (t, _), _ in ast.literal_eval(answer.value[0])] == texts

    stored = _stored_plaintext(redis_client)
    assert "Zhang San" in stored  # the entry is readable here, and holds only masked text
    assert not _leaks(stored), _leaks(stored)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert not _leaks(logged)


@pytest.mark.integration
def test_the_policy_is_part_of_the_key(make_app, redis_client, card_png):  # type: ignore[no-untyped-def]
    masked_app = make_app(cache_redact=ALL).test_client()
    masked = masked_app.post("/v1/ocr", json={"image": b64(card_png)})
    assert masked.headers["X-Cache"] == "MISS"

    # No policy: another key, so the engine runs and the raw text comes back (never the masked
    # entry); the same for a narrower policy.
    raw = make_app().test_client().post("/v1/ocr", json={"image": b64(card_png)})
    assert raw.headers["X-Cache"] == "MISS"
    raw_texts = "\n".join(line["text"] for line in raw.get_json()["lines"])
    assert RAW_MOBILE in raw_texts and RAW_EMAIL in raw_texts
    phone_only = make_app(cache_redact=("phone",)).test_client()
    narrow = phone_only.post("/v1/ocr", json={"image": b64(card_png)})
    assert narrow.headers["X-Cache"] == "MISS"
    narrow_texts = "\n".join(line["text"] for line in narrow.get_json()["lines"])
    assert RAW_MOBILE not in narrow_texts and RAW_EMAIL in narrow_texts

    again = masked_app.post("/v1/ocr", json={"image": b64(card_png)})
    assert again.headers["X-Cache"] == "HIT"
    assert again.get_json()["lines"] == masked.get_json()["lines"]
    assert [line["box"] for line in again.get_json()["lines"]] == [
        line["box"] for line in raw.get_json()["lines"]
    ]  # boxes are kept


def test_hunyuan_extraction_and_its_subset_reuse_are_masked(base_settings, redis_client, tmp_path):  # type: ignore[no-untyped-def]
    """Text-task payloads are masked too (extraction JSON, here with a custom type), and a field
    subset answered from the stored superset can only ever see the masked values. The vLLM end
    is the OpenAI-protocol stand-in of tests/fake_vllm.py (vLLM cannot run here)."""
    from app.engines.hunyuan import HunyuanEngine
    from app.web import create_app
    from tests.fake_vllm import FakeVllm
    from tests.test_hunyuan import PASSPORT, hunyuan_settings

    patterns = tmp_path / "patterns.txt"
    patterns.write_text("passport = [A-Z]{2}\\d{7}\n")
    fake = FakeVllm(PASSPORT.parent).start()
    try:
        # Redis timeouts of a second: on a busy host the service's 50 ms ones made a slow
        # answer cost a second engine call, which is not what this test is about.
        settings = hunyuan_settings(
            base_settings, fake, cache_redact=ALL, cache_redact_patterns_file=str(patterns),
            redis_timeout_ms=1000, redis_connect_timeout_ms=1000,
        )  # fmt: skip
        app = create_app(settings, engine=HunyuanEngine.from_settings(settings))
        client = app.test_client()
        wait_for(lambda: client.get("/readyz").status_code == 200, 60, "ready",
                 lambda: str(client.get("/readyz").get_json()))  # fmt: skip
        data = PASSPORT.read_bytes()
        fields = ["surname", "passport number"]
        first = client.post(
            "/v1/ocr", json={"image": b64(data), "task": "extraction", "fields": fields}
        )
        assert first.status_code == 200 and first.headers["X-Cache"] == "MISS"
        assert first.get_json()["data"] == {"passport number": "*********", "surname": "Virtanen"}
        subset = client.post(
            "/v1/ocr",
            json={"image": b64(data), "task": "extraction", "fields": ["passport number"]},
        )
        assert subset.headers["X-Cache"] == "HIT"
        assert subset.get_json()["data"] == {"passport number": "*********"}
        assert fake.calls == 1
        assert "XP8271602" not in _stored_plaintext(redis_client)
    finally:
        fake.stop()


@pytest.mark.integration
def test_word_boxes_are_masked_like_their_line(make_app, card_png):  # type: ignore[no-untyped-def]
    """PaddleX ``returnWordBox``: a card number comes back as four-digit words, none of which
    matches a pattern alone; each word takes its slice of the masked line."""
    client = make_app(cache_redact=ALL).test_client()
    body = {"file": b64(card_png), "fileType": 1, "returnWordBox": True, "visualize": False}
    for expected_cache in ("MISS", "HIT"):
        resp = client.post("/ocr", json=body)
        assert resp.status_code == 200 and resp.headers["X-Cache"] == expected_cache
        pruned = resp.get_json()["result"]["ocrResults"][0]["prunedResult"]
        words = [w for line in pruned["text_word"] for w in line]
        assert "".join(pruned["text_word"][3]) == pruned["rec_texts"][3]
        assert not _leaks(" ".join(words)) and "1111" not in words and "4111" not in words
        assert "****" in words and "Zhang" in words


def test_words_that_are_not_in_the_line_fail_closed() -> None:
    from app.engines.redacting import _redact_line
    from app.vocabulary import OcrLine

    box = ((0, 0), (1, 0), (1, 1), (0, 1))
    policy = build_policy(ALL, "")
    line = OcrLine("Tel 13812345678", 0.9, box, words=(("Tel", box), ("138 1234 5678", box)))
    masked = _redact_line(line, policy)
    assert masked.text == "Tel ***********"
    assert [w for w, _ in masked.words] == ["Tel", "*** **** ****"]
    clean = OcrLine("Total 42", 0.9, box, words=(("Total", box), ("4 2", box)))
    assert [w for w, _ in _redact_line(clean, policy).words] == ["Total", "4 2"]
