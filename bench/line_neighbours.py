"""Does a text-line crop's reading depend on its batch neighbours? (issue 27)

Every corpus image goes through the real pipeline with word boxes; each call of its text
recognizer (one page's crops, sorted by aspect ratio, taken in batches of 6) is recorded
with its answers. Then each crop is recognised again: alone (padded only to its own width),
alone but padded to its stock batch's width and decoded with that batch's widest ratio, and
in batches of other crops of the same context (a subset, as if the others had been found in
Redis): what ``app/engines/paddle_lines.py`` does, with its own code (``Geometry``: the
stock batches, their widest ratio and padded width, ``max_imgW`` included; ``PadTo``,
``DecodeWith``). Counted: crops whose reading (text, score, word information) differs from
the stock one. Writes ``bench/results/line_neighbours.json`` (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from app.config import Settings
from app.engines.base import OcrRequest
from app.engines.paddle import PaddleOcrEngine
from app.engines.paddle_lines import DecodeWith, Geometry, PadTo
from app.imaging import decode_image

CORPUS = Path(__file__).resolve().parent.parent.parent / "shared" / "corpus"
OUT = Path(__file__).resolve().parent / "results" / "line_neighbours.json"


def main() -> None:
    engine = PaddleOcrEngine.from_settings(Settings.from_env())
    engine.load()
    model = engine._recognizer  # the pipeline's own, unwrapped
    geometry = Geometry(model)
    recorded: list[tuple[list[np.ndarray], list[dict[str, Any]]]] = []

    class Recorder:
        def __getattr__(self, name: str) -> Any:
            return getattr(model, name)

        def __call__(self, crops: list[np.ndarray], **kwargs: Any) -> Any:
            outs = [
                {"rec_text": r["rec_text"], "rec_score": r["rec_score"], "vis_font": None}
                for r in model(crops, **kwargs)
            ]
            recorded.append(([c.copy() for c in crops], outs))
            return iter(outs)

    def run(crops: list[np.ndarray], widest: float | None = None) -> list[str]:
        to_batch, decode = model.pre_tfs["ToBatch"], model.post_op
        if widest is not None:
            model.pre_tfs["ToBatch"] = PadTo(to_batch, geometry.width(widest))
            model.post_op = DecodeWith(decode, widest)
        try:
            return [full(r) for r in model(crops, return_word_box=True)]
        finally:
            model.pre_tfs["ToBatch"], model.post_op = to_batch, decode

    def full(r: Any) -> str:
        return json.dumps([r["rec_text"], r["rec_score"]], default=str)

    engine._pausing = Recorder()  # what the engine puts in the pipeline for a plain call
    counts = dict.fromkeys(
        ("files", "crops", "padded", "alone_text", "alone_text_or_score", "alone_any_padded",
         "alone_any_unpadded", "stock_context_any", "context_batches_any"), 0,
    )  # fmt: skip
    examples: list[dict[str, Any]] = []
    params = dataclasses.replace(engine.default_params, return_word_box=True)
    started = time.time()
    for path in sorted(p for p in CORPUS.iterdir() if p.suffix in (".png", ".jpg", ".jpeg")):
        recorded.clear()
        data = path.read_bytes()
        try:
            engine.recognize(OcrRequest(data, decode_image(data, 200_000_000), params))
        except Exception:  # an image the engine refuses is no evidence either way
            continue
        counts["files"] += 1
        for crops, outs in recorded:
            context: dict[int, float] = {}
            for batch in geometry.batches(len(crops)):
                context.update(dict.fromkeys(batch, geometry.widest([crops[i] for i in batch])))
            for i, crop in enumerate(crops):
                stock, alone = full(outs[i]), run([crop])[0]
                padded = geometry.width(geometry.widest([crop])) < geometry.width(context[i])
                counts["crops"] += 1
                counts["padded"] += padded
                text_score = json.loads(stock)[0][0], json.loads(stock)[1]
                alone_ts = json.loads(alone)[0][0], json.loads(alone)[1]
                counts["alone_text"] += text_score[0] != alone_ts[0]
                counts["alone_text_or_score"] += text_score != alone_ts
                counts["alone_any_padded" if padded else "alone_any_unpadded"] += stock != alone
                counts["stock_context_any"] += stock != run([crop], context[i])[0]
                if text_score[0] != alone_ts[0] and len(examples) < 25:
                    examples.append({"file": path.name, "stock": text_score, "alone": alone_ts,
                                     "own_width": geometry.width(geometry.widest([crop])),
                                     "batch_width": geometry.width(context[i])})  # fmt: skip
            groups: dict[float, list[int]] = {}
            for i in range(len(crops)):
                groups.setdefault(context[i], []).append(i)
            for widest, members in groups.items():
                subset = members[1::2] or members
                for i, out in zip(subset, run([crops[i] for i in subset], widest), strict=True):
                    counts["context_batches_any"] += full(outs[i]) != out
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "seconds": round(time.time() - started),
        "machine": "one run on 2 shared cores (other work beside it), CPU, OCR_CPU_THREADS=1",
        "note": "padded: the crop's own width is below its stock batch's",
        "counts": counts,
        "examples": examples,
    }
    OUT.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
