"""``make bench-lines``: line reuse (``CACHE_LINES``, issue 27) on template documents.

For each set of ``bench/templates.py`` (three layouts, clean and re-scanned, N copies with
different values; plus the invoice with word boxes) every document goes through the real
engine twice, side by side: reuse off, then reuse on with the set's own tenant namespace
filling as it goes (the order alternates per document, so neither side always runs on a
warmer machine). Recorded per set: the share of crops reused, the recognizer's batch calls,
engine time per document both ways (and their ratio), Redis bytes per stored and per
reused line (``MEMORY USAGE``; the values sealed as with ``CACHE_ENCRYPTION_KEYS``), and
whether every answer with reuse on equalled the answer with reuse off. Also the share that
reusing whole stock batches only would reuse (a batch recognised as it is whenever one of
its crops is new: exact on any device, the alternative to refusing GPUs and threads),
counted on the stock batches of the reuse-off side. Writes ``bench/results/lines.json``.
One run, on whatever machine it is: read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import redis

from app import metrics
from app.cache.breaker import CircuitBreaker
from app.cache.codec import Codec
from app.cache.keys import KeySpace
from app.cache.lines import RedisLineStore
from app.cache.store import RedisStore
from app.config import Settings
from app.embedded_redis import EmbeddedRedis
from app.engines.base import OcrRequest
from app.engines.lines import crop_digest
from app.engines.paddle import PaddleOcrEngine
from app.engines.paddle_lines import Geometry
from app.imaging import decode_image
from bench.templates import LAYOUTS, document

OUT = Path(__file__).resolve().parent / "results" / "lines.json"
KEYS = (("bench", b"0123456789abcdef0123456789abcdef"),)  # the values sealed, as in production


class StockBatches:
    """Records each page's stock recognizer batches (each crop's digest and context) while
    installed as the engine's plain recognizer (the reuse-off side only)."""

    def __init__(self, model: Any) -> None:
        self.model, self.geometry = model, Geometry(model)
        self.pages: list[list[list[tuple[str, str]]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, crops: list[Any], return_word_box: bool = False) -> Any:
        page = []
        for batch in self.geometry.batches(len(crops)):
            members = [crops[i] for i in batch]
            context = self.geometry.context(members, return_word_box)
            page.append([(crop_digest(crop), context) for crop in members])
        self.pages.append(page)
        return self.model(crops, return_word_box=return_word_box)


def whole_batches(pages: list[list[list[tuple[str, str]]]]) -> tuple[int, int]:
    """(crops reused, batches recognised) if only stock batches whose every crop was stored
    were reused, the others recognised whole (and stored), page after page."""
    stored: set[tuple[str, str]] = set()
    reused = recognised = 0
    for page in pages:
        for batch in page:
            if all(line in stored for line in batch):
                reused += len(batch)
            else:
                recognised += 1
        stored.update(line for batch in page for line in batch)
    return reused, recognised


class CountedCalls:
    """Counts the recognizer's batches (``TextRecRunnerPredictor.process`` calls)."""

    def __init__(self, model: Any) -> None:
        self.calls = 0
        process = model.process

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return process(*args, **kwargs)

        model.process = counted


def _line(outcome: str) -> float:
    return metrics.LINES.labels(outcome=outcome)._value.get()  # type: ignore[attr-defined]


def run_set(
    engine: PaddleOcrEngine,
    store: RedisLineStore,
    calls: CountedCalls,
    client: redis.Redis,
    name: str,
    docs: list[bytes],
    words: bool,
) -> dict[str, Any]:
    params = dataclasses.replace(engine.default_params, return_word_box=words)
    off_s, on_s, off_calls, on_calls, differ = [], [], 0, 0, 0
    plain = engine._pausing  # what the engine puts in the pipeline for a reuse-off call
    stock = StockBatches(engine._recognizer)
    reused0, recognized0 = _line("reused"), _line("recognized")
    for i, data in enumerate(docs):
        request = OcrRequest(data, decode_image(data, 100_000_000), params, name)
        sides = ("off", "on") if i % 2 == 0 else ("on", "off")
        results = {}
        for side in sides:
            engine.use_line_store(store if side == "on" else None)
            if side == "off":
                engine._pausing = stock
            before, started = calls.calls, time.perf_counter()
            results[side] = engine.recognize(request)
            spent, made = time.perf_counter() - started, calls.calls - before
            engine._pausing = plain
            if side == "on":
                on_s.append(spent)
                on_calls += made
            else:
                off_s.append(spent)
                off_calls += made
        differ += results["on"] != results["off"]
    engine.use_line_store(None)
    reused = int(_line("reused") - reused0)
    recognized = int(_line("recognized") - recognized0)
    line_keys = list(client.scan_iter(f"ocr.{name}:*:line1:*", count=1000))
    whole_reused, whole_batches_recognised = whole_batches(stock.pages)
    memory = sum(int(client.memory_usage(key) or 0) for key in line_keys)
    return {
        "set": name,
        "documents": len(docs),
        "word_boxes": words,
        "crops": reused + recognized,
        "reused": reused,
        "reused_share": round(reused / max(1, reused + recognized), 4),
        "recognizer_calls_off": off_calls,
        "recognizer_calls_on": on_calls,
        "reused_share_whole_batches": round(whole_reused / max(1, reused + recognized), 4),
        "recognizer_calls_whole_batches": whole_batches_recognised,
        "engine_seconds_per_doc_off": round(statistics.mean(off_s), 4),
        "engine_seconds_per_doc_on": round(statistics.mean(on_s), 4),
        "on_over_off": round(sum(on_s) / sum(off_s), 3),
        # After the first copy: the steady state of a template already seen.
        "on_over_off_after_first": round(sum(on_s[1:]) / sum(off_s[1:]), 3),
        "stored_lines": len(line_keys),
        "redis_bytes_per_stored_line": round(memory / max(1, len(line_keys)), 1),
        "redis_bytes_per_reused_line": round(memory / reused, 1) if reused else None,
        "answers_differing_from_reuse_off": differ,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    settings = Settings.from_env()
    engine = PaddleOcrEngine.from_settings(settings)
    engine.load()
    calls = CountedCalls(engine._recognizer)
    sets = [(layout, False, False) for layout in LAYOUTS]
    sets += [(layout, True, False) for layout in LAYOUTS] + [("invoice", False, True)]
    rows = []
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        raw = RedisStore(server.url, 1000, 1000, CircuitBreaker(3, 2.0))
        keys = KeySpace("ocr", engine.fingerprint)
        store = RedisLineStore(raw, keys, Codec(KEYS), lambda: 86400, engine.line_schema)
        for layout, scanned, words in sets:
            name = f"{layout}{'-scan' if scanned else ''}{'-words' if words else ''}"
            docs = [document(layout, copy, scanned) for copy in range(args.copies)]
            rows.append(run_set(engine, store, calls, client, name, docs, words))
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "machine": "one run on 2 shared cores (other work beside it), CPU, OCR_CPU_THREADS=1",
        "sealed": True,
        "copies": args.copies,
        "sets": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
