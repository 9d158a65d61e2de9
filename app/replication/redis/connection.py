"""The Redis clients of one instance, and the one retry policy of replication.

Retry policy. redis-py retries nothing (``Retry(NoBackoff(), 0)``): a failed command raises at
once into the loop that issued it, and that loop alone decides what the failure means and when
to try again, with ``backoff_delay`` (exponential from 50 ms, jittered, capped at 250 ms: an attempt
against a Redis that is down costs one refused connection, and an instance should be back in
agreement within a second of Redis returning), for as long as Redis stays away:

* the publisher keeps its batch and appends it again (nothing in the outbox is lost);
* the reader marks its stream position unverified and checks it for a reset before reading on;
* a snapshot round is skipped (an urgent one is asked for again a second later).

Why this way round: the loops must outlast outages of any length and say so (``connected``, the
logs), which a client's bounded retry budget cannot do, so the loops' own backoff is needed
anyway. A second, hidden layer underneath only stretched a failing command (several attempts,
each up to its socket timeout) and hid reconnects from the reader, which must check the stream
after every reconnect because Redis may have come back empty.

``honour_cancellation`` works around redis-py swallowing a cancellation; every loop calls it.
"""

from __future__ import annotations

import asyncio
import random

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

READ_BLOCK_MS = 2_000  # the reader's XREAD BLOCK
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 0.25
CONNECT_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 10.0
HEALTH_CHECK_INTERVAL_S = 10

IO_ERRORS = (RedisError, OSError)


def backoff_delay(attempt: int) -> float:
    """Seconds to wait before retry number ``attempt`` (1, 2, ...): exponential, jittered, capped."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


def honour_cancellation() -> None:
    """Raise if this task was cancelled while redis-py swallowed the cancellation.

    A cancel that lands during a connection health check or a blocking read can be lost inside
    redis-py (redis-py #2028); the command then returns normally. Loops call this every turn so
    ``stop()`` always ends them.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def make_client(url: str, socket_timeout: float, name: str) -> Redis:
    # TCP keepalive means nothing on a Unix socket, and redis-py refuses it there
    keepalive = {} if url.startswith("unix://") else {"socket_keepalive": True}
    return Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        **keepalive,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        retry=Retry(NoBackoff(), 0),  # see the module docstring: the loops retry
        client_name=name,
    )


class RedisClients:
    """The two connections of one instance: ``commands`` (appends, snapshots, checks) and
    ``reads`` (the blocking XREAD, whose socket timeout must outlast its BLOCK)."""

    def __init__(self, url: str, instance_id: int) -> None:
        self.commands = make_client(url, COMMAND_TIMEOUT_S, f"slot-tracker-{instance_id}")
        self.reads = make_client(
            url, READ_BLOCK_MS / 1000 + COMMAND_TIMEOUT_S, f"slot-tracker-{instance_id}-rd"
        )

    async def close(self) -> None:
        for client in (self.commands, self.reads):
            await client.aclose()
