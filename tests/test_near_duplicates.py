"""Near-duplicate tiers (issue 15): the pixel tier and the opt-in similarity tier.

The unit part runs the front door on a real embedded Redis with an engine double that reads
the decoded pixels (its answer names their SHA-256), so a pixel hit is visibly exact. The
integration part runs the real engine on corpus images and their variants
(``bench.near_variants``), over the HTTP protocols.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from PIL import Image

from app import metrics
from app.cache import verify
from app.cache.keys import digest_image
from app.cache.pixel_index import BUCKET_HEX, pixel_digest
from app.cache.region import OcrCache
from app.config import Settings
from app.engines.base import EngineBase, OcrRequest
from app.imaging import decode_image
from app.protocols import controls as controls_mod
from app.protocols.errors import BadRequest
from app.vocabulary import (
    CacheControls,
    CacheStatus,
    EngineError,
    OcrLine,
    OcrParams,
    OcrResult,
)
from bench import near_variants as nv
from tests.conftest import CORPUS, PHOTOTEST, SHORT
from tests.helpers import b64, metric_sum, stored_keys

pytestmark = pytest.mark.integration

PAGE = PHOTOTEST.read_bytes()


class PixelEngine(EngineBase):
    """Reads the decoded pixels, as PaddleOCR does: its one line names their SHA-256 and
    covers the page. ``fail`` makes the next calls raise."""

    kind = "double"
    fingerprint = "pixeldoublefp00"
    default_params = OcrParams()
    slots = 4
    reads_decoded_pixels = True

    def __init__(self) -> None:
        self.calls = 0
        self.fail = 0
        self._lock = threading.Lock()

    def describe(self) -> dict[str, str]:
        return {"kind": self.kind}

    def check_params(self, params: OcrParams) -> None: ...

    def prepare(self) -> None: ...

    def load(self) -> None: ...

    def recognize(self, request: OcrRequest) -> OcrResult:
        with self._lock:
            self.calls += 1
            failing, self.fail = self.fail > 0, max(0, self.fail - 1)
        if failing:
            raise EngineError("double failed")
        image = request.image
        text = hashlib.sha256(image.pixels.tobytes()).hexdigest()[:12]
        w, h = image.width, image.height
        box = ((0, 0), (w - 1, 0), (w - 1, h - 1), (0, h - 1))
        return OcrResult(w, h, (OcrLine(text, 0.99, box),))


class BytesEngine(PixelEngine):
    """A remote engine: it is sent the original bytes (no pixel tier for it)."""

    reads_decoded_pixels = False


@pytest.fixture()
def settings(base_settings: Settings, redis_client: redis.Redis) -> Settings:
    return base_settings


def make_cache(settings: Settings, engine: object, **overrides: object) -> OcrCache:
    from tests.test_cache_unit import make_cache as front_door

    return front_door(settings, engine, redis_timeout_ms=1000, redis_connect_timeout_ms=1000,
                      **overrides)  # fmt: skip


@pytest.fixture()
def double() -> Iterator[PixelEngine]:
    yield PixelEngine()


def _keys(client: redis.Redis, part: str) -> list[bytes]:
    return [k for k in client.scan_iter(match=f"*{part}*")]


def _one_pixel_changed(data: bytes) -> bytes:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    x, y = img.width // 2, img.height // 2
    r, g, b = img.getpixel((x, y))  # type: ignore[misc]
    img.putpixel((x, y), ((r + 1) % 256, g, b))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


# The pixel tier ----------------------------------------------------------------------


@pytest.mark.parametrize("variant", nv.LOSSLESS)
def test_lossless_reencodes_hit_the_pixel_tier(settings, double, variant):
    cache = make_cache(settings, double)
    first = cache.get_or_compute(PAGE)
    data = nv.benign(PAGE, variant)
    assert data != PAGE and digest_image(data).md5 != digest_image(PAGE).md5
    before = metrics.CACHE_TIER_HITS.labels(tier="pixel")._value.get()
    again = make_cache(settings, double).get_or_compute(data)  # another process
    assert (again.status, again.tier) == (CacheStatus.HIT, "pixel")
    assert again.result == first.result and double.calls == 1
    assert metrics.CACHE_TIER_HITS.labels(tier="pixel")._value.get() == before + 1


def test_one_changed_pixel_never_hits_the_pixel_tier(settings, double):
    cache = make_cache(settings, double)
    first = cache.get_or_compute(PAGE)
    changed = cache.get_or_compute(_one_pixel_changed(PAGE))
    assert changed.status is CacheStatus.MISS and changed.tier == ""
    assert changed.result != first.result and double.calls == 2


def test_exif_orientation_is_applied_before_hashing(settings, double):
    """A photo with an EXIF rotation and the same photo rotated for real are one engine
    input: the pixel tier answers the second from the first."""
    img = Image.open(io.BytesIO(PAGE)).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    tagged, upright = io.BytesIO(), io.BytesIO()
    img.save(tagged, "PNG", exif=exif)
    img.transpose(Image.Transpose.ROTATE_270).save(upright, "PNG")
    a = decode_image(tagged.getvalue(), settings.server.max_image_pixels)
    b = decode_image(upright.getvalue(), settings.server.max_image_pixels)
    assert pixel_digest(a) == pixel_digest(b) and (a.width, a.height) == (img.height, img.width)
    cache = make_cache(settings, double)
    cache.get_or_compute(tagged.getvalue())
    assert cache.get_or_compute(upright.getvalue()).tier == "pixel" and double.calls == 1


def test_pixel_tier_is_scoped_to_namespace_params_and_engine(settings, double):
    cache = make_cache(settings, double)
    cache.get_or_compute(PAGE)
    data = nv.benign(PAGE, "bmp")
    other_ns = cache.get_or_compute(data, controls=CacheControls(namespace="acme"))
    assert other_ns.status is CacheStatus.MISS
    other_params = cache.get_or_compute(data, OcrParams(det_thresh=0.4))
    assert other_params.status is CacheStatus.MISS
    other = PixelEngine()
    other.fingerprint = "otherfingerprt0"  # type: ignore[misc]
    assert make_cache(settings, other).get_or_compute(data).status is CacheStatus.MISS
    assert double.calls == 3


def test_pixel_tier_is_off_for_engines_sent_the_original_bytes(settings, redis_client):
    engine = BytesEngine()
    cache = make_cache(settings, engine)
    cache.get_or_compute(PAGE)
    assert cache.get_or_compute(nv.benign(PAGE, "bmp")).status is CacheStatus.MISS
    assert _keys(redis_client, ":px2:") == [] and engine.calls == 2


def _pointer(cache: OcrCache, data: bytes, namespace: str = "") -> tuple[str, bytes]:
    """The bucket key and field of ``data``'s pixels in the pixel index."""
    digest = pixel_digest(decode_image(data, 60_000_000))
    task = cache.keys.task(OcrParams())
    key = cache.keys.pixel_bucket(digest[:BUCKET_HEX], task, namespace)
    return key, bytes.fromhex(digest[BUCKET_HEX : BUCKET_HEX + 32])


