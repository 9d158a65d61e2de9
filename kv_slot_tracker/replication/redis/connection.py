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

``retrying(do, on_fail)`` is that policy as one call, in the shape of redis-py's
``Retry.call_with_retry(do, fail)`` but for as long as it takes. ``honour_cancellation`` works
around redis-py swallowing a cancellation; every loop calls it.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, RedisError

from kv_slot_tracker.replication.redis.endpoint import RedisEndpoint

READ_BLOCK_MS = 2_000  # the reader's XREAD BLOCK
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 0.25
CONNECT_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 10.0
HEALTH_CHECK_INTERVAL_S = 10

IO_ERRORS = (RedisError, OSError)


def backoff_delay(attempt: int) -> float:
    """Seconds to wait before retry number ``attempt`` (1, 2, ...): exponential, jittered, capped."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2.0 ** (attempt - 1)) * random.uniform(0.5, 1.0)


def honour_cancellation() -> None:
    """Raise if this task was cancelled while redis-py swallowed the cancellation.

    A cancel that lands during a connection health check or a blocking read can be lost inside
    redis-py (redis-py #2028); the command then returns normally. Loops call this every turn so
    ``stop()`` always ends them.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


T = TypeVar("T")


async def retrying(
    do: Callable[[], Awaitable[T]],
    on_fail: Callable[[Exception], None],
    errors: type[Exception] | tuple[type[Exception], ...] = IO_ERRORS,
) -> T:
    """``do()`` until it returns: before each attempt ``honour_cancellation``; after a failure
    with one of ``errors``, ``on_fail(error)`` (called while the error is being handled) and
    ``backoff_delay`` of the attempts failed so far. Any other exception propagates."""
    attempt = 0
    while True:
        honour_cancellation()
        try:
            return await do()
        except errors as e:
            attempt += 1
            on_fail(e)
            await asyncio.sleep(backoff_delay(attempt))


def _common(socket_timeout: float, name: str) -> dict[str, Any]:
    return {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_keepalive": True,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "retry": Retry(NoBackoff(), 0),  # see the module docstring: the loops retry
        "client_name": name,
    }


def make_client(
    endpoint: RedisEndpoint,
    socket_timeout: float,
    name: str,
    sentinel: Sentinel | None = None,
) -> Any:
    """A client of ``endpoint`` (a ``Redis``, or a ``RedisCluster``)."""
    kwargs = _common(socket_timeout, name) | endpoint.auth_kwargs()
    if endpoint.kind == "sentinel":
        assert sentinel is not None
        if endpoint.tls:
            kwargs["ssl"] = True
        return sentinel.master_for(endpoint.master, **kwargs, **endpoint.tls_kwargs())
    if endpoint.kind == "cluster":
        # A cluster follows MOVED/ASK and refreshes its slot map itself; only connection
        # errors come back to the loops as they do for one server.
        del kwargs["retry"], kwargs["health_check_interval"]
        return RedisCluster.from_url(endpoint.url, **kwargs, **endpoint.tls_kwargs())
    if endpoint.url.startswith("unix://"):
        # TCP keepalive means nothing on a Unix socket, and redis-py refuses it there
        del kwargs["socket_keepalive"]
    return Redis.from_url(endpoint.url, **kwargs, **endpoint.tls_kwargs())


async def ensure_primary(client: Any) -> None:
    """Raise ``ConnectionError`` (after dropping the pool's connections, so the next command
    asks the Sentinels again) unless ``client`` talks to a primary.

    A Sentinel that has not yet taken in a failover may still name the demoted primary, which
    is alive as a replica and answers reads: a reader connected there would take the replica's
    stream, a moment behind, for a rolled-back one. ``HELLO`` (no arguments: nothing changes)
    says the role and needs no admin permission, unlike ``ROLE``.
    """
    reply = await client.execute_command("HELLO")
    if isinstance(reply, list):
        reply = dict(zip(reply[::2], reply[1::2], strict=False))
    role = reply.get(b"role", reply.get("role"))
    if role in (b"master", "master"):
        return
    await client.connection_pool.disconnect()
    raise ConnectionError(f"connected to a {role!r}, not the primary; asking the Sentinels again")


class RedisClients:
    """The connections of one instance: ``commands`` (snapshots, checks, the read barrier),
    ``publish`` (the outbox's appends alone, so that ``WAIT`` after an append counts the
    replicas that hold *that* append) and ``reads`` (the blocking XREAD, whose socket timeout
    must outlast its BLOCK)."""

    def __init__(self, endpoint: RedisEndpoint, instance_id: int) -> None:
        self.endpoint = endpoint
        self.sentinel: Sentinel | None = None
        if endpoint.kind == "sentinel":
            self.sentinel = Sentinel(
                list(endpoint.sentinels),
                sentinel_kwargs=endpoint.sentinel_kwargs(COMMAND_TIMEOUT_S, CONNECT_TIMEOUT_S),
            )
        name = f"slot-tracker-{instance_id}"
        self.commands = make_client(endpoint, COMMAND_TIMEOUT_S, name, self.sentinel)
        self.publish = make_client(endpoint, COMMAND_TIMEOUT_S, name + "-pub", self.sentinel)
        self.reads = make_client(
            endpoint, READ_BLOCK_MS / 1000 + COMMAND_TIMEOUT_S, name + "-rd", self.sentinel
        )

    async def follow_primary(self) -> bool:
        """Sentinel: ask where the primary is; if it moved, drop every connection (in use or
        not) to the old one. Whether it moved.

        A promoted replica is found on the next reconnect anyway, but a demoted primary stays
        alive and keeps its clients until the Sentinels reconfigure it, about ten seconds later:
        meanwhile appends would go to a primary that no longer counts (lost when it resyncs)
        and the reader would wait there for records that never come."""
        if self.sentinel is None:
            return False
        address = await self.sentinel.discover_master(self.endpoint.master)
        moved = False
        for client in (self.commands, self.publish, self.reads):
            pool = client.connection_pool
            if pool.master_address is not None and pool.master_address != address:
                pool.master_address = address
                await pool.disconnect()
                moved = True
        return moved

    async def close(self) -> None:
        for client in (self.commands, self.publish, self.reads):
            await client.aclose()
        if self.sentinel is not None:
            await self.sentinel.aclose()
