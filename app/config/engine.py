"""The engine call and the global miss queue: ``Settings.engine``, ``Settings.dispatch``."""

from __future__ import annotations

from dataclasses import dataclass

from app import env as e
from app.env import Section, env


@dataclass(frozen=True)
class EngineSettings(Section):
    TITLE = "Engine"

    kind: str = env(
        "OCR_ENGINE",
        e.choice("paddle", "serving", "hunyuan"),
        "paddle",
        "`paddle` (in-process), `serving` (remote Paddle Serving), `hunyuan` (vLLM)",
    )
    timeout_seconds: float = env(
        "OCR_TIMEOUT_SECONDS",
        e.number(0.001, 3600.0),
        60.0,
        "how long a request waits for its engine call before 504 (`err_no 6000`)",
    )
    unready_after_failures: int = env(
        "ENGINE_UNREADY_AFTER_FAILURES",
        e.integer(1, 1000),
        5,
        "engine failures in a row before `/readyz` says `failing` and the engine takes no more tickets (an engine process exits 3, for a restart)",
    )
    batch_max: int = env(
        "ENGINE_BATCH_MAX",
        e.integer(1, 64),
        1,
        "tickets (queued misses) an engine takes from the queue at once, one call where it can",
    )


@dataclass(frozen=True)
class DispatchSettings(Section):
    TITLE = "Global miss dispatch"
    INTRO = "Misses go to one queue per engine fingerprint that every free engine pulls from, a lane per tenant taken by deficit round robin ([ARCHITECTURE.md](ARCHITECTURE.md#the-miss-path))."

    queue_max: int = env(
        "DISPATCH_QUEUE_MAX",
        e.integer(1, 100_000),
        8,
        "misses waiting per live engine in one tenant's lane before its new ones get 503",
    )
    claim_ms: int = env(
        "DISPATCH_CLAIM_MS",
        e.integer(100, 3_600_000),
        10_000,
        "an engine process that stopped reporting this long is gone: the tickets it held are claimed by another engine (a running call needs nothing else to stay its own)",
    )
    check_seconds: float = env(
        "DISPATCH_CHECK_SECONDS",
        e.number(0.1, 3600.0),
        16.0,
        "how often a front checks that the tickets its waiting misses heard nothing of are still queued, one call per lane for all of them (a fallback: notices tell how tickets end; the LRU may take a queued one)",
    )
    shards: int = env(
        "DISPATCH_SHARDS",
        e.integer(1, 16),
        1,
        "the queue in this many shards, each its own hash tag (one Redis Cluster master's work each) and its own engines, which help the other shards when idle; every front and engine of a fleet must agree ([DEPLOYMENT.md](DEPLOYMENT.md#queue-shards))",
    )
    shard: int = env(
        "DISPATCH_SHARD",
        e.integer(-1, 15),
        -1,
        "the shard an engine process serves when `DISPATCH_SHARDS` is over 1 (it helps the others when idle; `-1`: unset; `serve` gives its engine processes one each in turn); fronts ignore it",
    )
    max_deliveries: int = env(
        "DISPATCH_MAX_DELIVERIES",
        e.integer(1, 100),
        3,
        "deliveries of one ticket before it is failed",
    )
    fairness: str = env(
        "DISPATCH_FAIRNESS",
        e.choice("drr", "fifo"),
        "drr",
        "`drr`: tenants' lanes by deficit round robin over engine time (their `share`); `fifo`: arrival order",
    )
    interject: bool = env(
        "DISPATCH_INTERJECT",
        e.boolean,
        True,
        "with `drr`: an in-process engine may run a waiting tenant's page between two batches of another's",
    )
