"""Replicated mode: instances of one namespace share records through one Redis stream.

Write path (local first). The service mutates its trackers, then hands a record to
``publish``, which stamps ``incarnation`` and ``seq`` and puts it in a bounded outbox without
awaiting anything; a full outbox drops the newest record (counted, logged at most every 30 s).
One publisher task drains the outbox in batches (``replication_batch_events`` records, or
``replication_batch_ms`` after the first) and appends each batch to ``{ns}:events`` in one round
trip, trimming entries older than ``stream_retention_seconds``. On a Redis error it keeps the
batch, backs off (exponential with jitter, at most ~1 s) and retries, so nothing within the
outbox capacity is lost to an outage. The append is a short script rather than a plain pipeline
so it can refuse to append when the stream no longer holds this publisher's previous entry
(Redis restarted without persistence, or failed over to a lagging replica): the publisher then
re-sends what it appended in the last 30 s first, keeping its records in order for readers.

Read path. One reader task runs ``XREAD BLOCK`` from the last id it read on its own connection.
Each reply is one batch: records of this process are skipped, records already applied are
dropped by ``(origin, incarnation, seq)``, and the rest go to ``service.apply_remote`` in one
call (which keeps the producer's time for decay and request age, and flushes effects once).
Dense sequence numbers make missing records visible: when they were trimmed away or lost, the
reader loads a snapshot that covers them (a *gap*, counted) or, if none does, logs and goes on
(and writes no snapshot for a round, since its ledger now claims records its state lacks). A
starting instance does not go on: it waits for a snapshot (see Outages).

Snapshots. Every ``snapshot_interval_seconds`` one instance (under a ``SET NX PX`` lease) writes
the state of all trackers, the stream id it covers and the sequence ledger. A starting instance
loads it, reads the stream from that id (from the beginning without one) and only then reports
ready. Its own earlier records that the loaded state lacks are applied like a peer's.

Outages. Reads keep being answered from local state and writes keep being accepted (into the
outbox). Both tasks reconnect with backoff; the reader resumes from its last id, and re-reads
from the start when it finds the stream recreated or rolled back, or its own last entry gone.
Redis losing data (noticed by a publisher's refused append or by a reader) sets the reset
marker and asks for a snapshot at once, without the lease if need be. Until one is written,
starting instances stay not ready (for at most a minute): the stream then holds only the
re-sent recent records, each instance's in its own order, so replaying it could miss older
records or see a free before its add.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisError, ResponseError

from app.replication.metrics import ReplicationCounters, ReplicationMetrics
from app.replication.port import ReplicaTarget, ReplicationStatus
from app.replication.queue import EventQueue, PublishQueueClosed, PublishQueueError, collect_batch
from app.replication.records import (
    RECORD_FIELD,
    MalformedRecord,
    SeqLedger,
    as_replayed,
    decode_record,
    encode_record,
    random_id,
    resolve_instance_id,
)
from app.replication.snapshots import Snapshot, SnapshotStore, gc_paused
from app.replication.stream import APPEND_SCRIPT, START_ID, NamespaceKeys, id_text, parse_id
from app.settings import Settings

__all__ = ["RedisReplication"]

log = logging.getLogger(__name__)

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000

READ_BLOCK_MS = 2_000
READ_COUNT = 1_000
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0
CONNECT_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 10.0
HEALTH_CHECK_INTERVAL_S = 10
CLIENT_RETRIES = 2
START_WAIT_S = 10.0  # start() returns after this even if still catching up (then not ready)
STOP_FLUSH_TIMEOUT_S = 2.0
RESEND_WINDOW_NS = 30 * NS_PER_S
BOOTSTRAP_RETRY_S = 0.5  # while waiting for a snapshot that a running instance is to write
SNAPSHOT_WAIT_NS = 60 * NS_PER_S  # then bootstrap anyway (no instance able to write one is up)
DROP_LOG_INTERVAL_NS = 30 * NS_PER_S
DEGRADED_AFTER_DROP_NS = 60 * NS_PER_S
LEDGER_FORGET_NS = 7 * 24 * 3600 * NS_PER_S

IO_ERRORS = (RedisError, OSError)


class BootstrapPending(Exception):
    """Bootstrapping now would miss records that only running instances hold: retry later."""


def backoff_delay(attempt: int) -> float:
    """Seconds to wait before retry number ``attempt`` (1, 2, ...): exponential, jittered, capped."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


