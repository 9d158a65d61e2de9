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
comes back short). After a connection error it resumes from its last id, but first checks that
the stream is still the one that id came from: the entry at its position must still be there,
with the content it read. A primary switch (a promoted replica that lagged, while the demoted
primary took writes a moment longer) or a Redis that restarted empty fails that check even when
peers have re-sent records meanwhile, whose new ids may lie on either side of the position.
Then it re-reads from the newest of its *checkpoints* (``checkpoints``: ids of entries it read,
with a digest of their content) that the stream still holds unchanged, everything up to which it
has read, or from the start without one; the ledger
drops what it applied already. Until that re-read reaches the stream's end the instance is not
ready (state routes answer 503, as while bootstrapping) and the read barrier confirms nothing
before the position is checked. It also sets the reset marker and asks for a snapshot at once.
A position that the stream's own bound trimmed away (the stream removed entries from its head
and keeps none at or before it) is no such case: reading on from it continues at the first
entry kept.
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
    decode_entry,
)
from kv_slot_tracker.replication.redis.bootstrap import (
    BOOTSTRAP_RETRY_S,
    Bootstrap,
    BootstrapPending,
)
from kv_slot_tracker.replication.redis.checkpoints import Checkpoints, digest, trimmed_past
from kv_slot_tracker.replication.redis.connection import (
    IO_ERRORS,
    READ_BLOCK_MS,
    ensure_primary,
    retrying,
)
from kv_slot_tracker.replication.redis.instance import Instance
from kv_slot_tracker.replication.redis.outbox import Outbox
from kv_slot_tracker.replication.redis.schedule import SnapshotSchedule
from kv_slot_tracker.replication.redis.snapshots import Snapshot, SnapshotStore, gc_paused
from kv_slot_tracker.replication.redis.stream import START_ID, id_text, is_stream_id, parse_id

log = logging.getLogger(__name__)

