"""The Redis clients of one instance, and the backoff of the replication loops.

``honour_cancellation`` works around redis-py swallowing a cancellation; every loop calls it.
"""

from __future__ import annotations

import asyncio
import random

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisError

READ_BLOCK_MS = 2_000  # the reader's XREAD BLOCK
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0
CONNECT_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 10.0
HEALTH_CHECK_INTERVAL_S = 10
CLIENT_RETRIES = 2

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
    return Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        retry=Retry(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S / 2), CLIENT_RETRIES),
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
