"""PaddleOCR 3.x (PP-OCR det + textline orientation + rec) on Paddle Inference, in-process.

Settings follow docs/ENGINES.md: local model dirs with names, doc orientation and
unwarping off, ``paddle_static`` with oneDNN and the old IR (the defaults crash on CPU and try
to download models), and a fixed thread count that is part of the fingerprint.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from app import memory, tracing
from app.engines import paddle_models, tasks
from app.engines.base import EngineBase, OcrRequest, fingerprint_of
from app.engines.engine_thread import EngineThread
from app.engines.lines import LineStore
from app.engines.paddle_lines import ReusingRecognizer
from app.imaging import DecodedImage
from app.vocabulary import (
    DETECTION_PARAMS,
    RESULT_SCHEMA_VERSION,
    EngineError,
    OcrLine,
    OcrParams,
    OcrResult,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _opencv_versions() -> dict[str, str]:
    """Each OpenCV distribution installed (one of them provides ``cv2``)."""
    dists = ("opencv-python", "opencv-python-headless", "opencv-contrib-python",
             "opencv-contrib-python-headless")  # fmt: skip
    return {dist: _version(dist) for dist in dists if _version(dist) != "absent"}


if TYPE_CHECKING:
    from app.config import PaddleSettings, Settings


class PaddleOcrEngine(EngineBase):
    """One PaddleOCR pipeline per worker process; calls are serialized (not thread-safe)."""

    kind = "paddle"
    slots: int | None = 1  # calls are serialized on one thread: queue them in the cache's runner
    batching = True  # ``recognize_many``: one pipeline call over a list
    reads_decoded_pixels = True  # recognizes DecodedImage.pixels: the pixel tier is exact
    can_interject = True  # between two recognition batches of the page in progress
    reuses_lines = True  # ``CACHE_LINES``

    @classmethod
    def from_settings(cls, settings: Settings) -> PaddleOcrEngine:
        """As ``OCR_ENGINE=paddle`` configures it (the wiring's and the tests' way in)."""
        return cls(settings.paddle, settings.ocr.params())

    def __init__(self, section: PaddleSettings, default_params: OcrParams) -> None:
        self._options = section
        # The orientation model is always loaded so requests may switch it on.
        self._models = paddle_models.resolve(section.model_dir, section.work_dir, with_cls=True)
        self._default_params = default_params
        paddle_dist = "paddlepaddle-gpu" if section.device == "gpu" else "paddlepaddle"
        self._runtime = {
            "runtime": "paddle_inference",
            "device": section.device,
            "cpu_threads": section.cpu_threads,
            "paddle": _version(paddle_dist),
            "paddleocr": _version("paddleocr"),
            "paddlex": _version("paddlex"),
        }
        identity = {
            "kind": self.kind,
            "schema": RESULT_SCHEMA_VERSION,
            "models": {m.name: m.digest for m in self._model_list()},
            "runtime": self._runtime,
        }
        self._fingerprint = fingerprint_of(identity)
        # Line reuse's keys (not the entries'): what shapes a reading after the crop's digest
        # besides the fingerprint - OpenCV resizes each crop to the recognizer's height.
        self.line_schema = fingerprint_of({"opencv": _opencv_versions()})
        self._pipeline: Any = None
        self._recognizer: Any = None  # the pipeline's own text recognizer (unwrapped)
        self._pausing: Any = None  # the same, pausing between its batches
        self._lines: tuple[LineStore, Callable[[str], bool]] | None = None  # use_line_store
        # The predictors are built and always called on this one thread: Paddle Inference
        # with oneDNN failed with an opaque std::exception here when one predictor was called
        # from many threads in turn, even one at a time. It also serializes the calls, and
        # lets a call be interjected into another between recognition batches (``interject``).
        self._runner = EngineThread("paddle")

    def _model_list(self) -> list[paddle_models.ModelDir]:
        models = [self._models.det, self._models.rec]
        if self._models.cls is not None:
            models.append(self._models.cls)
        return models

    def check_params(self, params: OcrParams) -> None:
        """Every detection parameter is supported in-process; the task is "ocr"."""
        tasks.require_ocr(params, self.kind)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "fingerprint": self._fingerprint,
            "models": {m.name: m.digest[:16] for m in self._model_list()},
            **self._runtime,
        }

    def prepare(self) -> None:
        """Import Paddle now, in the calling (main) thread, keeping Python's signal handlers.

        ``import paddle`` installs C++ handlers that abort the process on SIGTERM, which would
        turn a server's graceful shutdown into lost requests. We switch them off and re-arm
        the Python handlers, which only the main thread may do.
        """
        import signal

        import paddle

        paddle.disable_signal_handler()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
                handler = signal.getsignal(sig)
                if handler is not None:
                    signal.signal(sig, handler)

    def load(self) -> None:
        self._runner.submit(self._load_here).result()

    def _load_here(self) -> None:
        if self._pipeline is None:
            self._pipeline = self._build()
            inner = self._inner()
            self._recognizer = inner.text_rec_model
            self._pausing = Pausing(self._recognizer, self._yield_point)
            inner.text_det_model = Spanned(inner.text_det_model, "ocr.detection")
            inner.textline_orientation_model = Spanned(
                inner.textline_orientation_model, "ocr.textline_orientation"
            )
            warmup = OcrRequest(b"", _warmup_image(), self._default_params)
            self._predict_here([warmup], reuse=False)  # nothing of the warm-up is stored

    def _build(self) -> Any:
        # paddlex checks model hosters on import unless told not to; we never download.
        os.environ.setdefault("PADDLE_PDX_DISABLE_MODEL_SOURCE_CHECK", "True")
        from paddleocr import PaddleOCR  # heavy import: only in the worker that runs it

        kwargs = pipeline_kwargs(self._options, self._models)
        log.info("loading PaddleOCR (%s, fingerprint %s)", kwargs["device"], self._fingerprint)
        return PaddleOCR(**kwargs)

    def recognize(self, request: OcrRequest) -> OcrResult:
        if self._runner.on_thread():  # an interjected call (``interject``) runs inline
            return self._recognize_here(request)
        return self._runner.submit(self._recognize_here, request).result()

    def interject(self, call: Callable[[], T]) -> Future[T]:
        """``call()`` on the engine's thread at the next pause of the page in progress
        (between two recognition batches; at once when idle): the feeders' way to start a
        short ticket of another tenant without waiting for a long page to end. The page then
        resumes; both results are those of either page alone (``tests/test_engine.py``)."""
        return self._runner.interject(call)

    def _yield_point(self) -> None:
        """The engine thread's yield point; a pause that ran interjected calls is an event of
        the paused call's span."""
        ran = self._runner.yield_point()
        if ran:
            tracing.TRACER.current().event("engine.paused", {"ocr.interjected_calls": ran})

    def recognize_many(self, requests: list[OcrRequest]) -> list[OcrResult]:
        """Several images with one set of parameters in one pipeline call (a list input:
        ``ENGINE_BATCH_MAX``); results in order."""
        if self._runner.on_thread():
            return self._predict_here(requests)
        return self._runner.submit(self._predict_here, requests).result()

    def _recognize_here(self, request: OcrRequest) -> OcrResult:
        return self._predict_here([request])[0]

    def use_line_store(
        self, store: LineStore | None, storable: Callable[[str], bool] = lambda text: True
    ) -> None:
        """Line reuse on (a store) or off (None): each line crop that reaches the recognizer
        is looked up in ``store`` first (``paddle_lines``); ``storable`` says which texts
        may be kept there (the redaction wrapper's say)."""
        self._lines = None if store is None else (store, storable)

    def _predict_here(self, requests: list[OcrRequest], reuse: bool = True) -> list[OcrResult]:
        if self._pipeline is None:
            raise EngineError("engine not loaded")
        lines = self._lines if reuse else None  # read once: use_line_store may run meanwhile
        try:
            if lines is not None and any(not r.lines.off for r in requests):
                return [
                    self._predict_plain([r])[0] if r.lines.off else self._predict_reusing(r, *lines)
                    for r in requests
                ]
            return self._predict_plain(requests)
        finally:
            memory.release_free_memory()  # the call's activations, freed: not kept for good

    def _predict_plain(self, requests: list[OcrRequest]) -> list[OcrResult]:
        """The stock pipeline call, untouched (reuse off)."""
        # The whole page goes in, as upstream's serving passes it: detection resizes by itself
        # (limit_side_len, max_side_limit 4000) and recognition crops from the full image.
        # Memory is bounded by MAX_IMAGE_PIXELS at decode time.
        p = requests[0].params
        images = [np.ascontiguousarray(r.image.pixels[:, :, ::-1]) for r in requests]
        outputs = self._predict_pages(images[0] if len(images) == 1 else images, p)
        if len(outputs) != len(requests):
            raise EngineError(f"paddle answered {len(outputs)} results for {len(requests)}")
        return [_result(r.image, raw, p) for r, raw in zip(requests, outputs, strict=True)]

    def _predict_pages(self, images: Any, p: OcrParams) -> list[Any]:
        try:
            return self._run_pipeline(images, p, self._pausing)
        except Exception as exc:  # the runtime raises anything; never let it be cached
            log.warning("paddle inference failed: %s", str(exc)[-500:])
            raise EngineError(f"paddle inference failed: {exc.__class__.__name__}") from exc

    def _inner(self) -> Any:
        return self._pipeline.paddlex_pipeline._pipeline  # the single-device pipeline

    def _run_pipeline(self, images: Any, p: OcrParams, recognizer: Any) -> list[Any]:
        """The pipeline with ``recognizer`` as its text recognizer for this call only: a
        call interjected into another's pause puts its own in and the paused call's back."""
        inner = self._inner()
        paused, inner.text_rec_model = inner.text_rec_model, Spanned(recognizer, "ocr.recognition")
        try:
            outputs = self._pipeline.predict(
                images,
                **{keyword: getattr(p, name) for name, keyword in DETECTION_PARAMS.items()},
                text_rec_score_thresh=0.0,
                return_word_box=p.return_word_box,
            )
            return list(outputs)
        finally:
            inner.text_rec_model = paused

    def _predict_reusing(
        self, request: OcrRequest, store: LineStore, storable: Callable[[str], bool]
    ) -> OcrResult:
        """One page with line reuse: the pipeline's recognizer stands in for this call only
        (one page a call, so each page's crops are looked up in its own tenant namespace;
        the stock pipeline computes a list one page at a time too: batch size 1). Anything
        that fails on the way (the reuse code, a reading, the store beyond its guards) costs
        this page one more computation with reuse off, never its answer."""
        try:
            recognizer = ReusingRecognizer(
                self._recognizer, store, request.namespace, storable, request.lines,
                pause=self._yield_point,
            )  # fmt: skip
            image = np.ascontiguousarray(request.image.pixels[:, :, ::-1])
            outputs = self._run_pipeline(image, request.params, recognizer)
            if len(outputs) != 1:
                raise ValueError(f"paddle answered {len(outputs)} results for 1")
            return _result(request.image, outputs[0], request.params)
        except Exception as exc:
            log.warning("line reuse failed (%s): the page computed with reuse off", _named(exc))
            with contextlib.suppress(Exception):  # counting a fault must not become one
                store.fault("page")
            return self._predict_plain([request])[0]


