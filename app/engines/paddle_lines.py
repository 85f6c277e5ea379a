"""Line reuse around PaddleOCR 3.x's text recognizer (``CACHE_LINES=on``).

The OCR pipeline (``paddlex/inference/pipelines/ocr/pipeline.py``) crops the detected boxes,
optionally rotates crops by 180° (textline orientation), sorts one page's crops by aspect
ratio and calls ``text_rec_model(crops, return_word_box=...)``; that predictor takes them in
batches of ``batch_size`` (6). ``ReusingRecognizer`` stands in for that one call while a
page is computed: each crop is looked up by its digest, only the unseen ones are
recognised, and the readings come back in the pipeline's own order and form.

A crop's reading depends on its batch neighbours (measured, docs/PERFORMANCE.md): each crop
is resized to height 48 and zero-padded to the widest crop of its batch (at most
``max_imgW``), and both the model (its global mixing layers see the padding) and the CTC
decode read the padded columns; with word boxes the column count is also scaled by the
batch's widest ratio. What the crop's reading does not depend on, measured over the corpus
on CPU with one oneDNN thread (``bench/line_neighbours.py``): the batch's size, the crop's
place in it, the other crops' pixels. So the ``context`` of a crop is what the stock
predictor would give it on this page - the padded width of its batch of 6 and, with word
boxes, that batch's widest ratio - computed from the whole page (hits included)
(``Geometry``), and the unseen crops are recognised in batches of one context each, padded
to that width and decoded with that ratio. The readings are then those of reuse off,
exactly, where that measurement holds: the configuration refuses ``CACHE_LINES=on`` on a
GPU or with more than one CPU thread, where kernels may be chosen by the batch's size
(``app/config.py``). Recognising every stock batch that has an unseen crop whole instead
(exact on any device) would reuse almost nothing on template documents: a stock batch
mixes labels with values (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from app import tracing
from app.engines.base import LineUse
from app.engines.lines import (
    LineId,
    LineStore,
    Reading,
    crop_digest,
    decode_reading,
    encode_reading,
    texts_of,
)

log = logging.getLogger(__name__)


class Geometry:
    """How the stock text recognizer batches one page's crops, and what of its batch reaches
    each crop's reading (``TextRecRunnerPredictor.process``, ``OCRReisizeNormImg``)."""

    def __init__(self, model: Any) -> None:
        resize = model.pre_tfs["ReisizeNorm"]
        if resize.input_shape is not None:  # a static shape: no padding, not supported here
            raise ValueError("line reuse needs the recognizer's dynamic width (no input_shape)")
        _, self.height, width = resize.rec_image_shape[:3]
        self.base_ratio = width / self.height
        self.max_width = resize.max_imgW
        self.batch = model.batch_sampler.batch_size

    def batches(self, count: int) -> list[range]:
        """The stock batches of a page's ``count`` crops (their indices)."""
        return [range(s, min(count, s + self.batch)) for s in range(0, count, self.batch)]

    def widest(self, crops: Sequence[np.ndarray]) -> float:
        """A batch's ``max_wh_ratio`` as ``TextRecRunnerPredictor.process`` computes it."""
        widest = self.base_ratio
        for crop in crops:
            widest = max(widest, crop.shape[1] * 1.0 / crop.shape[0])
        return widest

    def width(self, widest: float) -> int:
        """The padded width of a batch: each crop's own width, the widest of them; at most
        ``max_imgW`` (a wider crop is squeezed to it)."""
        return min(self.max_width, int(self.height * widest))

    def context(self, crops: Sequence[np.ndarray], with_words: bool) -> str:
        """What of its stock batch reaches a crop's reading: without word boxes the padded
        width, with them the ratio itself (the column count is scaled by it; its exact
        float, in hex)."""
        widest = self.widest(crops)
        return f"b{widest.hex()}" if with_words else f"w{self.width(widest)}"


