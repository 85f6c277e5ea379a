"""The near-duplicate experiment (issue 15 §3): which variants each tier answers, and
whether what it serves is what the engine says for that exact input.

    .venv/bin/python -m bench.near_duplicates            # or: make bench-near

For each corpus image: the real engine's answer is cached through ``OcrCache`` (real
embedded Redis, ``CACHE_SIMILAR=on`` at the default thresholds), then every variant from
``bench.near_variants`` is asked for. Ground truth is the engine run on the variant itself;
a *wrong hit* is a hit whose text (every line, in order) differs from it. The verification
figures of every variant against its original are recorded too, so thresholds can be read
off (``figures``) with their margin. Writes bench/results/near_duplicates.json and prints
the confusion tables docs/ARCHITECTURE.md shows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from app.cache import assembly, verify
from app.cache.breaker import CircuitBreaker
from app.cache.pixel_index import pixel_digest
from app.cache.similarity import perceptual_hash
from app.cache.store import RedisStore
from app.config import Settings
from app.embedded_redis import EmbeddedRedis
from app.engines.base import OcrRequest
from app.engines.paddle import PaddleOcrEngine
from app.imaging import decode_image
from app.vocabulary import CacheControls, OcrResult
from bench import near_variants as nv

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT.parent / "shared" / "corpus"
RESULTS = ROOT / "bench" / "results" / "near_duplicates.json"

# Latin-script documents, receipts, cards and screenshots (a word or digit can be replaced).
IMAGES = [
    "tesseract_phototest.png", "tesseract_eurotext.png", "easyocr_english.png",
    "rapidocr_en.jpg", "rapidocr_issue_170.png", "sroie_000.jpg", "sroie_019.jpg",
    "sroie_317.jpg", "mmocr_wildreceipt_2.jpg", "paddleocr_en_254.jpg",
    "paddleocr_table_table.jpg", "passporteye_pass_fin.png", "passporteye_card_cmw.png",
    "mmocr_demo_densetext_det.jpg", "paddleocr_ic15_download_page.png",
    "paddleocr_doc_00018069.jpg",
]  # fmt: skip
TEMPLATE_SEEDS = range(1, 7)


class MemoEngine:
    """The real engine, run once per distinct input (pixels): the ground truth and the
    cache's own computations share the answers."""

    def __init__(self, inner: PaddleOcrEngine, memo: Path | None = None) -> None:
        self._inner = inner
        self._memo: dict[str, OcrResult] = {}
        self._file = memo
        if memo is not None and memo.exists():  # answers of an earlier run (same engine)
            saved = json.loads(memo.read_text())
            if saved.get("fingerprint") == inner.fingerprint:
                self._memo = {k: OcrResult.from_dict(v) for k, v in saved["results"].items()}
        self.runs = 0

    def save(self) -> None:
        if self._file is not None:
            results = {k: v.to_dict() for k, v in self._memo.items()}
            body = {"fingerprint": self._inner.fingerprint, "results": results}
            self._file.write_text(json.dumps(body))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def recognize(self, request: OcrRequest) -> OcrResult:
        key = pixel_digest(request.image)
        if key not in self._memo:
            self.runs += 1
            self._memo[key] = self._inner.recognize(request)
        return self._memo[key]


def text_of(result: OcrResult) -> str:
    return "\n".join(line.text for line in result.lines)


def _squash(text: str) -> str:
    return "".join(text.split())


def run(
    images: list[str], seeds: range, settings: Settings, memo: Path | None = None
) -> dict[str, Any]:
    inner = PaddleOcrEngine.from_settings(settings)
    engine = MemoEngine(inner, memo)
    inner.load()
    store = RedisStore(settings.redis.url, 1000, 1000, CircuitBreaker(3, 2.0))
    cache = assembly.for_settings(settings, engine, store, lambda d: decode_image(d, 60_000_000))
    decode = lambda d: decode_image(d, 60_000_000)  # noqa: E731
    rows: list[dict[str, Any]] = []

    def truth(data: bytes) -> OcrResult:
        image = decode(data)
        return engine.recognize(OcrRequest(data, image, engine.default_params))

    def trial(kind: str, variant: str, source: str, original: bytes, data: bytes) -> None:
        src_image, image = decode(original), decode(data)
        expected = truth(data)
        src_result = truth(original)
        figures = verify.compare(
            verify.grey(image), (image.width, image.height),
            verify.grey(src_image), (src_image.width, src_image.height), src_result,
        )  # fmt: skip
        distance = bin(perceptual_hash(image) ^ perceptual_hash(src_image)).count("1")
        outcome = cache.get_or_compute(data, controls=CacheControls())
        hit = outcome.status.value == "HIT"
        served_text = text_of(outcome.result)
        rows.append(
            {
                "image": source,
                "kind": kind,
                "variant": variant,
                "same_pixels": pixel_digest(image) == pixel_digest(src_image),
                "engine_text_changed": text_of(expected) != text_of(src_result),
                "tier": outcome.tier if hit else "",
                "wrong": hit and served_text != text_of(expected),
                # The engine itself often reads a re-encoded copy a little differently
                # (mostly the spaces): how many wrong hits are only that.
                "wrong_beyond_spaces": hit and _squash(served_text) != _squash(text_of(expected)),
                "phash_distance": distance,
                "aspect": round(figures.aspect, 3),
                "block": round(figures.block, 2),
                "line": round(figures.line, 2),
            }
        )
        tier = rows[-1]["tier"] or "-"
        print(
            f"{source:36} {kind:7} {variant:14} tier={tier:7} d={distance:3} "
            f"{figures.header()} wrong={rows[-1]['wrong']}",
            flush=True,
        )

    for name in images:
        original = (CORPUS / name).read_bytes()
        cache.get_or_compute(original)  # cached: the source every variant is asked against
        base = truth(original)
        for variant in nv.BENIGN:
            trial("benign", variant, name, original, nv.benign(original, variant))
        for variant in nv.CHANGED:
            data = nv.changed(original, variant, base)
            if data is not None:
                trial("changed", variant, name, original, data)
    for seed in seeds:
        first, second = nv.template_pair(seed)
        cache.get_or_compute(first)
        trial("changed", "template", f"template-{seed}", first, second)
    engine.save()
    return {"rows": rows, "engine_runs": engine.runs}