def test_a_pointer_names_an_image_only_within_its_own_scope(settings, double, redis_client):
    """A pointer holds an image's digests, not a key: the entry it leads to is always in the
    scope it was found in. A pointer copied into another namespace's index leads to that
    namespace's entry of the image, which does not exist: a miss."""
    cache = make_cache(settings, double)
    cache.get_or_compute(PAGE, controls=CacheControls(namespace="acme"))
    acme_key, field = _pointer(cache, PAGE, "acme")
    key, _ = _pointer(cache, PAGE)
    redis_client.hset(key, field, redis_client.hget(acme_key, field))
    assert cache.get_or_compute(nv.benign(PAGE, "bmp")).status is CacheStatus.MISS


def test_with_encryption_a_pointer_to_another_images_entry_is_a_miss(
    settings, double, redis_client
):
    """A Redis writer without the key points PAGE's pixels at another image's genuine entry
    (same scope): the pointer is authenticated, so the forgery is a miss, never the other
    text — whether it carries no MAC, a made-up one, or another pointer's."""
    keys = (("k1", b"\x07" * 32),)
    cache = make_cache(settings, double, cache_encryption_keys=keys)
    other = SHORT.read_bytes()
    cache.get_or_compute(other)
    cache.get_or_compute(PAGE)
    key, field = _pointer(cache, PAGE)
    other_key, other_field = _pointer(cache, other)
    payload = bytes.fromhex(digest_image(other).md5) + bytes.fromhex(digest_image(other).sha256)
    genuine_elsewhere = redis_client.hget(other_key, other_field)
    for forged, variant in (
        (payload, "bmp"),
        (payload + b"\0" * 16, "tiff"),
        (genuine_elsewhere, "png_resave"),
    ):
        redis_client.hset(key, field, forged)
        answer = cache.get_or_compute(nv.benign(PAGE, variant))
        assert answer.status is CacheStatus.MISS, (variant, answer.tier)