READ_COUNT = 1_000
LEDGER_FORGET_NS = 7 * 24 * 3600 * NS_PER_S
MALFORMED_LOG_INTERVAL_NS = 60 * NS_PER_S
FUTURE_MS = 24 * 3600 * 1000  # a position further ahead of the wall clock lies in the future
# a sequence jump past ``replication_max_seq_jump`` (or an unknown origin met past its first
# record) has the snapshot looked at at most this often
SNAPSHOT_CONSULT_INTERVAL_NS = 10 * NS_PER_S


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
        # ... told whether the position is checked against the server we read from now
        self.on_checked: Callable[[bool], None] | None = None
        # told when the instance stops being ready to re-read a switched stream
        self.on_catching_up: Callable[[], None] | None = None
        # re-reading after the stream turned out not to be the one the position came from
        self.catching_up = False
        self._catch_up_started = 0
        self._stopped_at_gap = False
        self.checkpoints = Checkpoints()  # entries read, to check the position against
        self.connected: bool | None = None  # None until the first read was tried
        self.last_lag_ms: float | None = None
        self._seqs = SeqLedger()
        self._malformed_logged_ns: int | None = None
        self._anomaly_logged_ns: dict[str, int] = {}
        self._consulted_ns: int | None = None  # when a seq jump last had the snapshot looked at
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
        while True:  # a turn that succeeds starts the next one's backoff afresh
            await retrying(self._turn, self._turn_failed, Exception)

    async def _turn(self) -> None:
        try:
            if not self.bootstrap.ready():
                await self._bootstrap()
            elif self.bootstrap.position_check_due:
                await self._check_position()
            n = await self._read_once(None if self.catching_up else READ_BLOCK_MS)
            if not n and parse_id(self.position)[0] > self.me.wall_clock() // 1_000_000 + FUTURE_MS:
                await self._check_future_position()
            if self.catching_up and n < READ_COUNT and not self._stopped_at_gap:
                self._caught_up()
        except BootstrapPending as e:  # settled() keeps waiting (up to START_WAIT_S)
            self.bootstrap.waiting_for_snapshot(e.why)
            await asyncio.sleep(BOOTSTRAP_RETRY_S)

    def _turn_failed(self, e: Exception) -> None:
        if isinstance(e, IO_ERRORS):
            self.bootstrap.position_in_doubt()
            if self.on_checked is not None:
                self.on_checked(False)
            self._set_connected(False, e)
        else:  # a bug must not end replication; retry after a pause
            log.exception("replication reader failed; retrying")
            self.bootstrap.failed(e)

    async def _read_once(self, block_ms: int | None) -> int:
        assert self._client is not None
        self._stopped_at_gap = False
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
        self.bootstrap.loaded()
        log.info(
            "replication bootstrapped in %.0f ms from %s and %d stream entries; reading from %s",
            (self.me.clock() - started) / NS_PER_MS,
            f"snapshot {snapshot.stream_id}" if snapshot else "no snapshot",
            read,
            self.position,
        )

    async def _load_snapshot(self) -> Snapshot | None:
        """The stored snapshot if it can be used: None when there is none, it does not decode,
        or its stream id is not one (``<ms>-<seq>``, each below 2**64) or lies beyond the
        stream's last generated id (reading on from there would never see a new entry). Such a
        snapshot is ignored: counted (anomaly ``snapshot_invalid``), logged (rate-limited); the
        instance reads the stream or waits for a usable snapshot."""
        assert self._store is not None and self._client is not None
        snapshot = await self._store.load_readable()
        if snapshot is None:
            return None
        why = None
        sid = snapshot.stream_id
        if not isinstance(sid, str) or not is_stream_id(sid):
            why = f"its stream id {sid!r} is not a stream id"
        else:
            try:
                info: Any = await self._client.xinfo_stream(self.me.keys.events)
            except ResponseError:  # no stream: nothing generated yet
                info = None
            last = START_ID if info is None else id_text(info.get("last-generated-id", START_ID))
            if parse_id(sid) > parse_id(last):
                why = f"its stream id {sid} lies beyond the stream's last generated id {last}"
        if why is None:
            return snapshot
        now = self.me.wall_clock()
        total = self.counters.anomaly("snapshot_invalid", now)
        last_log = self._anomaly_logged_ns.get("snapshot_invalid")
        if last_log is None or now - last_log >= MALFORMED_LOG_INTERVAL_NS:
            self._anomaly_logged_ns["snapshot_invalid"] = now
            log.error(
                "replication anomaly snapshot_invalid: ignoring the stored snapshot (written by "
                "instance %s): %s; reading the stream instead (%d such so far)",
                snapshot.origin,
                why,
                total,
            )
        return None

    def _restore(self, snapshot: Snapshot | None) -> None:
        """Replace local state by ``snapshot`` (empty without one); read on from its id.

        Own records queued or appended after the snapshot was taken are missing from the
        restored state: from here on they are applied when read back (``as_replayed``).
        """
        assert self._target is not None
        self.checkpoints.clear()
        if snapshot is None:
            self._target.restore_state([], [])
            self._seqs = SeqLedger()
            self.position = START_ID
        else:
            with gc_paused(freeze=True):
                self._target.restore_state(snapshot.trackers, snapshot.early, snapshot.selection)
            self._seqs = snapshot.seqs.copy()
            if len(self._seqs.highest) > self.me.settings.replication_max_origins:
                self._bound_ledger(self.me.wall_clock())
            self.position = snapshot.stream_id
            self.checkpoints.note(snapshot.stream_id, None)
            self.schedule.note(snapshot.stream_id, snapshot.at)
        self.bootstrap.restored(self.outbox.next_seq)
        self.counters.bootstraps += 1
        self._moved(self.position)

    def _moved(self, position: str) -> None:
        """The local state now includes the stream up to ``position``."""
        self.position = position
        if self.on_position is not None:
            self.on_position(position)

    # -- is the stream still the one our position came from? --------------------------------

    async def _check_position(self) -> None:
        """After a reconnect: is the stream still the one our position came from (module
        docstring)? If not, re-read from the newest checkpoint it still holds unchanged."""
        assert self._client is not None and self._store is not None
        if self.check_role:
            await ensure_primary(self._client)
        position = self.position
        events = self.me.keys.events
        if position == START_ID or await self.checkpoints.holds(
            self._client, events, self.checkpoints.newest(position)
        ):
            self._checked()
            return
        try:
            info: Any = await self._client.xinfo_stream(self.me.keys.events)
        except ResponseError:  # no such key: Redis lost the stream
            info = None
        if info is not None and trimmed_past(info, position):
            # our own bound trimmed it (we lagged behind the trim): nothing was lost, reading
            # on starts at the first entry kept; the sequence numbers show any gap
            self._checked()
            return
        restart = (
            START_ID
            if info is None
            else await self.checkpoints.common_point(self._client, events, position)
        )
        await self._store.mark_reset()  # starting instances wait for a snapshot
        self.counters.resets += 1
        self.schedule.request_now()
        log.warning(
            "the replica stream is %s (Redis restarted or failed over): position %s is not in "
            "it; re-reading from %s, and not ready until caught up",
            "gone" if info is None else "not the one read so far",
            position,
            restart,
        )
        self.checkpoints.drop_after(restart)
        self.catching_up = True
        self._catch_up_started = self.me.clock()
        if self.on_catching_up is not None:
            self.on_catching_up()
        self._moved(restart)
        self._checked()

    async def _check_future_position(self) -> None:
        """Our position lies in the future (an entry with an id far ahead was added, up to the
        largest possible one): once the stream was deleted and re-created, or never held it,
        new entries get ids below it and an XREAD from it would never see them. Then check the
        position as after a reconnect (re-read from what the stream still holds)."""
        assert self._client is not None
        try:
            info: Any = await self._client.xinfo_stream(self.me.keys.events)
        except ResponseError:  # no stream: it was deleted
            info = None
        last = START_ID if info is None else id_text(info.get("last-generated-id", START_ID))
        if parse_id(last) < parse_id(self.position):
            self.bootstrap.position_in_doubt()

    def _checked(self) -> None:
        self.bootstrap.position_checked()
        if self.on_checked is not None:
            self.on_checked(True)

    def _caught_up(self) -> None:
        self.catching_up = False
        log.info(
            "replication caught up with the stream again in %.0f ms; at %s",
            (self.me.clock() - self._catch_up_started) / NS_PER_MS,
            self.position,
        )

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
        at: dict[bytes, bytes] | None = None  # the fields of the entry at ``position``
        own_read = marked = 0  # own records read back in this reply, and told to the target
        for entry_id, fields in entries:
            eid = id_text(entry_id)
            try:
                record = decode_entry(fields[RECORD_FIELD])
            except (KeyError, MalformedRecord) as e:
                self._malformed(eid, e, now)
                position, at = eid, fields
                continue
            key = (record.origin, record.incarnation)
            seq = record.seq
            missing = seqs.missing_before(key, seq)
            if missing < 0:
                self.counters.duplicates += 1
                position, at = eid, fields
                continue
            jump = missing > self.me.settings.replication_max_seq_jump
            # a ready instance meets an origin first at its seq 1; later only when it lagged
            # behind the stream's trim (a gap a snapshot fills) or when the record is forged
            new_gap = missing > 0 and key not in seqs.highest and self.bootstrap.ready()
            if jump or new_gap:
                last = self._consulted_ns
                if last is None or now - last >= SNAPSHOT_CONSULT_INTERVAL_NS:
                    # a snapshot may cover it (records lost in bulk): look once, read again
                    self._consulted_ns = now
                    if own_read > marked:
                        batch.append(OwnReadBack(own_read))
                    self._apply(batch, position, now, at)
                    self._stopped_at_gap = True
                    await self._consult_snapshot(key, seq, missing)
                    return
                self._anomaly("seq_jump" if jump else "new_origin_gap", eid, key, seq, now)
                if jump:  # not applied, the ledger not moved: the origin's real records go on
                    position, at = eid, fields
                    continue
            elif missing > 0:
                if own_read > marked:
                    batch.append(OwnReadBack(own_read))
                self._apply(batch, position, now, at)
                self._stopped_at_gap = True
                await self._on_gap(key, seq, missing)
                return  # the next read starts again from the (possibly new) position
            seqs.advance(key, seq, now)
            position, at = eid, fields
            if record.origin == own_id:
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
        self._apply(batch, position, now, at)
        if len(seqs.highest) > self.me.settings.replication_max_origins:
            self._bound_ledger(now)

    def _malformed(self, eid: str, error: Exception, now: int) -> None:
        """Count a stream entry that is not a record; log it at most once a minute."""
        c = self.counters
        c.malformed += 1
        c.last_malformed_ns = now
        last = self._malformed_logged_ns
        if last is None or now - last >= MALFORMED_LOG_INTERVAL_NS:
            self._malformed_logged_ns = now
            log.warning("skipping stream entry %s (%d such so far): %s", eid, c.malformed, error)

    def _anomaly(self, reason: str, eid: str, key: OriginKey, seq: int, now: int) -> None:
        """Count an anomalous record (``metrics.ANOMALIES``); log it at most once a minute per
        reason."""
        total = self.counters.anomaly(reason, now)
        last = self._anomaly_logged_ns.get(reason)
        if last is None or now - last >= MALFORMED_LOG_INTERVAL_NS:
            self._anomaly_logged_ns[reason] = now
            log.warning(
                "replication anomaly %s: stream entry %s of instance %d incarnation %d with seq "
                "%d (last applied %d); %s (%d such so far)",
                reason,
                eid,
                key[0],
                key[1],
                seq,
                self._seqs.get(key),
                "forged or corrupt: not applied, the ledger not moved"
                if reason == "seq_jump"
                else "an origin not heard of before whose earlier records no snapshot covers: "
                "applied from here",
                total,
            )

    def _bound_ledger(self, now: int) -> None:
        """Keep at most ``replication_max_origins`` ledger rows: forget the longest-silent."""
        evicted = self._seqs.evict_silent(
            self.me.settings.replication_max_origins, keep=self.me.own_key
        )
        if not evicted:
            return
        total = self.counters.anomaly("origins_evicted", now, evicted)
        last = self._anomaly_logged_ns.get("origins_evicted")
        if last is None or now - last >= MALFORMED_LOG_INTERVAL_NS:
            self._anomaly_logged_ns["origins_evicted"] = now
            log.warning(
                "replication anomaly origins_evicted: the ledger holds more than %d origins; "
                "forgot the %d longest silent (%d so far)",
                self.me.settings.replication_max_origins,
                evicted,
                total,
            )

    async def _consult_snapshot(self, key: OriginKey, seq: int, missing: int) -> None:
        """A sequence jump past the window, or an unknown origin met past its first record:
        load the newest snapshot if it covers the records in between (they were lost, not
        forged); otherwise the next read counts the anomaly (``_anomaly``)."""
        assert self._store is not None
        snapshot = await self._load_snapshot()
        if snapshot is not None and snapshot.seqs.get(key) >= seq - 1:
            self.counters.gaps += 1
            log.warning(
                "replication gap: %d record(s) of instance %d before seq %d are no longer in "
                "the stream; bootstrapping again from snapshot %s",
                missing,
                key[0],
                seq,
                snapshot.stream_id,
            )
            self._restore(snapshot)

    def _apply(
        self, batch: Batch, position: str, now: int, at: dict[bytes, bytes] | None = None
    ) -> None:
        """Apply ``batch``; the state then includes the stream up to ``position`` (``at``: the
        fields of the entry there, when this reply read it)."""
        assert self._target is not None
        if batch:
            with gc_paused():  # a large catch-up batch allocates a lot; collect afterwards
                self._target.apply_remote(batch)
        if at is not None:
            self.checkpoints.note(position, digest(at))
        self._moved(position)
        if not batch:
            return
        lag_ms = count_applied(batch, now, self.counters, self.lag.observe)
        if lag_ms is not None:
            self.last_lag_ms = lag_ms

    async def _on_gap(self, key: OriginKey, seq: int, missing: int) -> None:
        assert self._store is not None
        snapshot = await self._load_snapshot()
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