def _honour_cancellation() -> None:
    """Raise if this task was cancelled while redis-py swallowed the cancellation.

    A cancel that lands during a connection health check or a blocking read can be lost inside
    redis-py (redis-py #2028); the command then returns normally. Loops call this every turn so
    ``stop()`` always ends them.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _client(url: str, socket_timeout: float, name: str) -> Redis:
    return Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        retry=Retry(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S / 2), CLIENT_RETRIES),
        client_name=name,
    )


class RedisReplication:
    """Replication through Redis; see the module docstring. One per process (per app)."""

    mode = "redis"

    def __init__(
        self,
        settings: Settings,
        registry: CollectorRegistry,
        clock: Callable[[], int] = time.monotonic_ns,
        wall_clock: Callable[[], int] = time.time_ns,
    ) -> None:
        if not settings.redis_url:
            raise ValueError("RedisReplication needs settings.redis_url")
        self.settings = settings
        self.clock = clock
        self.wall_clock = wall_clock
        self.instance_id = resolve_instance_id(settings.instance_id)
        self.incarnation = random_id()
        self.keys = NamespaceKeys.of(settings.namespace)
        self.service: ReplicaTarget | None = None
        self.counters = ReplicationCounters()

        # write path
        self._outbox: EventQueue[dict[str, Any]] = EventQueue(settings.outbox_capacity)
        self._next_seq = 1
        self._last_appended = ""  # stream id of our newest appended entry
        self._recent: deque[tuple[int, bytes]] = deque(maxlen=settings.outbox_capacity)
        self._last_drop_ns: int | None = None
        self._last_drop_log_ns: int | None = None
        self._drops_since_log = 0

        # read path
        self._own_key = (self.instance_id, self.incarnation)
        self._seqs = SeqLedger()
        self._last_id = START_ID
        self._local_floor = 1  # own records from this seq on are already in local state
        self._replay_target = 0  # own records up to this seq must be read back before snapshots
        self._bootstrapped = False
        self._settled = asyncio.Event()
        self._check_stream = False
        self._last_lag_ms: float | None = None
        self._snapshot_soon = asyncio.Event()  # Redis lost data: write one without waiting
        self._waiting_since: int | None = None  # bootstrap waits for a snapshot since then
        self._no_snapshot_until = 0  # clock ns; after a gap that no snapshot covered

        # snapshots
        self._snapshot_at: int | None = None
        self._snapshot_id: str | None = None

        # connections and tasks
        self._client: Redis | None = None
        self._reader: Redis | None = None
        self._store: SnapshotStore | None = None
        self._append: Any = None
        self._tasks: list[asyncio.Task] = []
        self._publisher_task: asyncio.Task | None = None
        self._reader_ok: bool | None = None
        self._publisher_ok: bool | None = None
        self._not_ready_reason = "not started"
        self._stopped = False

        self.metrics = ReplicationMetrics(registry, self.counters, self._pending, self.connected)

    # -- wiring ----------------------------------------------------------------------------

    async def start(self, target: ReplicaTarget) -> None:
        """Connect, bootstrap ``target`` (snapshot + catch-up) and start the background tasks.

        Never raises for Redis trouble: when Redis is unreachable, bootstrap keeps being retried
        in the background and ``ready()`` stays False until it succeeds.
        """
        self.service = target
        url = self.settings.redis_url
        self._client = _client(url, COMMAND_TIMEOUT_S, f"slot-tracker-{self.instance_id}")
        # the blocking XREAD needs a socket timeout longer than its BLOCK
        self._reader = _client(
            url, READ_BLOCK_MS / 1000 + COMMAND_TIMEOUT_S, f"slot-tracker-{self.instance_id}-rd"
        )
        self._append = self._client.register_script(APPEND_SCRIPT)
        self._store = SnapshotStore(self._client, self.keys)
        self._not_ready_reason = "connecting to Redis"
        self._publisher_task = self._spawn(self._publish_loop(), "replication-publisher")
        self._spawn(self._read_loop(), "replication-reader")
        self._spawn(self._snapshot_loop(), "replication-snapshots")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._settled.wait(), START_WAIT_S)
        if not self._bootstrapped:
            log.warning(
                "replication not ready (%s); retrying in the background", self._not_ready_reason
            )

    def _spawn(self, coro: Any, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    async def stop(self) -> None:
        """Publish what the outbox holds (for at most a couple of seconds), then shut down."""
        if self._stopped:
            return
        self._stopped = True
        self._outbox.shutting_down = True
        self._outbox.close()
        pub = self._publisher_task
        if pub is not None and not pub.done():
            try:
                await asyncio.wait_for(asyncio.shield(pub), STOP_FLUSH_TIMEOUT_S)
            except TimeoutError:
                log.warning("replication stopped with %d records not published", self._pending())
            except Exception:
                log.exception("replication publisher failed")
        await self._cancel_tasks()
        for client in (self._client, self._reader):
            if client is not None:
                await client.aclose()

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

    # -- write path ------------------------------------------------------------------------

    def publish(self, record: dict[str, Any]) -> None:
        """Queue one record for the stream; never blocks, never raises."""
        seq = self._next_seq
        record["incarnation"] = self.incarnation
        record["seq"] = seq
        try:
            self._outbox.try_send(record)
        except PublishQueueError as e:
            self._dropped(record, e)
            return
        self._next_seq = seq + 1  # only accepted records use up a number

    def _dropped(self, record: dict[str, Any], error: PublishQueueError) -> None:
        self.counters.dropped += 1
        if isinstance(error, PublishQueueClosed):
            log.debug("replication outbox closed; dropping a record during shutdown")
            return
        now = self.clock()
        self._last_drop_ns = now
        self._drops_since_log += 1
        last = self._last_drop_log_ns
        if last is None or now - last >= DROP_LOG_INTERVAL_NS:
            event = record.get("event") or {}
            log.error(
                "replication outbox full (capacity=%d); dropping newest record "
                "(request_id=%s); %d dropped since the last message, %d in total",
                self._outbox.capacity,
                event.get("request_id"),
                self._drops_since_log,
                self.counters.dropped,
            )
            self._last_drop_log_ns = now
            self._drops_since_log = 0

    async def _publish_loop(self) -> None:
        max_events = self.settings.replication_batch_events
        max_ns = self.settings.replication_batch_ms * NS_PER_MS
        while True:
            _honour_cancellation()
            batch, stop = await collect_batch(
                self._outbox, max_events=max_events, max_duration_ns=max_ns, clock=self.clock
            )
            if batch:
                await self._append_batch(batch)
            if stop:
                return

    async def _append_batch(self, batch: list[dict[str, Any]]) -> None:
        """Append until it succeeds; the batch is kept across any number of Redis errors."""
        payloads = [encode_record(r) for r in batch]
        attempt = 0
        while True:
            _honour_cancellation()
            try:
                await self._append_payloads(payloads)
                break
            except IO_ERRORS as e:
                attempt += 1
                self._set_publisher_ok(False, e)
                await asyncio.sleep(backoff_delay(attempt))
        self.counters.published += len(payloads)
        self._set_publisher_ok(True)

    def _trim_horizon(self) -> str:
        retention_ms = self.settings.stream_retention_seconds * 1000
        return str(max(0, self.wall_clock() // NS_PER_MS - retention_ms))

    async def _append_payloads(self, payloads: list[bytes]) -> None:
        key = [self.keys.events, self.keys.reset]
        ids = await self._append(
            keys=key, args=[self._last_appended, self._trim_horizon(), *payloads]
        )
        if ids is None:  # our previous entry is gone: re-send recent records first
            await self._resend_recent()
            ids = await self._append(keys=key, args=["", self._trim_horizon(), *payloads])
        self._last_appended = id_text(ids[-1])
        now = self.wall_clock()
        recent = self._recent
        recent.extend((now, p) for p in payloads)
        horizon = now - self._resend_window_ns()
        while recent[0][0] < horizon:
            recent.popleft()

    def _resend_window_ns(self) -> int:
        return min(RESEND_WINDOW_NS, self.settings.stream_retention_seconds * NS_PER_S)

    async def _resend_recent(self) -> None:
        """Re-send the records of the resend window after Redis lost our last one.

        Older records now exist only in the instances' memory: whatever happens here, ask for a
        snapshot right away (an instance with the full state writes one) so that starting
        instances, which wait for it, need not wait for the periodic round.
        """
        window = self._resend_window_ns()
        horizon = self.wall_clock() - window
        recent = self._recent
        while recent and recent[0][0] < horizon:
            recent.popleft()
        self._last_appended = ""
        self._snapshot_soon.set()
        if not recent:
            return
        payloads = [p for _, p in recent]
        log.warning(
            "Redis no longer holds this instance's last replica record (restarted without "
            "persistence or failed over); re-sending the %d records of the last %d s",
            len(payloads),
            window // NS_PER_S,
        )
        step = self.settings.replication_batch_events
        for i in range(0, len(payloads), step):
            ids = await self._append(
                keys=[self.keys.events, self.keys.reset],
                args=["", self._trim_horizon(), *payloads[i : i + step]],
            )
            self._last_appended = id_text(ids[-1])
        self.counters.resent += len(payloads)

    # -- read path -------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        attempt = 0
        while True:
            _honour_cancellation()
            try:
                if not self._bootstrapped:
                    await self._bootstrap()
                elif self._check_stream:
                    await self._check_stream_reset()
                await self._read_once(READ_BLOCK_MS)
                attempt = 0
            except asyncio.CancelledError:
                raise
            except BootstrapPending as e:  # start() keeps waiting (up to START_WAIT_S)
                attempt = 0
                self._not_ready_reason = str(e)
                await asyncio.sleep(BOOTSTRAP_RETRY_S)
            except IO_ERRORS as e:
                attempt += 1
                self._check_stream = True
                self._set_reader_ok(False, e)
                await asyncio.sleep(backoff_delay(attempt))
            except Exception as e:  # a bug must not end replication; retry after a pause
                attempt += 1
                log.exception("replication reader failed; retrying")
                if not self._bootstrapped:
                    self._not_ready_reason = f"bootstrap failed: {e!r}"
                    self._settled.set()
                await asyncio.sleep(backoff_delay(attempt))

    async def _read_once(self, block_ms: int | None) -> int:
        assert self._reader is not None
        reply = await self._reader.xread(
            {self.keys.events: self._last_id}, count=READ_COUNT, block=block_ms
        )
        self._set_reader_ok(True)
        entries = reply[0][1] if reply else []
        if entries:
            await self._ingest(entries)
        return len(entries)

    async def _bootstrap(self) -> None:
        assert self._store is not None
        self._not_ready_reason = "loading the snapshot and catching up with the stream"
        started = self.clock()
        # checked before loading: a snapshot written in between clears the marker
        why = (
            "Redis lost data and no snapshot was written since: the stream alone may lack "
            "records or hold them out of order"
        )
        if await self._store.reset_pending() and self._wait_for_snapshot(why):
            raise BootstrapPending(f"waiting for a snapshot: {why}")
        snapshot = await self._load_snapshot()
        try:
            self._restore(snapshot)
        except (KeyError, TypeError, ValueError) as e:
            log.error("ignoring a snapshot that does not restore (%r); reading the stream", e)
            snapshot = None
            self._restore(None)
        read = 0
        while True:  # until a read comes back short, without having had to reposition
            bootstraps = self.counters.bootstraps
            n = await self._read_once(None)
            read += n
            if n < READ_COUNT and self.counters.bootstraps == bootstraps:
                break
        self._waiting_since = None
        self._bootstrapped = True
        self._not_ready_reason = ""
        self._settled.set()
        log.info(
            "replication bootstrapped in %.0f ms from %s and %d stream entries; reading from %s",
            (self.clock() - started) / NS_PER_MS,
            f"snapshot {snapshot.stream_id}" if snapshot else "no snapshot",
            read,
            self._last_id,
        )

    def _wait_for_snapshot(self, why: str) -> bool:
        """Whether to keep waiting for a snapshot (one that a running instance is to write)
        rather than go on without one: True until we have waited ``SNAPSHOT_WAIT_NS``."""
        now = self.clock()
        if self._waiting_since is None:
            self._waiting_since = now
            log.warning("replication: %s; waiting for a snapshot", why)
        if now - self._waiting_since < SNAPSHOT_WAIT_NS:
            return True
        log.error(
            "replication waited %d s for a snapshot in vain (%s); going on without it",
            SNAPSHOT_WAIT_NS // NS_PER_S,
            why,
        )
        return False

    def _restore(self, snapshot: Snapshot | None) -> None:
        """Replace local state by ``snapshot`` (empty without one); read on from its id.

        Own records queued or appended after the snapshot was taken are missing from the
        restored state: from here on they are applied when read back (``as_replayed``).
        """
        if snapshot is None:
            self.service.restore_state([])
            self._seqs = SeqLedger()
            self._last_id = START_ID
        else:
            with gc_paused(freeze=True):
                self.service.restore_state(snapshot.trackers)
            self._seqs = snapshot.seqs.copy()
            self._last_id = snapshot.stream_id
            self._note_snapshot(snapshot.stream_id, snapshot.at)
        self._local_floor = self._next_seq
        self._replay_target = self._next_seq - 1
        self.counters.bootstraps += 1

    async def _check_stream_reset(self) -> None:
        """After a reconnect: did the stream disappear, roll back behind our position, or lose
        our own last entry? The last catches a stream that a peer's re-sent records recreated
        meanwhile: its ids are newer than our position, but it holds nothing from before."""
        assert self._reader is not None and self._store is not None
        try:
            info = await self._reader.xinfo_stream(self.keys.events)
            last = id_text(info["last-generated-id"])
        except ResponseError:  # no such key
            last = None
        own = self._last_appended
        own_lost = (
            bool(own)
            and last is not None
            and not await self._reader.xrange(self.keys.events, own, own)
        )
        if self._last_id == START_ID:
            self._check_stream = False
            return
        rolled_back = last is not None and parse_id(last) < parse_id(self._last_id)
        if last is not None and not rolled_back and not own_lost:
            self._check_stream = False
            return
        await self._store.mark_reset()  # starting instances wait for a snapshot
        self._check_stream = False
        restart_from = last if rolled_back and last is not None else START_ID
        self.counters.resets += 1
        self._snapshot_soon.set()
        log.warning(
            "the replica stream was %s (Redis restarted or failed over); reading on from %s "
            "instead of %s",
            "rolled back" if rolled_back else "recreated",
            restart_from,
            self._last_id,
        )
        self._last_id = restart_from

    async def _ingest(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        """Filter one XREAD reply and apply it as one batch."""
        seqs = self._seqs
        own_id, own_key, floor = self.instance_id, self._own_key, self._local_floor
        now = self.wall_clock()
        batch: list[dict[str, Any]] = []
        position = self._last_id
        for entry_id, fields in entries:
            eid = id_text(entry_id)
            try:
                record = decode_record(fields[RECORD_FIELD])
            except (KeyError, MalformedRecord) as e:
                self.counters.malformed += 1
                log.warning("skipping stream entry %s: %s", eid, e)
                position = eid
                continue
            key = (record["origin"], record["incarnation"])
            seq = record["seq"]
            missing = seqs.missing_before(key, seq)
            if missing < 0:
                self.counters.duplicates += 1
                position = eid
                continue
            if missing > 0:
                self._apply(batch, position, now)
                await self._on_gap(key, seq, missing)
                return  # the next read starts again from the (possibly new) position
            seqs.advance(key, seq, now)
            position = eid
            if record["origin"] == own_id:
                if key == own_key and seq >= floor:
                    self.counters.own_skipped += 1
                    continue
                record = as_replayed(record)  # ours, but older than the local state
            batch.append(record)
        self._apply(batch, position, now)

    def _apply(self, batch: list[dict[str, Any]], position: str, now: int) -> None:
        self._last_id = position
        if not batch:
            return
        with gc_paused():  # a large catch-up batch allocates a lot; collect afterwards
            self.service.apply_remote(batch)
        self.counters.applied += len(batch)
        observe = self.metrics.lag.observe
        lag_ns = 0
        for record in batch:
            lag_ns = max(0, now - record["ts"])
            observe(lag_ns / NS_PER_S)
        self._last_lag_ms = lag_ns / NS_PER_MS

    async def _load_snapshot(self) -> Snapshot | None:
        """The stored snapshot; None when there is none or it cannot be decoded."""
        assert self._store is not None
        try:
            return await self._store.load()
        except IO_ERRORS:
            raise
        except Exception as e:  # a snapshot written by an incompatible version, or garbage
            log.error("ignoring an unreadable snapshot: %r", e)
            return None

    async def _on_gap(self, key: tuple[int, int], seq: int, missing: int) -> None:
        snapshot = await self._load_snapshot()
        if self._waiting_since is None:  # not again for each retry while waiting
            self.counters.gaps += 1
        if snapshot is not None and snapshot.seqs.get(key) >= seq - 1:
            self._waiting_since = None
            self._snapshot_soon.set()  # peers starting now should not find the same hole
            log.warning(
                "replication gap: %d record(s) of instance %d before seq %d are no longer in "
                "the stream; bootstrapping again from snapshot %s",
                missing,
                key[0],
                seq,
                snapshot.stream_id,
            )
            self._restore(snapshot)
            return
        # Likely Redis lost data and the instances that hold these records have not written a
        # snapshot yet. A starting instance waits for one rather than be ready with (and spread)
        # a partial state; a running one waits too while a reset is known to be pending.
        why = (
            f"{missing} record(s) of instance {key[0]} before seq {seq} are not in the stream "
            "and no snapshot covers them"
        )
        if not self._bootstrapped:
            if self._wait_for_snapshot(why):
                raise BootstrapPending(f"waiting for a snapshot: {why}")
        elif await self._store.reset_pending() and self._wait_for_snapshot(why):
            await asyncio.sleep(BOOTSTRAP_RETRY_S)
            return  # the next read meets the gap again and looks for the snapshot again
        self._waiting_since = None
        log.error(
            "replication gap: %d record(s) of instance %d before seq %d are no longer in the "
            "stream and no snapshot covers them; going on without them",
            missing,
            key[0],
            seq,
        )
        self._seqs.advance(key, seq - 1, self.wall_clock())
        # our ledger now claims records our state lacks: no snapshot from us for a round, so
        # that an instance holding them (which saw the reset too) writes the next one
        interval_ns = self.settings.snapshot_interval_seconds * NS_PER_S
        self._no_snapshot_until = self.clock() + interval_ns

    # -- snapshots -------------------------------------------------------------------------

    async def _snapshot_loop(self) -> None:
        interval = self.settings.snapshot_interval_seconds
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._snapshot_soon.wait(), interval * random.uniform(0.8, 1.2)
                )
            urgent = self._snapshot_soon.is_set()
            self._snapshot_soon.clear()
            _honour_cancellation()
            try:
                done = await self._snapshot_tick(interval * 1000, urgent)
            except asyncio.CancelledError:
                raise
            except IO_ERRORS as e:
                log.debug("snapshot round skipped: %s", e)
                done = False
            except Exception:
                log.exception("snapshot round failed")
                done = False
            if urgent and not done:  # e.g. the reader has not checked the stream yet
                await asyncio.sleep(1.0)
                self._snapshot_soon.set()

    async def _snapshot_tick(self, lease_ms: int, urgent: bool = False) -> bool:
        """Write a snapshot if it is our turn; else note the age of the stored one.

        True when a snapshot exists afterwards that is at most this round old. ``urgent``: also
        write one without the lease while Redis lost data and no snapshot was written since;
        starting instances wait for it, and the lease holder may not be about to write one.
        """
        assert self._store is not None
        self._seqs.prune(self.wall_clock() - LEDGER_FORGET_NS)
        if self._can_snapshot():
            token = f"{self.instance_id}:{self.incarnation}:{random_id()}"
            if await self._store.try_lease(token, lease_ms):
                return await self.write_snapshot(token)
        if urgent and await self._store.reset_pending():
            return await self.write_snapshot()  # False if we cannot: the loop asks again soon
        meta = await self._store.meta()
        if meta is None:
            return False
        self._note_snapshot(*meta)
        return True

    def _can_snapshot(self) -> bool:
        """Only a caught-up state that includes all our own accepted records is worth saving,
        only with a stream position checked against the server we are talking to, and neither
        while we wait at a gap nor soon after we went on past records that no snapshot covered
        (the ledger would claim records the state lacks)."""
        return (
            self._bootstrapped
            and bool(self._reader_ok)
            and not self._check_stream
            and self._seqs.get(self._own_key) >= self._replay_target
            and self._waiting_since is None
            and self.clock() >= self._no_snapshot_until
        )

    def take_snapshot(self) -> Snapshot:
        """This instance's state with the stream position and ledger that match it."""
        seqs = self._seqs.copy()
        last_local = self._next_seq - 1
        if last_local > seqs.get(self._own_key):
            seqs.advance(self._own_key, last_local, self.wall_clock())
        return Snapshot(
            self._last_id, self.wall_clock(), self.instance_id, seqs, self.service.export_state()
        )

    async def write_snapshot(self, lease_token: str = "") -> bool:
        """Write a snapshot now (unfenced without a token); False if not possible or fenced off."""
        if self._store is None or not self._can_snapshot():
            return False
        started = self.clock()
        with gc_paused():
            snapshot = self.take_snapshot()
            blob = snapshot.encode()
        if not await self._store.write(snapshot, blob, lease_token):
            return False
        self.counters.snapshots_written += 1
        self._note_snapshot(snapshot.stream_id, snapshot.at)
        log.info(
            "wrote snapshot at %s: %d trackers, %d bytes, %.0f ms",
            snapshot.stream_id,
            len(snapshot.trackers),
            len(blob),
            (self.clock() - started) / NS_PER_MS,
        )
        return True

    def _note_snapshot(self, stream_id: str, at: int) -> None:
        if self._snapshot_at is None or at > self._snapshot_at:
            self._snapshot_at = at
            self._snapshot_id = stream_id

    # -- visibility ------------------------------------------------------------------------

    def _set_reader_ok(self, ok: bool, error: BaseException | None = None) -> None:
        was = self._reader_ok
        self._reader_ok = ok
        if ok:
            if was is False:
                log.info("replication reader reconnected to Redis; resuming from %s", self._last_id)
            return
        if not self._bootstrapped:
            self._not_ready_reason = f"Redis unreachable: {error}"
            self._settled.set()
        if was is not False:
            log.warning(
                "replication reader lost Redis (%s); local state keeps serving, retrying", error
            )

    def _set_publisher_ok(self, ok: bool, error: BaseException | None = None) -> None:
        was = self._publisher_ok
        self._publisher_ok = ok
        if ok:
            if was is False:
                log.info("replication publisher reconnected to Redis; outbox drained")
            return
        if was is not False:
            log.warning(
                "replication publisher lost Redis (%s); buffering up to %d records, retrying",
                error,
                self._outbox.capacity,
            )

    def _pending(self) -> int:
        """Accepted records not yet appended (queued, being batched, or in flight)."""
        return self._next_seq - 1 - self.counters.published

    def connected(self) -> bool:
        return bool(self._reader_ok) and self._publisher_ok is not False

    def ready(self) -> bool:
        return self._bootstrapped

    def degraded_reasons(self) -> list[str]:
        reasons = []
        if not self.connected():
            reasons.append("Redis unreachable")
        if len(self._outbox) >= 0.9 * self._outbox.capacity:
            reasons.append("outbox nearly full")
        last_drop = self._last_drop_ns
        if last_drop is not None and self.clock() - last_drop < DEGRADED_AFTER_DROP_NS:
            reasons.append("records dropped in the last minute")
        return reasons

    def status(self) -> ReplicationStatus:
        c = self.counters
        reasons = self.degraded_reasons()
        age = None
        if self._snapshot_at is not None:
            age = max(0.0, (self.wall_clock() - self._snapshot_at) / NS_PER_S)
        return ReplicationStatus(
            mode=self.mode,
            instance_id=self.instance_id,
            namespace=self.settings.namespace,
            ready=self.ready(),
            not_ready_reason=None if self.ready() else self._not_ready_reason,
            connected=self.connected(),
            degraded=bool(reasons),
            degraded_reasons=reasons,
            stream_position=self._last_id,
            outbox_depth=self._pending(),
            outbox_capacity=self._outbox.capacity,
            published=c.published,
            applied=c.applied,
            duplicates=c.duplicates,
            dropped=c.dropped,
            gaps=c.gaps,
            resets=c.resets,
            resent=c.resent,
            bootstraps=c.bootstraps,
            snapshots_written=c.snapshots_written,
            last_applied_lag_ms=self._last_lag_ms,
            snapshot_age_seconds=age,
            snapshot_stream_id=self._snapshot_id,
        )