class Pausing:
    """The pipeline's text recognizer, pausing between its batches (``pause``: the engine
    thread's yield point): the stock predictor recognises a page's crops lazily, batch by
    batch, so between two batches nothing of this page is in the predictor."""

    def __init__(self, model: Any, pause: Callable[[], None]) -> None:
        self._model, self._pause = model, pause

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, crops: Sequence[Any], **kwargs: Any) -> Iterator[Any]:
        size = self._model.batch_sampler.batch_size
        for done, reading in enumerate(self._model(crops, **kwargs), 1):
            yield reading
            if done % size == 0 and done < len(crops):
                self._pause()


class Spanned:
    """One of the pipeline's models (detection, textline orientation, recognition) whose
    calls are spans: children of the engine call's span, whose context comes along to the
    engine's thread (``engine_thread``). The models answer lazily, so a span lasts until the
    pipeline has read the last answer (a pause for an interjected call included)."""

    def __init__(self, model: Any, name: str) -> None:
        self._model, self._name = model, name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, inputs: Sequence[Any], **kwargs: Any) -> Iterator[Any]:
        tracer = tracing.TRACER  # a child of a traced call only (not the warm-up's)
        span = (
            tracer.span(self._name, {"ocr.inputs": len(inputs)})
            if tracer.current().recording
            else tracing.NO_SPAN
        )
        try:
            yield from self._model(inputs, **kwargs)
        finally:
            span.end()


