"""The one retry policy of the replication loops."""

from __future__ import annotations

import asyncio
import random

import pytest
from redis.exceptions import ConnectionError, ResponseError

from kv_slot_tracker.replication.redis.connection import backoff_delay, retrying


def test_backoff_grows_from_50_ms_and_never_exceeds_250_ms() -> None:
    """Capped low, so that an instance is back in agreement within a second of Redis
    returning (bench/consistency_bench.py outage): an attempt against a Redis that is down
    costs one refused connection."""
    random.seed(3)
    delays = [[backoff_delay(attempt) for attempt in range(1, 12)] for _ in range(200)]
    firsts = [d[0] for d in delays]
    assert min(firsts) >= 0.025 and max(firsts) <= 0.05
    assert max(max(d) for d in delays) <= 0.25
    assert min(d[-1] for d in delays) >= 0.125  # jittered between half the cap and the cap


def test_retrying_calls_until_it_returns_telling_each_failure() -> None:
    calls: list[int] = []
    failures: list[Exception] = []
    down = ConnectionError("down")

    async def do() -> str:
        calls.append(len(calls))
        if len(calls) < 3:
            raise down
        return "appended"

    assert asyncio.run(retrying(do, failures.append)) == "appended"
    assert calls == [0, 1, 2]
    assert failures == [down, down]


def test_retrying_lets_other_errors_and_cancellation_through() -> None:
    failures: list[Exception] = []

    async def broken() -> None:
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        asyncio.run(retrying(broken, failures.append))
    assert failures == []

    # a wider net, as the reader casts it: the bug is told and retried too
    attempts: list[Exception] = []

    async def flaky() -> int:
        if not attempts:
            raise ValueError("once")
        return len(attempts)

    assert asyncio.run(retrying(flaky, attempts.append, Exception)) == 1

    async def cancelled_while_down() -> None:
        async def down() -> None:
            raise ResponseError("OOM command not allowed")

        task = asyncio.create_task(retrying(down, failures.append))
        await asyncio.sleep(0)  # the first attempt fails; it backs off
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_while_down())
    assert len(failures) == 1 and isinstance(failures[0], ResponseError)