class ReusingRecognizer:
    """Stands in for the pipeline's ``text_rec_model`` during one page's computation.

    Every call on the store is guarded: a store that raises (or answers nonsense) is a miss
    for reads and nothing stored for writes, counted in ``store.fault``. ``model`` is the
    stock recognizer itself; ``pause`` runs between two of its batches (the engine thread's
    yield point: ``_run`` has put the predictor back as it found it by then)."""

    def __init__(
        self,
        model: Any,
        store: LineStore,
        namespace: str,
        storable: Callable[[str], bool],
        use: LineUse = LineUse(),
        pause: Callable[[], None] = lambda: None,
    ) -> None:
        self._model = model
        self._pause = pause
        self._geometry = Geometry(model)
        self._store = store
        self._namespace = namespace
        self._storable = storable
        self._use = use

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, crops: Sequence[np.ndarray], return_word_box: bool = False) -> Iterator[Any]:
        ids = self._ids(crops, return_word_box)
        unique = list(dict.fromkeys(ids))
        found = self._fetch(unique, return_word_box) if self._use.read else {}
        first: dict[LineId, int] = {}
        for at, line in enumerate(ids):
            if line not in found and line not in first:
                first[line] = at
        fresh = self._recognize(crops, first, return_word_box)
        found.update(fresh)
        if self._use.write:
            self._keep(fresh, return_word_box)
        counted = (len(ids) - len(fresh), len(fresh))
        self._guarded("count", lambda: self._store.count(*counted))
        tracing.TRACER.current().event(
            "ocr.line_reuse", {"ocr.lines.reused": counted[0], "ocr.lines.recognized": counted[1]}
        )
        font = self._model.vis_font
        for line in ids:
            text, score, words = found[line]
            yield {
                "rec_text": text if words is None else (text, words),
                "rec_score": score,
                "vis_font": font,
            }

    def _ids(self, crops: Sequence[np.ndarray], with_words: bool) -> list[LineId]:
        """Each crop's digest and context, as the stock predictor would batch this page."""
        ids = []
        for batch in self._geometry.batches(len(crops)):
            context = self._geometry.context([crops[i] for i in batch], with_words)
            ids += [LineId(crop_digest(crops[i]), context) for i in batch]
        return ids

    def _fetch(self, lines: list[LineId], with_words: bool) -> dict[LineId, Reading]:
        """The stored readings of ``lines`` that decode exactly; none when the store fails."""
        values = self._guarded("fetch", lambda: self._store.fetch(self._namespace, lines))
        if not isinstance(values, list) or len(values) != len(lines):
            if values is not None:
                self._fault("fetch", "an answer of %s for %d lines", type(values), len(lines))
            return {}
        found = {}
        for line, value in zip(lines, values, strict=True):
            reading = decode_reading(value, with_words) if value is not None else None
            if reading is not None:
                found[line] = reading
        return found

    def _keep(self, fresh: dict[LineId, Reading], with_words: bool) -> None:
        kept = []
        for line, reading in fresh.items():
            value = encode_reading(reading)
            # Never a text the redaction policy would mask; never a value that would not
            # decode (a reading outside the checked form: recognised every time instead).
            if self._may_keep(reading) and decode_reading(value, with_words) is not None:
                kept.append((line, value))
        if kept:
            ttl = self._use.ttl
            self._guarded("keep", lambda: self._store.keep(self._namespace, kept, ttl))

    def _may_keep(self, reading: Reading) -> bool:
        return all(self._storable(text) for text in texts_of(reading))

    def _guarded(self, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:  # a store's failure is a miss, never the page's
            self._fault(what, "%s", exc.__class__.__name__)
            return None

    def _fault(self, what: str, detail: str, *args: Any) -> None:
        log.debug("line store %s failed: " + detail, what, *args)
        if what != "count":
            with contextlib.suppress(Exception):  # counting a fault must not become one
                self._store.fault(what)

    def _recognize(
        self, crops: Sequence[np.ndarray], first: dict[LineId, int], with_words: bool
    ) -> dict[LineId, Reading]:
        """The unseen crops, in the page's order, in batches of one context each."""
        by_context: dict[str, list[LineId]] = {}
        for line in first:  # dict order: the page's (ascending ratio) order
            by_context.setdefault(line.context, []).append(line)
        readings: dict[LineId, Reading] = {}
        size = self._geometry.batch
        for context, lines in by_context.items():
            for start in range(0, len(lines), size):
                if readings:
                    self._pause()
                batch = lines[start : start + size]
                outputs = self._run([crops[first[line]] for line in batch], context)
                if len(outputs) != len(batch):
                    raise RuntimeError(f"the recognizer answered {len(outputs)} of {len(batch)}")
                readings.update(zip(batch, outputs, strict=True))
        return readings

    def _run(self, crops: list[np.ndarray], context: str) -> list[Reading]:
        """One predictor batch padded to the context's width and, with word boxes, decoded
        with its ratio (without them the decode does not read it)."""
        model, with_words = self._model, context.startswith("b")
        widest = float.fromhex(context[1:]) if with_words else None
        width = self._geometry.width(widest) if widest is not None else int(context[1:])
        to_batch, decode = model.pre_tfs["ToBatch"], model.post_op
        model.pre_tfs["ToBatch"] = PadTo(to_batch, width)
        if widest is not None:
            model.post_op = DecodeWith(decode, widest)
        try:
            results = list(model(crops, return_word_box=with_words))
        finally:
            model.pre_tfs["ToBatch"], model.post_op = to_batch, decode
        return [_reading(result, with_words) for result in results]


class PadTo:
    """``ToBatch`` with every crop zero-padded first to ``width`` (the stock batch's)."""

    def __init__(self, inner: Callable[[list[np.ndarray]], Any], width: int) -> None:
        self._inner, self._width = inner, width

    def __call__(self, imgs: list[np.ndarray]) -> Any:
        padded = [
            np.pad(img, ((0, 0), (0, 0), (0, self._width - img.shape[2])))
            if img.shape[2] < self._width
            else img
            for img in imgs
        ]
        return self._inner(padded)


class DecodeWith:
    """The CTC decode told the stock batch's ``max_wh_ratio`` (word boxes' column count)."""

    def __init__(self, inner: Callable[..., Any], widest: float) -> None:
        self._inner, self._widest = inner, widest

    def __call__(self, preds: Any, **kwargs: Any) -> Any:
        kwargs["max_wh_ratio"] = self._widest
        return self._inner(preds, **kwargs)


def _reading(result: Any, with_words: bool) -> Reading:
    """The recognizer's answer for one crop as a reading."""
    text, score = result["rec_text"], result["rec_score"]
    if with_words:
        text, words = text
        return text, score, words
    return text, score, None
