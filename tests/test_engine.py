"""The real PaddleOCR engine (Paddle Inference, CPU) on real corpus images."""

import difflib
import shutil

import pytest

from app.engines.base import OcrRequest
from app.engines.paddle import PaddleOcrEngine
from app.engines.paddle_models import ModelFilesError, from_wheel
from app.imaging import ImageTooLarge, InvalidImage, decode_image
from app.vocabulary import OcrParams
from tests.conftest import PHOTOTEST, WORD_EN

pytestmark = pytest.mark.integration


def _decode(path):
    return decode_image(path.read_bytes(), 60_000_000)


def _ocr(engine, path, **params):
    base = engine.default_params
    params = OcrParams(**{**base.__dict__, **params})
    return engine.recognize(OcrRequest(path.read_bytes(), _decode(path), params))


def test_reads_phototest_like_its_ground_truth(engine):
    result = _ocr(engine, PHOTOTEST)
    truth = " ".join(PHOTOTEST.with_suffix(".txt").read_text().split())
    got = " ".join(line.text for line in result.lines)
    assert difflib.SequenceMatcher(None, got, truth).ratio() > 0.97
    assert (result.width, result.height) == (640, 480)
    tops = [line.box[0][1] for line in result.lines]
    assert tops == sorted(tops)  # reading order
    for line in result.lines:
        assert 0.5 <= line.score <= 1.0
        assert all(0 <= x <= 640 and 0 <= y <= 480 for x, y in line.box)


def test_deterministic_for_the_same_bytes(engine):
    assert _ocr(engine, WORD_EN) == _ocr(engine, WORD_EN)


def test_every_line_is_kept_with_its_score(engine):
    """Engines keep low-score lines: protocols filter at render time."""
    from tests.conftest import CORPUS

    result = _ocr(engine, CORPUS / "sroie_000.jpg")
    assert any(line.score < 0.5 for line in result.lines)
    assert len(result.filtered(0.5)) < len(result.lines)


def interjected(engine, long_call, short_call):
    """``short_call()`` interjected into ``long_call()`` at its first pause between two
    recognition batches, both on the engine's thread: (long's answer, short's, the order
    things happened in)."""
    events = []

    def long():
        short = engine.interject(lambda: events.append("short") or short_call())
        events.append("long: start")
        answer = long_call()  # engine.recognize runs inline on the engine's own thread
        events.append("long: end")
        return answer, short

    answer, short = engine._runner.submit(long).result(60)
    return answer, short.result(60), events


def test_a_page_interjected_into_another_answers_as_alone(engine):
    """The fair queue's interjection (``PaddleOcrEngine.interject``): a page computed
    between two recognition batches of another, on the same predictors, and that page
    resumed: each answer is the one it has alone, both with word boxes too."""
    for params in ({}, {"return_word_box": True, "textline_orientation": True}):
        alone = [_ocr(engine, path, **params) for path in (PHOTOTEST, WORD_EN)]
        long, short, events = interjected(
            engine,
            lambda params=params: _ocr(engine, PHOTOTEST, **params),
            lambda: _ocr(engine, WORD_EN),
        )
        assert events == ["long: start", "short", "long: end"]  # inside, not after
        assert long == alone[0]
        assert short == _ocr(engine, WORD_EN)
        if params:
            assert long.lines[0].words


def test_params_change_the_output(engine):
    default = _ocr(engine, WORD_EN)
    assert [ln.angle for ln in default.lines] == [-1] * len(default.lines)
    oriented = _ocr(engine, WORD_EN, textline_orientation=True)
    assert all(ln.angle in (0, 1) for ln in oriented.lines)  # class ids, as upstream
    coarse = _ocr(engine, PHOTOTEST, det_limit_side_len=64, det_limit_type="max")
    assert coarse != _ocr(engine, PHOTOTEST)


def test_fingerprint_covers_model_file_contents(base_settings, engine, tmp_path):
    models = from_wheel(tmp_path / "gen", with_cls=True)
    mounted = tmp_path / "mounted"
    for sub, model in (("det", models.det), ("rec", models.rec), ("cls", models.cls)):
        shutil.copytree(model.path, mounted / sub)
    same = PaddleOcrEngine.from_settings(base_settings.with_overrides(ocr_model_dir=str(mounted)))
    assert same.fingerprint == engine.fingerprint  # same files, same identity
    with open(mounted / "rec" / "inference.pdiparams", "ab") as fh:
        fh.write(b"\0")  # "upgraded" weights
    changed = PaddleOcrEngine.from_settings(
        base_settings.with_overrides(ocr_model_dir=str(mounted))
    )
    assert changed.fingerprint != engine.fingerprint
    shutil.rmtree(mounted / "det")
    with pytest.raises(ModelFilesError):
        PaddleOcrEngine.from_settings(base_settings.with_overrides(ocr_model_dir=str(mounted)))


def test_thread_count_is_part_of_the_fingerprint(base_settings, engine):
    assert PaddleOcrEngine.from_settings(
        base_settings.with_overrides(ocr_cpu_threads=2)
    ).fingerprint != (engine.fingerprint)


@pytest.mark.parametrize(
    "data",
    [b"", b"not an image", PHOTOTEST.read_bytes()[:200]],
    ids=["empty", "text", "truncated"],
)
def test_undecodable_bytes_are_refused(data):
    with pytest.raises(InvalidImage):
        decode_image(data, 60_000_000)


def test_pixel_limit_is_checked_before_decoding():
    with pytest.raises(ImageTooLarge):
        decode_image(PHOTOTEST.read_bytes(), 640 * 480 - 1)
