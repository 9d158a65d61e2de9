"""``LocalReplication``: the ``Replication`` port over the supervisor's hub, composed of its
parts (``outbox``: the write path, ``follower``: the read path and the state, ``link``: the
connection). It holds no replication rule of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import cast

from prometheus_client import CollectorRegistry

from kv_slot_tracker.core.types import NS_PER_S
from kv_slot_tracker.replication.local import framing
from kv_slot_tracker.replication.local.follower import Follower
from kv_slot_tracker.replication.local.metrics import register_local_collector
from kv_slot_tracker.replication.local.outbox import LocalOutbox
from kv_slot_tracker.replication.metrics import (
    ReplicationCounters,
    lag_histogram,
    register_collector,
)
from kv_slot_tracker.replication.port import ReplicatedState, ReplicationStatus
from kv_slot_tracker.replication.records import random_id, resolve_instance_id
from kv_slot_tracker.settings import Settings

log = logging.getLogger(__name__)

STOP_FLUSH_TIMEOUT_S = 2.0
RECONNECT_S = 0.1
REJECTED_RECENT_NS = 300 * NS_PER_S  # degraded this long after a sibling's record was rejected
UNDECODABLE = "undecodable"
UNREACHABLE = "the supervisor's hub is unreachable"


class HubLink(asyncio.Protocol):
    """One connection to the hub: says who this process is, hands the frames on."""

    def __init__(self, owner: LocalReplication) -> None:
        self.owner = owner
        self.reader = framing.FrameReader()
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is not one
        transport.write(
            framing.frame_u64(framing.HELLO, self.owner.instance_id, self.owner.incarnation)
        )
        self.owner.follower.connected(transport.write)

    def data_received(self, data: bytes) -> None:
        frames = self.reader.feed(data)
        if frames:
            self.owner.follower.on_frames(frames)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.owner.follower.disconnected()
        self.owner.outbox.connected(None)
        if not self.lost.done():
            self.lost.set_result(None)


class LocalReplication:
    """Replication through the supervisor's hub. One per process (per app)."""

    mode = "local"
    barrier_covers_acknowledged = True  # the hub's FLUSH (``hub``)

    def __init__(
        self,
        settings: Settings,
        registry: CollectorRegistry,
        hub_path: str,
        wall_clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.settings = settings
        self.hub_path = hub_path
        self.instance_id = resolve_instance_id(settings.instance_id)
        self.incarnation = random_id()
        self.wall_clock = wall_clock
        self.counters = ReplicationCounters()
        self.outbox = LocalOutbox(settings, self.counters, self.instance_id, self.incarnation)
        self.follower = Follower(
            self.instance_id,
            self.incarnation,
            self.counters,
            self.outbox,
            lag_histogram(registry),
            wall_clock,
        )
        self.outbox.applied = self.follower.applied_for_publish
        self._target: ReplicatedState | None = None
        self._link: HubLink | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        register_collector(
            registry, self.counters, self.outbox.pending, self.connected, self.rejected_records
        )
        register_local_collector(
            registry, lambda: self.follower.position, lambda: self.follower.hub_stats
        )

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, target: ReplicatedState) -> None:
        """Connect in the background (and again whenever the connection ends); returns at
        once. ``ready()`` turns True once the hub handed this process the state."""
        self._target = self.follower.target = target
        self.outbox.loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._connect(), name="replication-hub")

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        logged = False
        while not self._stopped:
            try:
                _, link = await loop.create_unix_connection(lambda: HubLink(self), self.hub_path)
            except OSError as e:
                if not logged:
                    log.warning("cannot reach the supervisor's hub at %s (%s); retrying",
                                self.hub_path, e)  # fmt: skip
                    logged = True
                await asyncio.sleep(RECONNECT_S)
                continue
            logged = False
            self._link = link
            await link.lost
            self._link = None
            if not self._stopped:
                log.warning("the connection to the supervisor's hub ended; connecting again")
                await asyncio.sleep(RECONNECT_S)

    async def settled(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.follower.loaded.wait(), timeout_s)

    async def stop(self) -> None:
        """Send what the outbox holds and wait for the hub to sequence it (a couple of
        seconds at most), then disconnect."""
        if self._stopped:
            return
        self.outbox.close()
        last = self.outbox.last_accepted_seq
        pending = self._link is not None and last > self.outbox.sequenced_seq
        if pending and not await self.outbox.appended(last, STOP_FLUSH_TIMEOUT_S):
            log.warning("replication stopped with %d records not sequenced",
                            self.outbox.pending())  # fmt: skip
        self._stopped = True
        link = self._link
        if link is not None and link.transport is not None:
            link.transport.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- the port -----------------------------------------------------------------------------

    def publish(self, record: bytes, ts: int) -> int:
        return self.outbox.publish(record, ts)

    def ready(self) -> bool:
        return self.follower.ready()

    def connected(self) -> bool:
        link = self._link
        return link is not None and link.transport is not None

    def write_refusal(self) -> str | None:
        if self.outbox.closed:
            return "shutting down"
        return None if self.connected() else UNREACHABLE

    def last_accepted(self) -> int:
        return self.outbox.last_accepted_seq

    def acknowledged_through(self) -> int:
        return self.outbox.sequenced_seq

    async def appended(self, seq: int, timeout_s: float) -> bool:
        return await self.outbox.appended(seq, timeout_s)

    async def caught_up(self, timeout_s: float) -> bool:
        return await self.follower.caught_up(timeout_s)

    def rejected_records(self) -> dict[str, int]:
        counts = {UNDECODABLE: self.counters.malformed}
        if self._target is not None:
            counts.update(self._target.rejections()[0])
        return counts

    def degraded_reasons(self) -> list[str]:
        reasons = [] if self.connected() else [UNREACHABLE]
        last = self.counters.last_malformed_ns
        if self._target is not None:
            newest = self._target.rejections()[1]
            if newest is not None and (last is None or newest > last):
                last = newest
        if last is not None and self.wall_clock() - last < REJECTED_RECENT_NS:
            reasons.append("replica records rejected in the last 5 minutes")
        return reasons

    def status(self) -> ReplicationStatus:
        c = self.counters
        ready = self.ready()
        reasons = self.degraded_reasons()
        return ReplicationStatus(
            mode=self.mode,
            instance_id=self.instance_id,
            ready=ready,
            not_ready_reason=None if ready else self.follower.phase.value,
            connected=self.connected(),
            degraded=bool(reasons),
            degraded_reasons=reasons,
            stream_position=str(self.follower.position),
            outbox_depth=self.outbox.pending(),
            outbox_capacity=self.outbox.capacity,
            published=c.published,
            applied=c.applied,
            duplicates=c.duplicates,
            dropped=c.dropped,
            records_rejected=self.rejected_records(),
            gaps=c.gaps,
            resets=c.resets,
            resent=c.resent,
            bootstraps=c.bootstraps,
            last_applied_lag_ms=self.follower.last_lag_ms,
            hub=self.follower.hub_stats,
        )
