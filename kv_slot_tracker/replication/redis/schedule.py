"""When the next snapshot is wanted, and the newest one seen: shared by the outbox and the
reader (which learn that Redis lost data), the snapshot writer and the facade."""

from __future__ import annotations

import asyncio
import contextlib

from kv_slot_tracker.core.types import NS_PER_S
from kv_slot_tracker.replication.redis.stream import parse_id


class SnapshotSchedule:
    """When the next snapshot is wanted, and the newest one this instance has seen."""

    def __init__(self) -> None:
        self._soon = asyncio.Event()
        # the stream's bound needs a snapshot covering this stream id to trim further
        self._bound_at: str | None = None
        self.newest_at: int | None = None  # wall ns the newest snapshot's state was exported
        self.newest_id: str | None = None  # the stream id it covers

    def request_now(self) -> None:
        """Redis lost data: one is wanted without waiting for the interval."""
        self._soon.set()

    def request_for_bound(self, stream_id: str) -> None:
        """The stream neared its bound and may only be trimmed below the newest snapshot: one
        covering ``stream_id`` is wanted now, from whoever can write it (not only the lease
        holder)."""
        wanted = self._bound_at
        if wanted is None or parse_id(stream_id) > parse_id(wanted):
            self._bound_at = stream_id
        self._soon.set()

    def take_bound_request(self) -> str | None:
        """The stream id a snapshot was asked to cover for the bound since the last call."""
        wanted, self._bound_at = self._bound_at, None
        return wanted

    async def next_round(self, timeout_s: float) -> bool:
        """Wait for the next round (a request or ``timeout_s``); whether it was requested."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._soon.wait(), timeout_s)
        urgent = self._soon.is_set()
        self._soon.clear()
        return urgent

    def note(self, stream_id: str, at: int) -> None:
        if self.newest_at is None or at > self.newest_at:
            self.newest_at = at
            self.newest_id = stream_id

    def age_seconds(self, wall_now: int) -> float | None:
        if self.newest_at is None:
            return None
        return max(0.0, (wall_now - self.newest_at) / NS_PER_S)
