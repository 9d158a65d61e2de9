"""``RedisReplication``: the ``Replication`` port over Redis, composed of its parts.

It builds the parts (see the package docstring for what each does), starts their three tasks
on ``start(target)``, stops them on ``stop()``, and reports their state as one
``ReplicationStatus`` and one set of metrics. It holds no replication rule of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import CollectorRegistry

from kv_slot_tracker.core.types import NS_PER_MS, NS_PER_S
from kv_slot_tracker.replication.metrics import (
    ANOMALIES,
    ReplicationCounters,
    group_commit_histogram,
    lag_histogram,
    register_collector,
)
from kv_slot_tracker.replication.port import ReplicatedState, ReplicationStatus
from kv_slot_tracker.replication.records import random_id, resolve_instance_id
from kv_slot_tracker.replication.redis.barrier import ReadBarrier
from kv_slot_tracker.replication.redis.bootstrap import START_WAIT_S, Bootstrap
from kv_slot_tracker.replication.redis.connection import (
    IO_ERRORS,
    RedisClients,
    honour_cancellation,
)
from kv_slot_tracker.replication.redis.endpoint import RedisEndpoint
from kv_slot_tracker.replication.redis.instance import Instance
from kv_slot_tracker.replication.redis.outbox import Outbox
from kv_slot_tracker.replication.redis.reader import StreamReader
from kv_slot_tracker.replication.redis.schedule import SnapshotSchedule
from kv_slot_tracker.replication.redis.snapshots import Snapshot, SnapshotStore, SnapshotWriter
from kv_slot_tracker.replication.redis.stream import NamespaceKeys
from kv_slot_tracker.settings import Settings

log = logging.getLogger(__name__)

STOP_FLUSH_TIMEOUT_S = 2.0
REJECTED_RECENT_NS = 300 * NS_PER_S  # degraded this long after a peer's record was rejected
UNDECODABLE = "undecodable"  # the reason label of stream entries that are not records
SEQ_JUMP = "seq_jump"  # ... of records whose sequence number jumps past the window (forged)
FOLLOW_PRIMARY_S = 1.0


class RedisReplication:
    """Replication through Redis. One per process (per app)."""

    mode = "redis"
    barrier_covers_acknowledged = False  # a peer's outbox may hold an acknowledged change

    def __init__(
        self,
        settings: Settings,
        registry: CollectorRegistry,
        clock: Callable[[], int] = time.monotonic_ns,
        wall_clock: Callable[[], int] = time.time_ns,
    ) -> None:
        if settings.embedded:
            raise ValueError("RedisReplication needs settings.redis_url or redis_sentinels")
        self.settings = settings
        self.endpoint = RedisEndpoint.of(settings)  # a shape the settings' rules accepted
        self.instance_id = resolve_instance_id(settings.instance_id)
        self.incarnation = random_id()
        self.counters = ReplicationCounters()
        self.me = Instance(
            settings,
            NamespaceKeys.of(settings.namespace),
            self.instance_id,
            self.incarnation,
            clock,
            wall_clock,
            self.counters,
        )
        self.schedule = SnapshotSchedule()
        self.bootstrap = Bootstrap(clock)
        self.outbox = Outbox(self.me, self.schedule)
        self.reader = StreamReader(
            self.me,
            lag=lag_histogram(registry),
            bootstrap=self.bootstrap,
            outbox=self.outbox,
            schedule=self.schedule,
        )
        self.snapshots = SnapshotWriter(
            self.me,
            schedule=self.schedule,
            bootstrap=self.bootstrap,
            outbox=self.outbox,
            reader=self.reader,
        )
        self.outbox.group_commit = group_commit_histogram(registry).observe
        self.barrier = ReadBarrier(self.me.keys)
        self.reader.on_position = self.barrier.advanced
        self.reader.on_checked = self.barrier.position_checked
        self.reader.on_catching_up = self._not_ready_again
        self._readiness_watchers: list[Callable[[], None]] = []
        self._target: ReplicatedState | None = None
        self.reader.check_role = self.endpoint.kind == "sentinel"
        register_collector(
            registry, self.counters, self.outbox.pending, self.connected, self.rejected_records
        )
        self._clients: RedisClients | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._publisher: asyncio.Task[None] | None = None
        self._stopped = False

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self, target: ReplicatedState) -> None:
        """Start the background tasks, which connect and bootstrap ``target`` (snapshot +
        catch-up); returns at once, so the instance listens (``/health`` 200, ``/ready`` 503
        with the reason) while it bootstraps. ``settled`` waits for the bootstrap.

        Never raises for Redis trouble: when Redis is unreachable, bootstrap keeps being retried
        in the background and ``ready()`` stays False until it succeeds.
        """
        self._target = target
        clients = self._clients = RedisClients(self.endpoint, self.instance_id)
        log.info("replication through %s", self.endpoint.describe())
        store = SnapshotStore(clients.commands, self.me.keys)
        self.outbox.connect(clients.publish)
        self.barrier.connect(clients.commands)
        self.reader.connect(clients.reads, store, target)
        self.snapshots.connect(store, target)
        self.bootstrap.connecting()
        self._publisher = self._spawn(self.outbox.run(), "replication-publisher")
        self._spawn(self.reader.run(), "replication-reader")
        self._spawn(self.snapshots.run(), "replication-snapshots")
        if self.endpoint.kind == "sentinel":
            self._spawn(self._follow_primary(clients), "replication-sentinel")

    async def _follow_primary(self, clients: RedisClients) -> None:
        """Every second, ask the Sentinels whether the primary moved (``follow_primary``)."""
        while True:
            await asyncio.sleep(FOLLOW_PRIMARY_S)
            honour_cancellation()
            try:
                if await clients.follow_primary():
                    log.warning("the Sentinels name a new Redis primary; reconnecting to it")
            except IO_ERRORS as e:
                log.debug("asking the Sentinels failed: %s", e)

    async def settled(self, timeout_s: float = START_WAIT_S) -> None:
        """Until the bootstrap settled (ready, Redis unreachable, or failed), at most
        ``timeout_s``; an instance waiting for a snapshot keeps it waiting."""
        await self.bootstrap.settled(timeout_s)
        if not self.bootstrap.ready():
            log.warning(
                "replication not ready (%s); retrying in the background",
                self.bootstrap.not_ready_reason,
            )

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    async def stop(self) -> None:
        """Publish what the outbox holds (for at most a couple of seconds), then shut down."""
        if self._stopped:
            return
        self._stopped = True
        self.outbox.close()
        pub = self._publisher
        if pub is not None and not pub.done():
            try:
                await asyncio.wait_for(asyncio.shield(pub), STOP_FLUSH_TIMEOUT_S)
            except TimeoutError:
                log.warning(
                    "replication stopped with %d records not published", self.outbox.pending()
                )
            except Exception:
                log.exception("replication publisher failed")
        await self._cancel_tasks()
        if self._clients is not None:
            await self._clients.close()

    async def _cancel_tasks(self) -> None:
        """Cancel every task, again and again: redis-py may swallow one cancellation."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_FLUSH_TIMEOUT_S
        pending = {t for t in self._tasks if not t.done()}
        while pending and loop.time() < deadline:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.05)
        if pending:
            log.warning("replication tasks did not stop: %s", [t.get_name() for t in pending])

    # -- the port ---------------------------------------------------------------------------

    def publish(self, record: bytes, ts: int) -> int:
        """Queue one record for the stream; never blocks, never raises; its seq (0: dropped)."""
        return self.outbox.publish(record, ts)

    # -- durable acknowledgements (``replication_ack = "redis"``) -----------------------------

    def write_refusal(self) -> str | None:
        """Why a change must not be accepted now (None: it may): Redis known unreachable."""
        return self.outbox.refusal(self.settings.replication_ack_timeout_ms * NS_PER_MS)

    def last_accepted(self) -> int:
        """The sequence number of our newest record queued for the stream."""
        return self.outbox.last_accepted_seq

    def acknowledged_through(self) -> int:
        """Our records up to this seq are in the stream (and confirmed by the replicas)."""
        return self.outbox.confirmed_seq

    async def appended(self, seq: int, timeout_s: float) -> bool:
        """Until our records up to ``seq`` are in the stream (True), at most ``timeout_s``."""
        return await self.outbox.appended(seq, timeout_s)

    async def caught_up(self, timeout_s: float) -> bool:
        """The read barrier (``barrier.ReadBarrier.caught_up``)."""
        return await self.barrier.caught_up(timeout_s)

    def ready(self) -> bool:
        """Bootstrapped, and not re-reading a stream that turned out not to be the one read
        so far (a primary switch, ``reader``)."""
        return self.bootstrap.ready() and not self.reader.catching_up

    def watch_readiness(self, lost: Callable[[], None]) -> None:
        """Have ``lost`` called whenever a ready instance stops being ready (the readiness
        gate closes again; it opens once ``ready()`` says so)."""
        self._readiness_watchers.append(lost)

    def _not_ready_again(self) -> None:
        for lost in self._readiness_watchers:
            lost()

    def _not_ready_reason(self) -> str:
        if not self.bootstrap.ready():
            return self.bootstrap.not_ready_reason
        return "re-reading the stream after Redis failed over or lost data"

    def connected(self) -> bool:
        return bool(self.reader.connected) and self.outbox.connected is not False

    def rejected_records(self) -> dict[str, int]:
        """Peers' records rejected so far, by reason: entries that are not records (the
        reader's), then what the service refused."""
        counts = {UNDECODABLE: self.counters.malformed, SEQ_JUMP: self.counters.anomalies[SEQ_JUMP]}
        if self._target is not None:
            counts.update(self._target.rejections()[0])
        return counts

    def degraded_reasons(self) -> list[str]:
        reasons = [] if self.connected() else ["Redis unreachable"]
        reasons += self.outbox.degraded_reasons()
        last = self.counters.last_malformed_ns
        if self._target is not None:
            newest = self._target.rejections()[1]
            if newest is not None and (last is None or newest > last):
                last = newest
        if last is not None and self.me.wall_clock() - last < REJECTED_RECENT_NS:
            reasons.append("replica records rejected in the last 5 minutes")
        now = self.me.wall_clock()
        for reason, at in self.counters.anomaly_at.items():
            if now - at < REJECTED_RECENT_NS:
                reasons.append(f"{reason}: {ANOMALIES[reason]}, in the last 5 minutes")
        return reasons

    def status(self) -> ReplicationStatus:
        c = self.counters
        reasons = self.degraded_reasons()
        ready = self.ready()
        return ReplicationStatus(
            mode=self.mode,
            instance_id=self.instance_id,
            namespace=self.settings.namespace,
            redis=self.endpoint.describe(),
            ready=ready,
            not_ready_reason=None if ready else self._not_ready_reason(),
            connected=self.connected(),
            degraded=bool(reasons),
            degraded_reasons=reasons,
            stream_position=self.reader.position,
            outbox_depth=self.outbox.pending(),
            outbox_capacity=self.outbox.capacity,
            published=c.published,
            applied=c.applied,
            duplicates=c.duplicates,
            dropped=c.dropped,
            records_rejected=self.rejected_records(),
            anomalies=dict(c.anomalies),
            gaps=c.gaps,
            resets=c.resets,
            resent=c.resent,
            bootstraps=c.bootstraps,
            snapshots_written=c.snapshots_written,
            last_applied_lag_ms=self.reader.last_lag_ms,
            snapshot_age_seconds=self.schedule.age_seconds(self.me.wall_clock()),
            snapshot_stream_id=self.schedule.newest_id,
        )

    # -- snapshots on demand ----------------------------------------------------------------

    @property
    def snapshot_store(self) -> SnapshotStore | None:
        """Where snapshots are kept (None before ``start``)."""
        return self.snapshots.store

    def take_snapshot(self) -> Snapshot:
        """This instance's state with the stream position and ledger that match it."""
        return self.snapshots.take()

    async def write_snapshot(self, lease_token: str = "") -> bool:
        """Write a snapshot now (unfenced without a token); False if not possible or fenced off."""
        return await self.snapshots.write(lease_token)
