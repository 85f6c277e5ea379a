"""Redis bytes per entry against the raw result JSON, over held-out corpus images.

    python -m bench.entry_size

For each held-out image (``bench/corpus_results.split``: not seen by the dictionary), the
real engine's result is stored under a real key the way the service stores it, and Redis's
``MEMORY USAGE`` of that key is divided by the size of the raw result JSON (the canonical
``OcrResult.to_dict()``, what the first envelope held). The previous format (envelope
version 1: JSON envelope, zstd level 3, no dictionary) is measured beside it. ``make bench``
runs this; the ratio is a figure in bench/results, not a test assertion.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import orjson
import redis
import zstandard

from app.cache.codec import MAGIC, Codec
from app.cache.keys import KEY_SCHEMA
from app.embedded_redis import EmbeddedRedis
from app.vocabulary import OcrResult
from bench.corpus_results import RESULTS_DIR, results, split

FINGERPRINT = "f72e9e07742ed125"  # the shape of a real one: 16 hex digits
TTL = 86400
MIN_IMAGES = 20


def v1_value(result: OcrResult, sha256: str) -> bytes:
    """An entry as envelope version 1 wrote it (the format before this one)."""
    envelope = {"v": 1, "sha256": sha256, "fp": FINGERPRINT, "created": int(time.time()),
                "ttl": TTL, "result": result.to_dict()}  # fmt: skip
    return MAGIC + b"z" + zstandard.ZstdCompressor(level=3).compress(orjson.dumps(envelope))


def measure(client: redis.Redis, word_boxes: bool = False) -> dict:
    _, held_out = split()
    found = results(held_out if not word_boxes else held_out[:12], word_boxes=word_boxes)
    codec = Codec()
    rows = []
    for name, result in found.items():
        raw = len(orjson.dumps(result.to_dict()))
        md5 = hashlib.md5(name.encode()).hexdigest()  # any 32 hex digits: the key's shape
        sha = hashlib.sha256(name.encode()).hexdigest()
        key = f"ocr:{KEY_SCHEMA}:{FINGERPRINT}:ocr-0123456789ab:{{{md5}}}"
        usage = {}
        for fmt, value in (
            ("v2", codec.encode(result, sha, FINGERPRINT, TTL, key)),
            ("v1", v1_value(result, sha)),
        ):
            client.set(key, value, ex=TTL)
            usage[fmt] = (int(client.memory_usage(key, samples=0)), len(value))
            client.delete(key)
        rows.append(
            {
                "image": name,
                "lines": len(result.lines),
                "raw_json": raw,
                "memory_usage": usage["v2"][0],
                "value_bytes": usage["v2"][1],
                "memory_usage_v1": usage["v1"][0],
                "value_bytes_v1": usage["v1"][1],
            }
        )
    raw_total = sum(r["raw_json"] for r in rows)
    return {
        "images": len(rows),
        "word_boxes": word_boxes,
        "ratio": sum(r["memory_usage"] for r in rows) / raw_total,
        "ratio_v1": sum(r["memory_usage_v1"] for r in rows) / raw_total,
        "mean_ratio": sum(r["memory_usage"] / r["raw_json"] for r in rows) / len(rows),
        "mean_ratio_v1": sum(r["memory_usage_v1"] / r["raw_json"] for r in rows) / len(rows),
        "rows": rows,
    }


def run(redis_url: str | None = None) -> dict:
    if redis_url is None:
        with EmbeddedRedis() as server:
            return run(server.url)
    client = redis.Redis.from_url(redis_url)
    report = {"lines": measure(client), "word_boxes": measure(client, word_boxes=True)}
    assert report["lines"]["images"] >= MIN_IMAGES, report["lines"]["images"]
    return report


def main() -> int:
    report = run()
    (RESULTS_DIR / "entry_size.json").write_text(json.dumps(report, indent=2) + "\n")
    for name, r in report.items():
        print(
            f"{name}: {r['images']} held-out images: MEMORY USAGE / raw JSON {r['ratio']:.3f} "
            f"(per-image mean {r['mean_ratio']:.3f}); before: {r['ratio_v1']:.3f} "
            f"({r['mean_ratio_v1']:.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
