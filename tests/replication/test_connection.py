"""The one retry policy of the replication loops."""

from __future__ import annotations

import random

from kv_slot_tracker.replication.redis.connection import backoff_delay


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
