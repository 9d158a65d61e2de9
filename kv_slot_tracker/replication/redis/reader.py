"""The read path: the stream into the local state, in order, each record once.

One reader task runs ``XREAD BLOCK`` from the last id it read on its own connection. Each reply
is one batch: records of this process are skipped, records already applied are dropped by
``(origin, incarnation, seq)`` (the ``SeqLedger``), and the rest go to the target's
``apply_remote`` in one call (which keeps the producer's time for decay and request age, and
flushes effects once).

Dense sequence numbers make missing records visible: when they were trimmed away or lost, the
reader loads a snapshot that covers them (a *gap*, counted) or, if none does, logs and goes on
(and writes no snapshot for a round, since its ledger now claims records its state lacks). A
starting instance does not go on: it waits for a snapshot (see ``bootstrap``).

The same task bootstraps the instance first (snapshot, then the stream after it, until a read
comes back short). After a connection error it resumes from its last id, but first checks the
stream: found recreated or rolled back, or without its own last entry, it re-reads it from the
start (or from where it now ends), sets the reset marker and asks for a snapshot at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import Histogram
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from kv_slot_tracker.core.types import NS_PER_MS, NS_PER_S
from kv_slot_tracker.replication.metrics import count_applied
from kv_slot_tracker.replication.port import Batch, OwnReadBack, ReplicatedState
from kv_slot_tracker.replication.records import (
    RECORD_FIELD,
    MalformedRecord,
    OriginKey,
    SeqLedger,
    as_replayed,
    decode_record,
)
from kv_slot_tracker.replication.redis.bootstrap import (
    BOOTSTRAP_RETRY_S,
    Bootstrap,
    BootstrapPending,
)
from kv_slot_tracker.replication.redis.connection import (
    IO_ERRORS,
    READ_BLOCK_MS,
    backoff_delay,
    ensure_primary,
    honour_cancellation,
)
from kv_slot_tracker.replication.redis.instance import Instance
from kv_slot_tracker.replication.redis.outbox import Outbox
from kv_slot_tracker.replication.redis.schedule import SnapshotSchedule
from kv_slot_tracker.replication.redis.snapshots import Snapshot, SnapshotStore, gc_paused
from kv_slot_tracker.replication.redis.stream import START_ID, id_text, parse_id

log = logging.getLogger(__name__)

READ_COUNT = 1_000
LEDGER_FORGET_NS = 7 * 24 * 3600 * NS_PER_S
MALFORMED_LOG_INTERVAL_NS = 60 * NS_PER_S


class StreamReader:
    def __init__(
        self,
        instance: Instance,
        *,
        lag: Histogram,
        bootstrap: Bootstrap,
        outbox: Outbox,
        schedule: SnapshotSchedule,
    ) -> None:
        self.me = instance  # who we are, our clocks and counters
        self.counters = instance.counters
        self.lag = lag
        self.bootstrap = bootstrap
        self.outbox = outbox
        self.schedule = schedule
        self.position = START_ID  # the stream id up to which the local state has read
        self.on_position: Callable[[str], None] | None = None  # the read barrier's hook
        self.connected: bool | None = None  # None until the first read was tried
        self.last_lag_ms: float | None = None
        self._seqs = SeqLedger()
        self._malformed_logged_ns: int | None = None
        self.check_role = False  # Sentinel: make sure a (re)connection reached the primary
        self._client: Redis | None = None
        self._store: SnapshotStore | None = None
        self._target: ReplicatedState | None = None

    def connect(self, client: Redis, store: SnapshotStore, target: ReplicatedState) -> None:
        self._client = client
        self._store = store
        self._target = target

    # -- the ledger, for snapshots ----------------------------------------------------------

    def applied_seq(self, key: OriginKey) -> int:
        return self._seqs.get(key)

    def ledger_copy(self) -> SeqLedger:
        return self._seqs.copy()

    def forget_silent_origins(self) -> None:
        """Forget instances not heard from for a week (their ledger rows would stay forever)."""
        self._seqs.prune(self.me.wall_clock() - LEDGER_FORGET_NS)

    # -- the reader task --------------------------------------------------------------------

    async def run(self) -> None:
        attempt = 0
        while True:
            honour_cancellation()
            try:
                if not self.bootstrap.ready():
                    await self._bootstrap()
                elif self.bootstrap.position_check_due:
                    await self._check_stream_reset()
                await self._read_once(READ_BLOCK_MS)
                attempt = 0
            except asyncio.CancelledError:
                raise
            except BootstrapPending as e:  # settled() keeps waiting (up to START_WAIT_S)
                attempt = 0
                self.bootstrap.waiting_for_snapshot(e.why)
                await asyncio.sleep(BOOTSTRAP_RETRY_S)
            except IO_ERRORS as e:
                attempt += 1
                self.bootstrap.position_in_doubt()
                self._set_connected(False, e)
                await asyncio.sleep(backoff_delay(attempt))
            except Exception as e:  # a bug must not end replication; retry after a pause
                attempt += 1
                log.exception("replication reader failed; retrying")
                self.bootstrap.failed(e)
                await asyncio.sleep(backoff_delay(attempt))

    async def _read_once(self, block_ms: int | None) -> int:
        assert self._client is not None
        reply: Any = await self._client.xread(
            {self.me.keys.events: self.position}, count=READ_COUNT, block=block_ms
        )
        self._set_connected(True)
        entries = reply[0][1] if reply else []
        if entries:
            await self._ingest(entries)
        return len(entries)

    async def _bootstrap(self) -> None:
        assert self._store is not None and self._client is not None
        self.bootstrap.loading()
        if self.check_role:
            await ensure_primary(self._client)
        started = self.me.clock()
        # checked before loading: a snapshot written in between clears the marker
        why = (
            "Redis lost data and no snapshot was written since: the stream alone may lack "
            "records or hold them out of order"
        )
        if await self._store.reset_pending() and self.bootstrap.keep_waiting_for_snapshot(why):
            raise BootstrapPending(why)
        snapshot = await self._store.load_readable()
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
        self.bootstrap.loaded()
        log.info(
            "replication bootstrapped in %.0f ms from %s and %d stream entries; reading from %s",
            (self.me.clock() - started) / NS_PER_MS,
            f"snapshot {snapshot.stream_id}" if snapshot else "no snapshot",
            read,
            self.position,
        )

    def _restore(self, snapshot: Snapshot | None) -> None:
        """Replace local state by ``snapshot`` (empty without one); read on from its id.

        Own records queued or appended after the snapshot was taken are missing from the
        restored state: from here on they are applied when read back (``as_replayed``).
        """
        assert self._target is not None
        if snapshot is None:
            self._target.restore_state([], [])
            self._seqs = SeqLedger()
            self.position = START_ID
        else:
            with gc_paused(freeze=True):
                self._target.restore_state(snapshot.trackers, snapshot.early, snapshot.selection)
            self._seqs = snapshot.seqs.copy()
            self.position = snapshot.stream_id
            self.schedule.note(snapshot.stream_id, snapshot.at)
        self.bootstrap.restored(self.outbox.next_seq)
        self.counters.bootstraps += 1
        self._moved(self.position)

    def _moved(self, position: str) -> None:
        """The local state now includes the stream up to ``position``."""
        self.position = position
        if self.on_position is not None:
            self.on_position(position)

    async def _check_stream_reset(self) -> None:
        """After a reconnect: did the stream disappear, roll back behind our position, or lose
        our own last entry? The last catches a stream that a peer's re-sent records recreated
        meanwhile: its ids are newer than our position, but it holds nothing from before."""
        assert self._client is not None and self._store is not None
        if self.check_role:
            await ensure_primary(self._client)
        try:
            info = await self._client.xinfo_stream(self.me.keys.events)
            last = id_text(info["last-generated-id"])
        except ResponseError:  # no such key
            last = None
        own = self.outbox.last_appended
        own_lost = (
            bool(own)
            and last is not None
            and not await self._client.xrange(self.me.keys.events, own, own)
        )
        if self.position == START_ID:
            self.bootstrap.position_checked()
            return
        rolled_back = last is not None and parse_id(last) < parse_id(self.position)
        if last is not None and not rolled_back and not own_lost:
            self.bootstrap.position_checked()
            return
        await self._store.mark_reset()  # starting instances wait for a snapshot
        self.bootstrap.position_checked()
        restart_from = last if rolled_back and last is not None else START_ID
        self.counters.resets += 1
        self.schedule.request_now()
        log.warning(
            "the replica stream was %s (Redis restarted or failed over); reading on from %s "
            "instead of %s",
            "rolled back" if rolled_back else "recreated",
            restart_from,
            self.position,
        )
        self._moved(restart_from)

    async def _ingest(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        """Filter one XREAD reply and apply it as one batch."""
        seqs = self._seqs
        own_id, own_key, floor = (
            self.me.instance_id,
            self.me.own_key,
            self.bootstrap.local_floor,
        )
        now = self.me.wall_clock()
        batch: Batch = []
        position = self.position
        own_read = marked = 0  # own records read back in this reply, and told to the target
        for entry_id, fields in entries:
            eid = id_text(entry_id)
            try:
                record = decode_record(fields[RECORD_FIELD])
            except (KeyError, MalformedRecord) as e:
                self._malformed(eid, e, now)
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
                if own_read > marked:
                    batch.append(OwnReadBack(own_read))
                self._apply(batch, position, now)
                await self._on_gap(key, seq, missing)
                return  # the next read starts again from the (possibly new) position
            seqs.advance(key, seq, now)
            position = eid
            if record["origin"] == own_id:
                if key == own_key and seq >= floor:
                    self.counters.own_skipped += 1
                    own_read = seq
                    continue
                record = as_replayed(record)  # ours, but older than the local state
            if own_read > marked:  # the target learns which own records precede this one
                batch.append(OwnReadBack(own_read))
                marked = own_read
            batch.append(record)
        if own_read > marked:
            batch.append(OwnReadBack(own_read))
        self._apply(batch, position, now)

    def _malformed(self, eid: str, error: Exception, now: int) -> None:
        """Count a stream entry that is not a record; log it at most once a minute."""
        c = self.counters
        c.malformed += 1
        c.last_malformed_ns = now
        last = self._malformed_logged_ns
        if last is None or now - last >= MALFORMED_LOG_INTERVAL_NS:
            self._malformed_logged_ns = now
            log.warning("skipping stream entry %s (%d such so far): %s", eid, c.malformed, error)

    def _apply(self, batch: Batch, position: str, now: int) -> None:
        assert self._target is not None
        if batch:
            with gc_paused():  # a large catch-up batch allocates a lot; collect afterwards
                self._target.apply_remote(batch)
        self._moved(position)
        if not batch:
            return
        lag_ms = count_applied(batch, now, self.counters, self.lag.observe)
        if lag_ms is not None:
            self.last_lag_ms = lag_ms

    async def _on_gap(self, key: OriginKey, seq: int, missing: int) -> None:
        assert self._store is not None
        snapshot = await self._store.load_readable()
        if not self.bootstrap.waiting:  # not again for each retry while waiting
            self.counters.gaps += 1
        if snapshot is not None and snapshot.seqs.get(key) >= seq - 1:
            self.bootstrap.stop_waiting()
            self.schedule.request_now()  # peers starting now should not find the same hole
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
        if not self.bootstrap.ready():
            if self.bootstrap.keep_waiting_for_snapshot(why):
                raise BootstrapPending(why)
        elif await self._store.reset_pending() and self.bootstrap.keep_waiting_for_snapshot(why):
            await asyncio.sleep(BOOTSTRAP_RETRY_S)
            return  # the next read meets the gap again and looks for the snapshot again
        self.bootstrap.stop_waiting()
        log.error(
            "replication gap: %d record(s) of instance %d before seq %d are no longer in the "
            "stream and no snapshot covers them; going on without them",
            missing,
            key[0],
            seq,
        )
        self._seqs.advance(key, seq - 1, self.me.wall_clock())
        # our ledger now claims records our state lacks: no snapshot from us for a round, so
        # that an instance holding them (which saw the reset too) writes the next one
        self.bootstrap.went_on_without_records(
            self.me.settings.snapshot_interval_seconds * NS_PER_S
        )

    def _set_connected(self, ok: bool, error: BaseException | None = None) -> None:
        was = self.connected
        self.connected = ok
        if ok:
            if was is False:
                log.info("replication reader reconnected to Redis; resuming from %s", self.position)
            return
        ready = self.bootstrap.ready()
        self.bootstrap.unreachable(error)
        if was is not False:
            log.warning(
                "replication reader cannot reach Redis (%s); %s",
                error,
                _serving(ready, self.me.settings.replication_ack),
            )


def _serving(ready: bool, ack: str) -> str:
    """What the instance does while Redis is unreachable, as the routes will answer it."""
    if not ready:
        return (
            "the shared state is not loaded yet: /ready and every state route answer 503 "
            "'not ready' until it is; retrying"
        )
    if ack == "redis":
        return "reads are answered from local state, changes are refused with 503; retrying"
    return "reads and changes are served from local state and sent once it is back; retrying"
