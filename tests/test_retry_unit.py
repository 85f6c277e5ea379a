"""The remote engines' one retry policy (app/engines/retry.py): only ``Transient`` is
retried, a bounded number of times; the waits double, are capped, and honour Retry-After
up to the cap. Part of `make test-fast` (no waits: the sleeps are recorded, not slept)."""

from __future__ import annotations

import logging

import pytest

from app.engines.retry import RetryPolicy, Transient
from app.vocabulary import EngineError, EngineTimeout

pytestmark = pytest.mark.unit

log = logging.getLogger("test")


@pytest.fixture()
def slept() -> list[float]:
    return []


def failing(errors: list[BaseException], answer: str = "ok"):  # type: ignore[no-untyped-def]
    calls: list[int] = []

    def call() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return answer

    return call, calls


def test_transient_failures_are_retried_with_doubling_capped_waits(slept):
    call, calls = failing([Transient("reset")] * 3)
    policy = RetryPolicy(retries=3, first_backoff=0.05, max_backoff=0.15, sleep=slept.append)
    assert policy.call(call, log) == "ok"
    assert len(calls) == 4
    assert slept == pytest.approx([0.05, 0.1, 0.15])


def test_retries_are_bounded_and_end_as_an_engine_error(slept, caplog):
    call, calls = failing([Transient("HTTP 503")] * 5)
    policy = RetryPolicy(
        retries=2,
        first_backoff=0.0,
        max_backoff=1.0,
        what="vLLM unavailable",
        sleep=slept.append,
    )
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(EngineError, match="vLLM unavailable: HTTP 503"),
    ):
        policy.call(call, log)
    assert len(calls) == 3
    assert [r.getMessage() for r in caplog.records][
        -1
    ] == "vLLM unavailable (attempt 3/3): HTTP 503"


def test_retry_after_is_honoured_up_to_the_cap(slept):
    call, _ = failing(
        [Transient("HTTP 429", retry_after=0.5), Transient("HTTP 429", retry_after=60)]
    )
    RetryPolicy(
        retries=2, first_backoff=0.01, max_backoff=2.0, jitter=0.25, sleep=slept.append
    ).call(call, log)
    assert slept == pytest.approx([0.5, 2.0])


@pytest.mark.parametrize("error", [EngineTimeout("slow"), EngineError("HTTP 400"), ValueError()])
def test_other_failures_are_not_retried(slept, error):
    call, calls = failing([error])
    with pytest.raises(type(error)):
        RetryPolicy(retries=3, first_backoff=0.01, max_backoff=1.0, sleep=slept.append).call(
            call, log
        )
    assert len(calls) == 1 and slept == []
