"""Issue 40's cost: L1 hits/s through the edge with tracing on (``OTEL_TRACES_SAMPLER=
always_on``, every span exported over OTLP/HTTP to a receiver in this process that reads and
answers each export without decoding it: a collector runs on other machines, and on these two
cores its decoding would be charged to the service) against tracing off (no ``OTEL_*``), in
one run.

Two ``python -m app serve`` fleets side by side (each its own Redis and engine process), the
same image's hit, rounds interleaved (off-on, on-off, ...) after a warm-up; medians. The
small image (a 5 KB PNG) is the worst case: a hit's own work is least, so the spans' share
is largest. Result: bench/results/tracing.json; the paragraph in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import base64
import json
import os
import statistics
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from bench import load
from tests.otlp_receiver import Receiver
from tests.test_roles import serve

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("OCR_SHARED_DIR", ROOT.parent / "shared")) / "corpus"
IMAGE = "tesseract_phototest.png"
CONCURRENCY = 8
ROUNDS = int(os.environ.get("BENCH_TRACING_ROUNDS", "6"))
SECONDS = float(os.environ.get("BENCH_THROUGHPUT_SECONDS", "6"))
REQUESTS = int(os.environ.get("BENCH_THROUGHPUT_REQUESTS", "4000"))
OUT = ROOT / "bench" / "results" / "tracing.json"


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True)
    return done.stdout.decode().strip()


def _rate(port: int, request: load.Request, seconds: float) -> dict:
    if load.wrk_available():
        return load.run_wrk(port, request, CONCURRENCY, seconds)
    return load.run(port, request, CONCURRENCY, REQUESTS, seconds)


def main() -> dict:
    receiver = Receiver(decode=False)
    data = (CORPUS / IMAGE).read_bytes()
    body = json.dumps({"image": base64.b64encode(data).decode()}).encode()
    request = load.Request("/v1/ocr", body, {"Content-Type": "application/json"})
    traced = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_TRACES_SAMPLER": "always_on",
        "LOG_LEVEL": "warning",
    }
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        ports = {}
        for name, extra in (("off", {"LOG_LEVEL": "warning"}), ("on", traced)):
            (tmp / name).mkdir()
            fleet = stack.enter_context(serve(tmp / name, **extra))
            ports[name] = int(fleet.base.rsplit(":", 1)[1])
        for port in ports.values():
            load.run(port, request, 1, 2, 600)  # the miss that stores the entry
            _rate(port, request, 2)  # warm-up
        runs: dict[str, list[dict]] = {name: [] for name in ports}
        for round_ in range(ROUNDS):
            order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
            for name in order:
                runs[name].append(_rate(ports[name], request, SECONDS))
        time.sleep(1)  # the last batch of spans
        exported = {"requests": receiver.requests, "bytes": receiver.bytes}
    receiver.close()
    rate = {name: statistics.median(r["per_second"] for r in rs) for name, rs in runs.items()}
    report = {
        "image": IMAGE,
        "image_bytes": len(data),
        "concurrency": CONCURRENCY,
        "rounds": ROUNDS,
        "seconds": SECONDS,
        "client": "wrk" if load.wrk_available() else "python processes",
        "sampler": "always_on",
        "exporter": "otlp http/protobuf to a receiver in the bench process (read, not decoded)",
        "hits_per_s": rate,
        "per_round": {name: [r["per_second"] for r in rs] for name, rs in runs.items()},
        "p50_ms": {
            name: statistics.median(r["p50_ms"] or 0 for r in rs) for name, rs in runs.items()
        },
        "errors": {name: sum(r["errors"] for r in rs) for name, rs in runs.items()},
        "exports": exported,
        "on_vs_off": rate["on"] / rate["off"],
        "cpus": os.cpu_count(),
        "commit": _commit(),
        "when": time.strftime("%Y-%m-%d %H:%M"),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    if OUT.exists():  # the runs before, newest first, kept beside the latest
        before = json.loads(OUT.read_text())
        report["earlier_runs"] = [before, *before.pop("earlier_runs", [])]
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