def tables(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per tier: for each variant, how many hit there, and how many of those were wrong."""
    out: dict[str, Any] = {}
    for tier in ("pixel", "similar"):
        per: dict[str, dict[str, int]] = defaultdict(
            lambda: {"n": 0, "hit": 0, "wrong": 0, "wrong_beyond_spaces": 0}
        )
        for row in rows:
            cell = per[f"{row['kind']}:{row['variant']}"]
            cell["n"] += 1
            if row["tier"] == tier:
                cell["hit"] += 1
                cell["wrong"] += int(row["wrong"])
                cell["wrong_beyond_spaces"] += int(row["wrong_beyond_spaces"])
        out[tier] = dict(per)
    return out


def margins(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: the smallest any changed variant reached (only those whose engine text
    did change: the others cannot be wrong) and the largest any benign variant had."""
    changed = [r for r in rows if r["kind"] == "changed" and r["engine_text_changed"]]
    benign = [r for r in rows if r["kind"] == "benign" and not r["same_pixels"]]
    out: dict[str, Any] = {}
    for figure in ("phash_distance", "aspect", "block", "line"):
        out[figure] = {
            "changed_min": min((r[figure] for r in changed), default=None),
            "benign_max": max((r[figure] for r in benign), default=None),
        }
    return out


def summarize(result: dict[str, Any], settings: Settings | None = None) -> None:
    """Tables and margins; with ``settings``, the confusion is recomputed at its thresholds
    from the recorded figures (the rows' ``tier`` is what the run itself answered)."""
    result["tables"] = tables(result["rows"])
    result["margins"] = margins(result["rows"])
    if settings is not None:
        limits = {
            "aspect": settings.similar.max_aspect,
            "block": settings.similar.max_block,
            "line": settings.similar.max_line,
        }
        result["thresholds"] = {"max_distance": settings.similar.max_distance}
        result["thresholds"].update({f"max_{k}": v for k, v in limits.items()})
        for figure, limit in limits.items():
            m = result["margins"][figure]
            m["limit"] = limit
            if m["benign_max"]:
                m["limit_over_benign_max"] = round(limit / m["benign_max"], 2)
            if m["changed_min"] is not None:
                m["changed_min_over_limit"] = round(m["changed_min"] / limit, 2)


def print_tables(result: dict[str, Any]) -> None:
    """docs/ARCHITECTURE.md's tables: per variant, which tier answered; then one confusion
    matrix per tier (benign should hit, changed must miss; a wrong hit is a hit whose text
    differs from the engine's on that exact input)."""
    rows = result["rows"]
    per = result["tables"]
    print("| set | variant | n | pixel hits | similar hits | misses | wrong hits "
          "| wrong beyond spaces |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for variant in sorted(per["pixel"], key=lambda v: (v.startswith("changed"), v)):
        kind, name = variant.split(":")
        p, s_ = per["pixel"][variant], per["similar"][variant]
        n, hits = p["n"], p["hit"] + s_["hit"]
        wrong = p["wrong"] + s_["wrong"]
        beyond = p["wrong_beyond_spaces"] + s_["wrong_beyond_spaces"]
        print(f"| {kind} | {name} | {n} | {p['hit']} | {s_['hit']} | {n - hits} | {wrong} "
              f"| {beyond} |")  # fmt: skip
    for tier in ("pixel", "similar"):
        print(f"\n{tier} tier | hit | miss | wrong hits (beyond spaces)")
        print("|---|---:|---:|---:|")
        for kind in ("benign", "changed"):
            mine = [r for r in rows if r["kind"] == kind]
            hit = [r for r in mine if r["tier"] == tier]
            beyond = sum(r["wrong_beyond_spaces"] for r in hit)
            wrong = sum(r["wrong"] for r in hit)
            print(f"| {kind} | {len(hit)} | {len(mine) - len(hit)} | {wrong} ({beyond}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=len(IMAGES), help="first N images")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--summarize", action="store_true", help="only re-print --out")
    parser.add_argument(
        "--memo", type=Path, help="keep the engine's answers here and reuse them (same engine)"
    )
    args = parser.parse_args()
    if args.summarize:
        result = json.loads(args.out.read_text())
        summarize(result, Settings.from_env({}))
        print_tables(result)
        print(json.dumps(result["margins"], indent=1))
        return
    started = time.monotonic()
    with EmbeddedRedis() as redis_server:
        settings = Settings.from_env({}).with_overrides(
            redis_url=redis_server.url, cache_similar=True, cache_l1_bytes=0
        )
        result = run(IMAGES[: args.images], TEMPLATE_SEEDS, settings, args.memo)
    summarize(result, settings)
    result["seconds"] = round(time.monotonic() - started, 1)
    result["corpus_sha256"] = hashlib.sha256(
        b"".join((CORPUS / n).read_bytes() for n in IMAGES[: args.images])
    ).hexdigest()[:16]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_tables(result)
    print(json.dumps(result["margins"], indent=1))


if __name__ == "__main__":
    main()