def test_the_pixel_index_costs_a_small_fraction_of_an_entry(settings, double, redis_client):
    """Redis bytes (MEMORY USAGE) of the pointers against the entries', for 64 images: while
    the buckets are sparse a pointer costs about a small key."""
    cache = make_cache(settings, double)
    rng = np.random.default_rng(7)
    for i in range(64):
        pixels = rng.integers(0, 256, (24, 32 + i, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "PNG")
        cache.get_or_compute(buf.getvalue())
    usage = {k: redis_client.memory_usage(k) or 0 for k in redis_client.keys("*")}
    pointers = sum(n for k, n in usage.items() if b":px2:" in k)
    entries = sum(n for k, n in usage.items() if b":px2:" not in k)
    assert pointers and entries
    print(f"sparse: pixel pointers {pointers / 64:.0f} B each, {pointers / entries:.2f} of entries")
    assert pointers / 64 < 200  # a key of its own with a sealed blob was about 390 B


@pytest.mark.parametrize("encrypted", [False, True])
def test_full_buckets_hold_pointers_compactly_and_bounded(settings, redis_client, encrypted):
    """Filled buckets (16 of them here, 65,536 in service): under 100 B a pointer, at most
    BUCKET_FIELDS pointers a bucket, and the newest pointer always kept."""
    from app.cache.codec import Codec
    from app.cache.pixel_index import BUCKET_FIELDS, PixelIndex

    keys = (("k1", b"\x07" * 32),) if encrypted else ()
    cache = make_cache(settings, PixelEngine(), cache_encryption_keys=keys)
    index = PixelIndex(cache.store, cache.keys, Codec(keys), bucket_hex=1)
    rng = np.random.default_rng(3)
    digests = [rng.bytes(32).hex() for _ in range(16 * BUCKET_FIELDS + 400)]
    for d in digests:
        entry = digest_image(d.encode())
        index.record(d, "t", "", entry, 600)
        assert redis_client.hexists(*_place(cache, d, "t", 1))  # the newest is never dropped
    buckets = redis_client.keys("*:px2:*")
    assert len(buckets) == 16
    assert all(redis_client.hlen(b) <= BUCKET_FIELDS for b in buckets)
    assert all(0 < redis_client.ttl(b) <= 600 for b in buckets)
    held = sum(redis_client.hlen(b) for b in buckets)
    per_pointer = sum(redis_client.memory_usage(b) or 0 for b in buckets) / held
    print(f"full buckets: {per_pointer:.0f} B a pointer ({held} held, encrypted={encrypted})")
    assert per_pointer < 100 + (16 if encrypted else 0)


def _place(cache: OcrCache, digest: str, task: str, bucket_hex: int) -> tuple[str, bytes]:
    key = cache.keys.pixel_bucket(digest[:bucket_hex], task, "")
    return key, bytes.fromhex(digest[bucket_hex : bucket_hex + 32])


def test_errors_write_no_index_keys(settings, double, redis_client):
    cache = make_cache(settings, double, cache_similar=True)
    double.fail = 1
    with pytest.raises(EngineError):
        cache.get_or_compute(PAGE)
    assert stored_keys(redis_client) == []
    assert cache.get_or_compute(nv.benign(PAGE, "bmp")).status is CacheStatus.MISS


def test_purge_removes_the_index_keys(settings, double, redis_client):
    cache = make_cache(settings, double, cache_similar=True)
    cache.get_or_compute(PAGE)
    cache.get_or_compute(PAGE, controls=CacheControls(namespace="acme"))
    for part in (":px2:", ":simband:", ":simref"):
        assert len(_keys(redis_client, part)) >= 2, part
    cache.purge("acme")
    for part in (":px2:", ":simband:", ":simref"):
        assert not [k for k in _keys(redis_client, part) if k.startswith(b"ocr.acme:")]
    # One image's purge removes its entry and reference; the pointers left lead nowhere.
    cache.purge("", digest_image(PAGE).md5)
    assert _keys(redis_client, ":simref") == []
    assert cache.get_or_compute(nv.benign(PAGE, "bmp")).status is CacheStatus.MISS
    cache.purge("")
    assert stored_keys(redis_client, "ocr:*") == []


# The similarity tier -----------------------------------------------------------------


def test_similarity_tier_is_off_by_default(settings, double, redis_client):
    assert settings.similar.enabled is False
    cache = make_cache(settings, double)
    cache.get_or_compute(PAGE)
    assert cache.get_or_compute(nv.benign(PAGE, "jpeg95")).status is CacheStatus.MISS
    assert _keys(redis_client, ":simband:") == [] and _keys(redis_client, ":simref") == []


def test_similarity_tier_hits_benign_and_says_so(settings, double):
    cache = make_cache(settings, double, cache_similar=True)
    first = cache.get_or_compute(PAGE)
    data = nv.benign(PAGE, "resize75")
    hit = cache.get_or_compute(data)
    assert (hit.status, hit.tier) == (CacheStatus.HIT, "similar") and double.calls == 1
    details = dict(hit.details)
    assert details["X-Cache-Similar-Source"] == digest_image(PAGE).sha256
    assert "block=" in details["X-Cache-Similarity"]
    image = decode_image(data, settings.server.max_image_pixels)
    assert (hit.result.width, hit.result.height) == (image.width, image.height)
    assert hit.result.lines[0].text == first.result.lines[0].text
    assert hit.result.lines[0].box[2] == (round(639 * 0.75), round(479 * 0.75))
    # Not stored: the exact key of the variant is still a miss for a bypassing request.
    off = cache.get_or_compute(data, controls=CacheControls(similar=False))
    assert off.status is CacheStatus.MISS and double.calls == 2


def test_similarity_tier_misses_a_changed_digit_and_a_crop(settings, double):
    cache = make_cache(settings, double, cache_similar=True)
    cache.get_or_compute(PAGE)
    box = ((36, 92), (580, 92), (580, 122), (36, 122))
    line = OcrLine("This is a lot of 12 point text to test the", 0.99, box)
    result = OcrResult(640, 480, (line,))
    digit = nv.changed(PAGE, "digit", result)
    assert digit is not None
    for data in (digit, nv.changed(PAGE, "crop2", result)):
        assert cache.get_or_compute(data).status is CacheStatus.MISS
    assert double.calls == 3


def test_template_pairs_miss(settings, double):
    cache = make_cache(settings, double, cache_similar=True)
    first, second = nv.template_pair(1)
    cache.get_or_compute(first)
    assert cache.get_or_compute(second).status is CacheStatus.MISS


def test_similar_header_is_parsed_for_every_caller(settings):
    assert controls_mod.parse({}, settings.controls).similar is True
    assert controls_mod.parse({"X-Cache-Similar": "off"}, settings.controls).similar is False
    untrusted = controls_mod.parse({"x-cache-similar": "OFF"}, settings.controls, trusted=False)
    assert untrusted.similar is False  # changes nothing shared: untrusted callers may use it
    with pytest.raises(BadRequest):
        controls_mod.parse({"X-Cache-Similar": "maybe"}, settings.controls)


def test_verify_figures_catch_one_changed_character():
    """The block figure is a maximum over small windows: one changed glyph on a page
    stands out however large the page."""
    page = np.full((600, 800), 255, np.uint8)
    import cv2

    cv2.putText(page, "TOTAL 4821.50", (50, 300), cv2.FONT_HERSHEY_SIMPLEX, 1.0, 0, 2)
    other = page.copy()
    other[270:310, :] = 255
    cv2.putText(other, "TOTAL 4827.50", (50, 300), cv2.FONT_HERSHEY_SIMPLEX, 1.0, 0, 2)
    line = OcrLine("TOTAL 4821.50", 0.99, ((45, 270), (290, 270), (290, 310), (45, 310)))
    result = OcrResult(800, 600, (line,))
    same = verify.compare(page, (800, 600), page, (800, 600), result)
    diff = verify.compare(other, (800, 600), page, (800, 600), result)
    assert same.block == 0 and same.line == 0
    defaults = Settings.from_env({})
    limits = verify.Thresholds(
        defaults.similar.max_aspect,
        defaults.similar.max_block,
        defaults.similar.max_line,
    )
    assert limits.accept(same) and not limits.accept(diff)
    assert diff.block > 3 * limits.block and diff.line > limits.line
    assert float(np.abs(other.astype(float) - page).mean()) < 1  # a page mean hides it


# Over the protocols, with the real engine ----------------------------------------------


def test_pixel_tier_over_http_across_protocols(make_app):
    client = make_app().test_client()
    page = (CORPUS / "rapidocr_en.jpg").read_bytes()
    miss = client.post("/v1/ocr", json={"image": b64(page)})
    assert miss.headers["X-Cache"] == "MISS"
    png = nv.benign(page, "png_resave")
    hit = client.post("/v1/ocr", json={"image": b64(png)})
    assert hit.headers["X-Cache"] == "HIT" and hit.headers["X-Cache-Tier"] == "pixel"
    assert hit.get_json()["cache_tier"] == "pixel"
    assert hit.get_json()["lines"] == miss.get_json()["lines"]
    bmp = nv.benign(page, "bmp")
    body = {"key": ["image"], "value": [b64(bmp)]}
    pipe = client.post("/ocr/prediction", json=body)
    assert pipe.headers["X-Cache"] == "HIT" and pipe.headers["X-Cache-Tier"] == "pixel"
    text = client.get("/metrics").get_data(as_text=True)
    assert metric_sum(text, "ocr_cache_tier_hits_total", tier="pixel") >= 2


def test_similarity_tier_over_http_and_its_bypass(make_app):
    client = make_app(cache_similar=True).test_client()
    page = (CORPUS / "rapidocr_en.jpg").read_bytes()
    client.post("/v1/ocr", json={"image": b64(page)})
    hit = client.post("/v1/ocr", json={"image": b64(nv.benign(page, "jpeg85"))})
    assert hit.headers["X-Cache"] == "HIT" and hit.headers["X-Cache-Tier"] == "similar"
    assert hit.headers["X-Cache-Similar-Source"] == hashlib.sha256(page).hexdigest()
    assert "line=" in hit.headers["X-Cache-Similarity"]
    details = hit.get_json()["cache_details"]
    assert details["X-Cache-Similar-Source"] == hashlib.sha256(page).hexdigest()
    variant = nv.benign(page, "jpeg95")
    off = client.post("/v1/ocr", json={"image": b64(variant)}, headers={"X-Cache-Similar": "off"})
    assert off.headers["X-Cache"] == "MISS"
    text = client.get("/metrics").get_data(as_text=True)
    assert metric_sum(text, "ocr_cache_tier_hits_total", tier="similar") >= 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tesseract_phototest.png", "rapidocr_en.jpg"])
def test_changed_variants_miss_with_the_real_engine(make_app, engine, name):
    """Word, digit, crop: each must be a miss; the engine's own answer is what is served."""
    client = make_app(cache_similar=True).test_client()
    page = (CORPUS / name).read_bytes()
    client.post("/v1/ocr", json={"image": b64(page)})
    base = engine.recognize(OcrRequest(page, decode_image(page, 60_000_000), engine.default_params))
    tried = 0
    for variant in nv.CHANGED:
        data = nv.changed(page, variant, base)
        if data is None:
            continue
        tried += 1
        answer = client.post("/v1/ocr", json={"image": b64(data)})
        assert answer.headers["X-Cache"] == "MISS", variant
    assert tried >= 2


def test_pixel_and_similar_tiers_over_grpc(grpc_front):
    """An image first seen over REST answers a lossless copy over gRPC (tier in the
    trailing metadata); ``x-cache-similar: off`` metadata keeps a request off the similar
    tier."""
    import grpc

    from app.protocols.pipeline_stubs import pb2, pb2_grpc

    app, endpoint = grpc_front(cache_similar=True)
    page = (CORPUS / "rapidocr_en.jpg").read_bytes()
    app.test_client().post("/v1/ocr", json={"image": b64(page)})
    stub = pb2_grpc.PipelineServiceStub(grpc.insecure_channel(endpoint))

    def ask(data: bytes, *metadata: tuple[str, str]) -> dict[str, str]:
        request = pb2.Request(key=["image"], value=[b64(data)])
        reply, call = stub.inference.with_call(request, timeout=60, metadata=metadata)
        assert reply.err_no == 0
        return dict(call.trailing_metadata())

    tiff = ask(nv.benign(page, "tiff"))
    assert (tiff["x-cache"], tiff["x-cache-tier"]) == ("HIT", "pixel")
    off = ask(nv.benign(page, "jpeg85"), ("x-cache-similar", "off"))
    assert off["x-cache"] == "MISS"
    resized = ask(nv.benign(page, "resize75"))
    assert (resized["x-cache"], resized.get("x-cache-tier")) == ("HIT", "similar")
