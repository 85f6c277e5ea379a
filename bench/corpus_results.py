"""Real engine results for the corpus images, split once into a training and a held-out set.

The zstd dictionary (``bench/train_dictionary.py``) is trained on the training set only; the
entry-size measurement (``bench/entry_size.py``, part of ``make bench``) reports the held-out
set, so the ratio is not flattered by the dictionary having seen the same results. Results
are kept in a local cache file (not committed) so the two tools share one engine pass.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from app.vocabulary import OcrResult

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("OCR_SHARED_DIR", ROOT.parent / "shared")) / "corpus"
RESULTS_DIR = ROOT / "bench" / "results"
CACHE = RESULTS_DIR / ".corpus_results.json"  # regenerated when missing


def corpus_images() -> list[str]:
    """Every corpus image, in MANIFEST order (PDFs and other non-images left out)."""
    rows = (CORPUS / "MANIFEST.tsv").read_text().splitlines()[1:]
    names = [row.split("\t", 1)[0] for row in rows if row.strip()]
    return [n for n in names if n.rsplit(".", 1)[-1].lower() in {"jpg", "jpeg", "png", "bmp"}]


def split() -> tuple[list[str], list[str]]:
    """(training, held out): every third image is held out."""
    names = corpus_images()
    return (
        [n for i, n in enumerate(names) if i % 3 != 0],
        [n for i, n in enumerate(names) if i % 3 == 0],
    )


def results(names: list[str], word_boxes: bool = False) -> dict[str, OcrResult]:
    """The engine's result per image (computed on first use, then read from the cache file)."""
    cached: dict[str, dict] = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    tag = "words:" if word_boxes else ""
    missing = [n for n in names if tag + n not in cached]
    if missing:
        from app.config import Settings
        from app.engines.base import OcrRequest
        from app.engines.paddle import PaddleOcrEngine
        from app.imaging import decode_image

        engine = PaddleOcrEngine.from_settings(Settings.from_env({}))
        engine.load()
        params = dataclasses.replace(engine.default_params, return_word_box=word_boxes)
        for name in missing:
            data = (CORPUS / name).read_bytes()
            try:
                image = decode_image(data, 60_000_000)
            except Exception:  # noqa: BLE001 - a corpus file the service refuses too
                continue
            cached[tag + name] = engine.recognize(OcrRequest(data, image, params)).to_dict()
            print(f"engine: {tag}{name}", flush=True)
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        CACHE.write_text(json.dumps(cached))
    return {n: OcrResult.from_dict(cached[tag + n]) for n in names if tag + n in cached}
