"""The read barrier: wait until this instance has applied every stream entry that existed when
the wait began.

One round trip learns the stream's last id (``XREVRANGE key + - COUNT 1``); then the caller
waits, without polling, until the reader's position passes it (the reader calls ``advanced``
after every batch it applied). Bounded by the caller's timeout: while Redis is unreachable or
stalls, the barrier cannot be confirmed and says so.

While the reader's position is not checked against the server it reads from (after a
connection error, until the reader found the stream to be the one its position came from, or
moved back to where it is), the barrier confirms nothing: after a primary switch that position
may lie beyond entries the new primary holds and the reader has not read.

Used for lifecycle calls about request ids this instance does not know yet
(``kv_slot_tracker.service.consistency``): the add may be in the stream already, read by the others and not
yet by us.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis

from kv_slot_tracker.replication.redis.connection import IO_ERRORS
from kv_slot_tracker.replication.redis.stream import NamespaceKeys, parse_id


class ReadBarrier:
    def __init__(self, keys: NamespaceKeys) -> None:
        self.keys = keys
        self.position = (0, 0)  # the reader's, as a comparable pair
        self.checked = True  # whether that position is checked against the server (docstring)
        self._client: Redis | None = None
        self._waiters: list[tuple[tuple[int, int], asyncio.Future[None]]] = []

    def connect(self, client: Redis) -> None:
        self._client = client

    def advanced(self, position: str) -> None:
        """The reader applied the stream up to ``position``: release the waits it satisfies."""
        pos = self.position = parse_id(position)
        waiters = self._waiters
        if not waiters or not self.checked:
            return
        keep = []
        for target, fut in waiters:
            if target <= pos:
                if not fut.done():
                    fut.set_result(None)
            elif not fut.done():
                keep.append((target, fut))
        self._waiters = keep

    def position_checked(self, checked: bool) -> None:
        """The reader's position is (True) or may no longer be (False) one of the stream it
        reads from now."""
        self.checked = checked
        if checked:
            self.advanced(f"{self.position[0]}-{self.position[1]}")

    async def caught_up(self, timeout_s: float) -> bool:
        """True once every entry that was in the stream when called has been applied here;
        False when that could not be established within ``timeout_s`` (Redis unreachable,
        stalled, or the reader behind by more than that)."""
        client = self._client
        if client is None or timeout_s <= 0:
            return False
        try:
            async with asyncio.timeout(timeout_s):
                newest: Any = await client.xrevrange(self.keys.events, "+", "-", count=1)
                if not newest:
                    return True  # an empty (or missing) stream: nothing to wait for
                target = parse_id(newest[0][0])
                if target <= self.position and self.checked:
                    return True
                fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._waiters.append((target, fut))
                await fut
                return True
        except TimeoutError:
            return False
        except IO_ERRORS:
            return False