def _named(exc: BaseException) -> str:
    return exc.__class__.__name__


def _result(image: Any, raw: Any, p: OcrParams) -> OcrResult:
    """One pipeline output as our result (every line, with its score)."""
    angles = list(raw.get("textline_orientation_angles") or [])
    if len(angles) != len(raw["rec_texts"]):
        angles = [-1] * len(raw["rec_texts"])
    texts = raw["rec_texts"]
    words: list[tuple[Any, ...]] = [()] * len(texts)
    if p.return_word_box:
        words = [
            tuple(
                (str(word), tuple(int(v) for v in box))
                for word, box in zip(line_words, line_boxes, strict=True)
            )
            for line_words, line_boxes in zip(raw["text_word"], raw["text_word_boxes"], strict=True)
        ]
    lines = []
    for text, score, poly, angle, line_words in zip(
        texts, raw["rec_scores"], raw["rec_polys"], angles, words, strict=True
    ):
        box = tuple((int(x), int(y)) for x, y in np.asarray(poly).reshape(-1, 2)[:4])
        lines.append(OcrLine(str(text), float(score), box, int(angle), line_words))  # type: ignore[arg-type]
    return OcrResult(width=image.width, height=image.height, lines=tuple(lines))


def pipeline_kwargs(options: PaddleSettings, models: paddle_models.ModelSet) -> dict[str, Any]:
    """``PaddleOCR(**kwargs)`` for our models and engine settings (also the parity oracle's)."""
    engine_config: dict[str, Any]
    if options.device == "gpu":
        device, engine_config = "gpu:0", {"run_mode": "paddle"}
    else:
        device = "cpu"
        engine_config = {
            "run_mode": "mkldnn",
            "enable_new_ir": False,
            "cpu_threads": options.cpu_threads,
            "mkldnn_cache_capacity": 10,
        }
    assert models.cls is not None
    return {
        "text_detection_model_name": models.det.name,
        "text_detection_model_dir": str(models.det.path),
        "text_recognition_model_name": models.rec.name,
        "text_recognition_model_dir": str(models.rec.path),
        "textline_orientation_model_name": models.cls.name,
        "textline_orientation_model_dir": str(models.cls.path),
        "use_doc_orientation_classify": False,
        "use_doc_unwarping": False,
        "use_textline_orientation": True,  # per-call switch, see recognize()
        "text_rec_score_thresh": 0.0,  # keep every line: protocols filter at render time
        "device": device,
        "engine": "paddle_static",
        "engine_config": engine_config,
    }


def _warmup_image() -> DecodedImage:
    """A synthetic A4 page (150 dpi) of a few text lines: runs det and rec once at start-up
    (under a second), and brings the worker's memory to its working size for document pages
    - the shapes its caches keep - before it serves, not in steps under traffic (measured:
    a worker meeting larger pages late grew +1.7 % after this warm-up, +5.4 % after a
    text line's; docs/RELIABILITY.md#soak)."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (1240, 1754), "white")
    draw, font = ImageDraw.Draw(img), ImageFont.load_default(size=22)
    for i in range(6):
        draw.text((60, 80 + 280 * i), f"Warm up {i}: 0123456789 ABCDEFG", fill="black", font=font)
    return DecodedImage(np.asarray(img), img.width, img.height)
