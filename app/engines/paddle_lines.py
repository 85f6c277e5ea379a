"""Line reuse around PaddleOCR 3.x's text recognizer (``CACHE_LINES=on``).

The OCR pipeline (``paddlex/inference/pipelines/ocr/pipeline.py``) crops the detected boxes,
optionally rotates crops by 180° (textline orientation), sorts one page's crops by aspect
ratio and calls ``text_rec_model(crops, return_word_box=...)``; that predictor takes them in
batches of ``batch_size`` (6). ``ReusingRecognizer`` stands in for that one call while a
page is computed: each crop is looked up by its digest, only the unseen ones are
recognised, and the readings come back in the pipeline's own order and form.

A crop's reading depends on its batch neighbours (measured, docs/PERFORMANCE.md): each crop
is resized to height 48 and zero-padded to the widest crop of its batch, and both the model
(its global mixing layers see the padding) and the CTC decode read the padded columns;
with word boxes the column count is also scaled by the batch's widest ratio. What the
crop's reading does not depend on (measured over the corpus): the batch's size, the crop's
place in it, the other crops' pixels. So the ``context`` of a crop is what the stock
predictor would give it on this page - the padded width of its batch of 6 and, with word
boxes, that batch's widest ratio - computed from the whole page (hits included), and the
unseen crops are recognised in batches of one context each, padded to that width and
decoded with that ratio. The readings are then those of reuse off, exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from app.engines.lines import (
    LineId,
    LineStore,
    Reading,
    crop_digest,
    decode_reading,
    encode_reading,
    texts_of,
)


class ReusingRecognizer:
    """Stands in for the pipeline's ``text_rec_model`` during one page's computation."""

    def __init__(
        self,
        model: Any,
        store: LineStore,
        namespace: str,
        storable: Callable[[str], bool],
    ) -> None:
        self._model = model
        self._store = store
        self._namespace = namespace
        self._storable = storable
        resize = model.pre_tfs["ReisizeNorm"]
        if resize.input_shape is not None:  # a static shape: no padding, not supported here
            raise ValueError("line reuse needs the recognizer's dynamic width (no input_shape)")
        _, self._height, width = resize.rec_image_shape[:3]
        self._base_ratio = width / self._height
        self._max_width = resize.max_imgW
        self._batch = model.batch_sampler.batch_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, crops: Sequence[np.ndarray], return_word_box: bool = False) -> Iterator[Any]:
        ids = self._ids(crops, return_word_box)
        unique = list(dict.fromkeys(ids))
        found: dict[LineId, Reading] = {}
        for line, value in zip(unique, self._store.fetch(self._namespace, unique), strict=True):
            reading = None if value is None else decode_reading(value, return_word_box)
            if reading is not None:
                found[line] = reading
        first: dict[LineId, int] = {}
        for at, line in enumerate(ids):
            if line not in found and line not in first:
                first[line] = at
        fresh = self._recognize(crops, first, return_word_box)
        found.update(fresh)
        self._store.keep(
            self._namespace,
            [(line, encode_reading(r)) for line, r in fresh.items() if self._may_keep(r)],
        )
        self._store.count(reused=len(ids) - len(fresh), recognized=len(fresh))
        font = self._model.vis_font
        for line in ids:
            text, score, words = found[line]
            yield {
                "rec_text": text if words is None else (text, words),
                "rec_score": score,
                "vis_font": font,
            }

    def _may_keep(self, reading: Reading) -> bool:
        return all(self._storable(text) for text in texts_of(reading))

    def _ids(self, crops: Sequence[np.ndarray], with_words: bool) -> list[LineId]:
        """Each crop's digest and context, as the stock predictor would batch this page."""
        ids = []
        for start in range(0, len(crops), self._batch):
            batch = crops[start : start + self._batch]
            context = self._context(self._widest(batch), with_words)
            ids += [LineId(crop_digest(crop), context) for crop in batch]
        return ids

    def _widest(self, batch: Sequence[np.ndarray]) -> float:
        """The batch's ``max_wh_ratio`` as ``TextRecRunnerPredictor.process`` computes it."""
        widest = self._base_ratio
        for crop in batch:
            widest = max(widest, crop.shape[1] * 1.0 / crop.shape[0])
        return widest

    def _width(self, widest: float) -> int:
        """The padded width of a batch (``OCRReisizeNormImg``: each crop's own width, the
        widest of them; at most ``max_imgW``)."""
        return min(self._max_width, int(self._height * widest))

    def _context(self, widest: float, with_words: bool) -> str:
        # Without word boxes only the padded width reaches the output; with them the ratio
        # itself does (the column count is scaled by it): its exact float, in hex.
        return f"b{widest.hex()}" if with_words else f"w{self._width(widest)}"

    def _recognize(
        self, crops: Sequence[np.ndarray], first: dict[LineId, int], with_words: bool
    ) -> dict[LineId, Reading]:
        """The unseen crops, in the page's order, in batches of one context each."""
        by_context: dict[str, list[LineId]] = {}
        for line in first:  # dict order: the page's (ascending ratio) order
            by_context.setdefault(line.context, []).append(line)
        readings: dict[LineId, Reading] = {}
        for context, lines in by_context.items():
            for start in range(0, len(lines), self._batch):
                batch = lines[start : start + self._batch]
                outputs = self._run([crops[first[line]] for line in batch], context)
                readings.update(zip(batch, outputs, strict=True))
        return readings

    def _run(self, crops: list[np.ndarray], context: str) -> list[Reading]:
        """One predictor batch padded to the context's width and, with word boxes, decoded
        with its ratio (without them the decode does not read it)."""
        model, with_words = self._model, context.startswith("b")
        widest = float.fromhex(context[1:]) if with_words else None
        width = self._width(widest) if widest is not None else int(context[1:])
        to_batch, decode = model.pre_tfs["ToBatch"], model.post_op
        model.pre_tfs["ToBatch"] = _PadTo(to_batch, width)
        if widest is not None:
            model.post_op = _DecodeWith(decode, widest)
        try:
            results = list(model(crops, return_word_box=with_words))
        finally:
            model.pre_tfs["ToBatch"], model.post_op = to_batch, decode
        readings: list[Reading] = []
        for result in results:
            text, score = result["rec_text"], result["rec_score"]
            if with_words:
                text, words = text
                readings.append((text, score, words))
            else:
                readings.append((text, score, None))
        return readings


class _PadTo:
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


class _DecodeWith:
    """The CTC decode told the stock batch's ``max_wh_ratio`` (word boxes' column count)."""

    def __init__(self, inner: Callable[..., Any], widest: float) -> None:
        self._inner, self._widest = inner, widest

    def __call__(self, preds: Any, **kwargs: Any) -> Any:
        kwargs["max_wh_ratio"] = self._widest
        return self._inner(preds, **kwargs)
