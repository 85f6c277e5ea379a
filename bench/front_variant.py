"""``python -m bench.front_variant``: ``python -m app front`` with one part of a served hit
taken away, for bench/hitsplit.py's decomposition. Measurement only: each knob patches the
front before its server forks (its workers inherit the patch); nothing here is a setting.

- ``BENCH_NO_METRICS=1``: no per-request Prometheus update (counters and histograms);
- ``BENCH_NO_UPSTREAM_KEEPALIVE=1``: nginx opens a new unix-socket connection to the front
  for every request (no ``keepalive`` in its upstream block).

The real settings do the rest: ``GRPC_ENABLED=false``, ``EDGE_ACCESS_LOG=false``,
``WEB_THREADS``, ``WEB_CONCURRENCY``.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any


def _patch() -> None:
    from app import edge

    if os.environ.get("BENCH_NO_METRICS") == "1":
        from prometheus_client import metrics

        metrics.Counter.inc = lambda *a, **k: None  # type: ignore[method-assign]
        metrics.Histogram.observe = lambda *a, **k: None  # type: ignore[method-assign]
    if os.environ.get("BENCH_NO_UPSTREAM_KEEPALIVE") == "1":
        render = edge.render

        def without_keepalive(*args: Any, **kwargs: Any) -> str:
            text = render(*args, **kwargs)
            return re.sub(r"\n\s*keepalive(_timeout|_requests)? [^;]*;", "", text)

        edge.render = without_keepalive  # type: ignore[assignment]


def main() -> int:
    _patch()
    from app.__main__ import main as app_main

    return app_main(["front"])


if __name__ == "__main__":
    sys.exit(main())
