"""Replica records: what this instance tells the others, and how their records are applied.

Out: every topology change and every lifecycle event of a local call becomes one record (a
``kv_slot_tracker.service.records`` struct: the key, the block size and the change), handed as
bytes with the producer's wall-clock time to the ``RecordSink``
(``kv_slot_tracker.replication``), which must never block and never reads it.

In: ``apply_remote`` applies other instances' records in order. Lifecycle events keep the
producer's time: a replicated request ages from its producer's add time and its prefill decays
from the producer's instant. Effects (loads, wake-ups) are flushed once per tracker for the
whole batch. Every record is decoded and checked in one call with the rules of the call that
would have produced it (``kv_slot_tracker.service.records``: the stream is input like an HTTP
body), in the stream format it came in. A record that fails,
or that the state here refuses (e.g. a topology that conflicts with the local one), is
*rejected*: counted by reason (``rejected``), logged at most once a minute per reason, and
skipped; the records behind it in the batch are still applied.

The same request id added on two instances at once: the first add in stream order wins on
every instance. An instance that holds a copy ignores a peer's add of the id, except when its
own add's record has not come back from the stream yet (the reader says which own records it
read back, in stream order, with ``OwnReadBack`` control messages in the batch): then the peer's add
came first, and the instance drops its own copy for the peer's. When its own record does come
back, it is applied like a peer's (usually ignored, the id being active). Counted in
``duplicate_adds``.

Early lifecycle calls (``kv_slot_tracker.service.early_calls``): a free or prefill completion of an id that was
still unknown after the read barrier is kept and sent as an ``early`` record; every instance
applies it to the add when that arrives (a tombstone cancels it, a pending mark completes its
prefill), or at once to a copy it already holds.

Selection state (``kv_slot_tracker.service.selection.replica``): the selection service publishes its
changes through ``emit_selection`` as ``SelectionRecord``, applied here in stream
order among the lifecycle records they belong with. A booking of a reservation id released
lately (``kv_slot_tracker.service.selection.tombstones``: a late duplicate of a booking already
used and freed) is dropped here, both its request's add and its selection record: rejected with
the reason ``released`` (counted, logged rate-limited), on every instance.

Snapshots: ``export_state`` / ``restore_state`` carry every tracker (``kv_slot_tracker.core.snapshot``),
instants as wall-clock time, the early calls, and the selection state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sized
from typing import TYPE_CHECKING, Any, Protocol

from kv_slot_tracker.core.errors import TrackerError
from kv_slot_tracker.core.events import (
    FREE,
    MARK_PREFILL_COMPLETED,
    ActiveSequenceEvent,
    AddRequest,
    Free,
    event_from_wire,
    event_to_wire,
)
from kv_slot_tracker.core.publisher import ReplicaEffects, SequencePublisher
from kv_slot_tracker.core.snapshot import wall_mapping
from kv_slot_tracker.core.types import NS_PER_S, WorkerDpRange, WorkerWithDpRank
from kv_slot_tracker.replication.port import Batch, OwnReadBack
from kv_slot_tracker.replication.records import Delivered
from kv_slot_tracker.service import early_calls, record_check, records
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.errors import ServiceError
from kv_slot_tracker.service.leases import renew_listed
from kv_slot_tracker.service.selection.wire import SelectionChange, WireBook, change_hashes
from kv_slot_tracker.service.topology_rules import check_range, check_reconcile, check_upsert

if TYPE_CHECKING:
    from kv_slot_tracker.core.tracker import ActiveSequencesMultiWorker as Tracker
    from kv_slot_tracker.service.registry import TrackerRegistry

log = logging.getLogger(__name__)

REJECTION_LOG_INTERVAL_NS = 60 * NS_PER_S  # at most one log line per reason in this time


class RecordSink(Protocol):
    """Where a service sends its replica records: a record's bytes (``records.encode``) and
    the producer's wall-clock time. ``publish`` must never block; it returns the record's
    sequence number among this process's records (0 or None: not queued)."""

    def publish(self, record: bytes, ts: int) -> int | None: ...


class SharedSelection(Protocol):
    """The selection service's side of replication (``SelectionService.replica``, a
    ``kv_slot_tracker.service.selection.replica.SelectionReplica``)."""

    publish: Callable[[SelectionChange], None] | None

    @property
    def tombstones(self) -> Sized:
        """The ids released lately: while none, ``released`` is False for every id."""
        ...

    def apply_peer(self, wire: SelectionChange, instant: int) -> bool: ...

    def released(self, selection_id: str, key: Key) -> bool: ...

    def export_selection(self, wall_offset: int) -> dict[str, Any]: ...

    def restore_selection(self, data: dict[str, Any] | None, wall_offset: int) -> None: ...


class _TrackerPublisher(SequencePublisher):
    """Forwards one tracker's lifecycle events as replica records."""

    __slots__ = ("replica", "key", "block_size")

    def __init__(self, replica: ReplicaRecords, key: Key, block_size: int) -> None:
        self.replica = replica
        self.key = key
        self.block_size = block_size

    def enqueue_event(self, event: ActiveSequenceEvent) -> None:
        self.replica.emit_lifecycle(self.key, self.block_size, event)


class ReplicaRecords:
    def __init__(
        self,
        instance_id: int,
        clock: Callable[[], int],
        wall_clock: Callable[[], int],
        replicator: RecordSink | None,
    ) -> None:
        self.instance_id = instance_id
        self.clock = clock
        self.wall_clock = wall_clock
        self.replicator = replicator
        self.applied = 0
        self.rejected: dict[str, int] = dict.fromkeys(
            record_check.REASONS, 0
        )  # peers' records, by reason
        self.last_rejected_ns: int | None = None  # wall time of the newest rejection
        self._logged_at: dict[str, int] = {}  # reason -> wall time of its last log line
        self._unlogged: dict[str, int] = {}  # reason -> rejections since its last log line
        self.max_hashes = 1_048_576  # prompt blocks per record (the service sets its limit)
        self._registry: TrackerRegistry | None = None
        self.early: early_calls.EarlyCalls | None = None  # replicated mode (``use_early_calls``)
        self.duplicate_adds = 0  # adds of an id already active here, resolved by stream order
        # own add records not read back from the stream yet, by id, oldest first: (seq, ts, record)
        self._own_adds: dict[early_calls.EarlyKey, tuple[int, int, records.EventRecord]] = {}
        # own add records whose copy a peer's earlier add replaced: applied when read back
        self._superseded: list[tuple[int, int, records.EventRecord]] = []
        self.on_applied: Callable[[], None] | None = None  # after each batch of peers' records
        self.selection: SharedSelection | None = None

    def use_early_calls(self, capacity: int, ttl_ns: int, max_bytes: int) -> early_calls.EarlyCalls:
        self.early = early_calls.EarlyCalls(capacity, ttl_ns, max_bytes)
        return self.early

    def bind(self, registry: TrackerRegistry) -> None:
        self._registry = registry

    @property
    def registry(self) -> TrackerRegistry:
        assert self._registry is not None, "bind() the registry first"
        return self._registry

    def bind_selection(self, selection: SharedSelection) -> None:
        """Share ``selection``'s state: publish its changes, apply peers' and snapshot it."""
        self.selection = selection
        if self.replicator is not None:
            selection.publish = self.emit_selection

    def publisher_for(self, key: Key, block_size: int) -> SequencePublisher:
        """The publisher of the tracker of ``key``, whose blocks are of ``block_size``."""
        return _TrackerPublisher(self, key, block_size)

    # -- out -------------------------------------------------------------------------------

    def emit_lifecycle(self, key: Key, block_size: int, event: ActiveSequenceEvent) -> None:
        if self.replicator is None:
            return
        record = records.EventRecord(key[0], key[1], block_size, event_to_wire(event))
        ts = self.wall_clock()
        seq = self.replicator.publish(records.encode(record), ts)
        if seq and type(event.data) is AddRequest:
            own = (key[0], key[1], event.request_id)
            self._own_adds.pop(own, None)  # re-inserted: the dict stays in seq order
            self._own_adds[own] = (seq, ts, record)

    def _emit_topology(self, key: Key, block_size: int, op: records.Topology) -> None:
        if self.replicator is None:
            return
        record = records.TopologyRecord(key[0], key[1], block_size, op)
        self.replicator.publish(records.encode(record), self.wall_clock())

    def emit_selection(self, change: SelectionChange) -> None:
        assert self.replicator is not None
        self.replicator.publish(records.encode(records.SelectionRecord(change)), self.wall_clock())

    def remember_early(self, key: Key, op: str, request_id: str) -> None:
        """A free (tombstone) or prefill completion (pending mark) of an id still unknown here
        after the read barrier: keep it and tell every instance (``kv_slot_tracker.service.early_calls``)."""
        early = self.early
        if early is None:
            return
        t = self.registry.find(key)
        ts = self.wall_clock()
        early.put((key[0], key[1], request_id), op, ts, ts)
        if op == early_calls.FREE:
            early.counters.tombstones_created += 1
        else:
            early.counters.marks_created += 1
        if self.replicator is not None:
            record = records.EarlyRecord(key[0], key[1], t.block_size if t is not None else 0,
                                   records.EarlyCall(op, request_id))  # type: ignore[arg-type]  # fmt: skip
            self.replicator.publish(records.encode(record), ts)

    def emit_upsert(self, key: Key, block_size: int, w: WorkerDpRange) -> None:
        self._emit_topology(key, block_size, records.Upsert(w.worker_id, w.dp_start, w.dp_size))

    def emit_renew(self, key: Key, block_size: int, worker_id: int) -> None:
        self._emit_topology(key, block_size, records.Renew(worker_id))

    def emit_unregister(self, key: Key, block_size: int, worker_id: int) -> None:
        self._emit_topology(key, block_size, records.Unregister(worker_id))

    def emit_reconcile(
        self, key: Key, block_size: int, workers: Iterable[tuple[int, int, int]]
    ) -> None:
        self._emit_topology(key, block_size, records.Reconcile([(a, b, c) for a, b, c in workers]))

    # -- in --------------------------------------------------------------------------------

    def producer_instant(self, wall_ts: int) -> int:
        """The local monotonic instant matching a producer's wall-clock time (skew clamped)."""
        age = self.wall_clock() - wall_ts
        return self.clock() - (age if age > 0 else 0)

    def apply_remote(self, records: Batch) -> int:
        """Apply other instances' records in order; returns how many changed state."""
        applied = 0
        effects: dict[Key, ReplicaEffects] = {}
        for rec in records:
            if isinstance(rec, OwnReadBack):
                self._read_back(rec.seq, effects)
                continue
            try:
                changed = self._apply_one(rec, effects)
            except Exception as err:  # noqa: BLE001 - no record may stop the ones behind it
                self.reject(_reason(err), err)
                continue
            if changed:
                applied += 1
                self.applied += 1
        trackers = self.registry.trackers
        for key, eff in effects.items():
            t = trackers.get(key)
            if t is not None:
                t.flush_replica_effects(eff)
        if self.on_applied is not None:
            self.on_applied()
        return applied

    def _apply_one(self, d: Delivered, effects: dict[Key, ReplicaEffects]) -> bool:
        if d.origin == self.instance_id and not d.replayed:
            return False
        return self._apply_record(records.decode(d.record, d.format), d.ts, d.replayed, effects)

    def _apply_record(
        self, rec: records.Record, ts: int, replayed: bool, effects: dict[Key, ReplicaEffects]
    ) -> bool:
        """A record decoded and checked (``records.decode``), of the producer's time ``ts``;
        ``replayed``: one of this instance's own, applied like a peer's."""
        if type(rec) is not records.EventRecord:
            if isinstance(rec, records.SelectionRecord):
                return self._apply_selection(rec.selection, ts)
            key = (rec.model_name, rec.routing_group)
            if type(rec) is records.TopologyRecord:
                return self._apply_topology(key, rec.block_size, rec.topology, ts)
            assert type(rec) is records.EarlyRecord
            return self._apply_early(key, rec.early, ts, effects)
        key, block_size = (rec.model_name, rec.routing_group), rec.block_size
        event = self._event(rec, replayed)
        t = self.registry.find(key)
        if t is None or t.block_size != block_size:
            log.debug(
                "ignoring replica event for %s: no tracker with block size %s", key, block_size
            )
            return False
        instant = self.producer_instant(ts)
        eff = effects.get(key)
        if eff is None:
            eff = effects[key] = ReplicaEffects()
        data = event.data
        early = None
        if type(data) is AddRequest:
            rid = event.request_id
            selection = self.selection
            if selection is not None and selection.released(rid, key):
                raise record_check.RejectedRecord(
                    record_check.RELEASED,
                    f"add of request {rid!r:.80}: its reservation was released",
                )
            if self.early is not None and len(self.early):
                early = self.early.get((key[0], key[1], rid), self.wall_clock())
                if early is not None and early.op == early_calls.FREE and ts <= early.ts:
                    self.early.counters.tombstones_applied += 1  # freed before it arrived
                    return False
            if t.has_request(rid) and not self._replace_own_copy(key, t, rid, eff):
                self.duplicate_adds += 1  # the copy here came first in the stream: keep it
                return False
        elif self.early is not None and not t.has_request(event.request_id):
            # a peer freed (or completed the prefill of) a request not active here: its add
            # may still come, behind it, in a stream re-built after Redis lost its data (each
            # publisher re-sends its recent records when it next appends, in no causal order
            # across instances): kept as a tombstone or a pending mark, as an early call is,
            # so that the add, if it comes, is cancelled (or completed) as everywhere else
            op = early_calls.FREE if type(data) is Free else early_calls.PREFILL_COMPLETE
            self.early.put((key[0], key[1], event.request_id), op, ts, self.wall_clock())
            self.early.counters.out_of_order += 1
            return False
        changed = t.apply_replica_event(event, eff, instant, instant)
        if changed and early is not None and ts <= early.ts:  # a pending mark
            self._complete_prefill(t, event.request_id, early.ts, eff)
            self.early.discard((key[0], key[1], event.request_id))  # type: ignore[union-attr]
        return changed

    def _event(self, rec: records.EventRecord, replayed: bool) -> ActiveSequenceEvent:
        """A record's event in the tracker's form, its prompt within the length ``/add`` allows
        (its fields' types, ranges and lengths were checked decoding it); a replayed one without
        its router id (the core skips events carrying its own)."""
        event = event_from_wire(rec.event, 0 if replayed else None)
        data = event.data
        if type(data) is AddRequest:
            seq = data.token_sequence
            if seq is not None and len(seq) > self.max_hashes:
                raise record_check.RejectedRecord(
                    record_check.EVENT,
                    f"{len(seq)} prompt blocks exceed the maximum {self.max_hashes}",
                )
        return event

    def _apply_selection(self, change: SelectionChange, ts: int) -> bool:
        if self.selection is None:
            return False
        n = change_hashes(change)
        if n > self.max_hashes:
            raise record_check.RejectedRecord(
                record_check.SELECTION, f"{n} block hashes exceed the maximum {self.max_hashes}"
            )
        if type(change) is WireBook and self.selection.released(change.id, (change.m, change.g)):
            raise record_check.RejectedRecord(
                record_check.RELEASED, f"booking of reservation {change.id!r:.80}: it was released"
            )
        try:
            return self.selection.apply_peer(change, self.producer_instant(ts))
        except ValueError as err:  # a change inconsistent in itself (e.g. its hash lists)
            raise record_check.RejectedRecord(record_check.SELECTION, str(err)) from None

    # -- the same id added on two instances -------------------------------------------------

    def _replace_own_copy(self, key: Key, t: Tracker, rid: str, eff: ReplicaEffects) -> bool:
        """A peer's add of an id active here: True (and our copy is gone) when our copy is our
        own add whose record has not come back yet, i.e. the peer's add is first in the
        stream."""
        own = self._own_adds.pop((key[0], key[1], rid), None)
        if own is None:
            return False
        self._superseded.append(own)  # counted when it comes back (and is ignored)
        event = ActiveSequenceEvent(rid, _ANY_RANK, FREE, 0)
        t.apply_replica_event(event, eff, decay_now=self.clock())
        log.info("request %s was added here and on a peer first; the peer's add wins", rid)
        return True

    def _read_back(self, seq: int, effects: dict[Key, ReplicaEffects]) -> None:
        """Own records up to ``seq`` came back from the stream (at this point of the batch)."""
        own = self._own_adds
        while own:
            first = next(iter(own))
            if own[first][0] > seq:
                break
            del own[first]
        superseded = self._superseded
        while superseded and superseded[0][0] <= seq:
            _, ts, record = superseded.pop(0)
            try:  # applied as a peer's record would be, in its place in the stream
                if self._apply_record(record, ts, True, effects):
                    self.applied += 1
            except Exception as err:  # noqa: BLE001 - as in apply_remote
                self.reject(_reason(err), err)

    # -- early lifecycle calls ---------------------------------------------------------------

    def _apply_early(
        self, key: Key, op: records.EarlyCall, ts: int, effects: dict[Key, ReplicaEffects]
    ) -> bool:
        """A peer's tombstone or pending mark: applied at once to a copy of the request that
        started before it, else kept for the add (a tombstone is kept in any case, for a
        duplicate add still on its way)."""
        kind, rid = op.op, op.request_id
        early = self.early
        if early is None:
            return False
        t = self.registry.find(key)
        started = t.started_at(rid) if t is not None else None
        applied = False
        if t is not None and started is not None and started <= self.producer_instant(ts):
            eff = effects.get(key)
            if eff is None:
                eff = effects[key] = ReplicaEffects()
            if kind == early_calls.FREE:
                self._free_copy(t, rid, ts, eff)
                early.counters.tombstones_applied += 1
            else:
                self._complete_prefill(t, rid, ts, eff)
            applied = True
        if kind == early_calls.FREE or not applied:
            early.put((key[0], key[1], rid), kind, ts, self.wall_clock())
        return applied

    def _free_copy(self, t: Tracker, rid: str, ts: int, eff: ReplicaEffects) -> None:
        """Free this instance's copy of a request as a peer's free would (nothing is sent)."""
        event = ActiveSequenceEvent(rid, _ANY_RANK, FREE, 0)
        t.apply_replica_event(event, eff, decay_now=self.producer_instant(ts))

    def _complete_prefill(self, t: Tracker, rid: str, ts: int, eff: ReplicaEffects) -> None:
        """Apply a pending mark: the request's prefill completed at the mark's time."""
        event = ActiveSequenceEvent(rid, _ANY_RANK, MARK_PREFILL_COMPLETED, 0)
        if t.apply_replica_event(event, eff, decay_now=self.producer_instant(ts)):
            self.early.counters.marks_applied += 1  # type: ignore[union-attr]

    def _apply_topology(self, key: Key, block_size: int, op: records.Topology, ts: int) -> bool:
        """A peer's topology change, after the checks its HTTP call passed on the peer; leases
        are renewed from the producer's instant, as the call renewed them there."""
        kind, arg = _topology_args(op)
        try:
            if kind == "upsert":
                check_range(block_size, arg[1], arg[2])
            elif kind == "reconcile":
                check_reconcile(key, block_size, arg)
        except (ServiceError, TrackerError) as err:
            raise record_check.RejectedRecord(record_check.TOPOLOGY, str(err)) from None
        registry = self.registry
        t = registry.find(key)
        if t is not None and t.block_size != block_size:
            raise record_check.RejectedRecord(
                record_check.CONFLICT,
                f"replica topology for {key} has block size {block_size}, local {t.block_size}",
            )
        if kind == "upsert":
            check_upsert(key, t, arg[0], arg[2])  # the tracker's rank cap: a conflict here
            r = WorkerDpRange(*arg)
            if t is None:
                t = registry.create(key, block_size)
            try:
                t.upsert_worker(r)
            finally:
                registry.drop_if_empty(key)  # a refused first range leaves no empty tracker
            registry.leases.renew(key, r.worker_id, self.producer_instant(ts))
            return True
        if kind == "renew":
            if t is None or not t.has_worker(arg):
                return False
            registry.leases.renew(key, arg, self.producer_instant(ts))
            return True
        if kind == "unregister":
            if t is None or not t.has_worker(arg):
                return False
            t.unregister_worker(arg)
            registry.leases.forget(key, arg)
            registry.drop_if_empty(key)
            return True
        if kind == "reconcile":
            ranges = [WorkerDpRange(*w) for w in arg]
            if t is None:
                if not ranges:
                    return False
                t = registry.create(key, block_size)
            try:
                change = t.reconcile_workers(ranges)
            finally:
                registry.drop_if_empty(key)
            renew_listed(registry.leases, key, arg, change.removed, self.producer_instant(ts))
            return True
        raise AssertionError(kind)  # _topology_args knows no other kind

    # -- rejected records ---------------------------------------------------------------------

    @property
    def dropped(self) -> int:
        """Peers' records rejected, all reasons together."""
        return sum(self.rejected.values())

    def reject(self, reason: str, err: BaseException) -> None:
        """Count a peer's record that is skipped; log it unless the reason was logged lately
        (then the next line says how many went unlogged)."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        now = self.last_rejected_ns = self.wall_clock()
        last = self._logged_at.get(reason)
        if last is not None and now - last < REJECTION_LOG_INTERVAL_NS:
            self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
            return
        self._logged_at[reason] = now
        more = self._unlogged.pop(reason, 0)
        log.warning(
            "rejected a replica record (%s): %s%s",
            reason,
            str(err)[:300] or type(err).__name__,
            f" ({more} more since the last line for this reason)" if more else "",
        )

    # -- snapshots -------------------------------------------------------------------------

    def export_early(self) -> list[list[Any]]:
        """The early calls kept here, for a snapshot."""
        return self.early.export() if self.early is not None else []

    def export_state(self) -> list[dict[str, Any]]:
        """Every tracker's replicated state (``kv_slot_tracker.core.snapshot``), instants as wall time."""
        to_wall, _ = wall_mapping(self.clock(), self.wall_clock())
        return [
            {"model_name": key[0], "routing_group": key[1], "tracker": t.export(to_wall)}
            for key, t in sorted(self.registry.trackers.items())
        ]

    def export_selection(self) -> dict[str, Any] | None:
        """The selection state, for a snapshot (``None`` when no selection service shares)."""
        selection = self.selection
        if selection is None:
            return None
        return selection.export_selection(self.wall_clock() - self.clock())

    def restore_state(
        self,
        trackers: list[dict[str, Any]],
        early: list[list[Any]] | None = None,
        selection: dict[str, Any] | None = None,
    ) -> None:
        """Replace every tracker by those of an ``export_state``, the early calls by ``early``
        (an ``export_early``; None: none) and the selection state by ``selection`` (an
        ``export_selection``; None: empty) (counters are kept).

        All or nothing: on malformed data the previous trackers stay in place. Data that fails
        the record rules (``record_check.check_snapshot``) is rejected before anything changes:
        counted (reason ``snapshot``), logged, and re-raised for the caller to fall back.
        """
        try:
            record_check.check_snapshot(trackers, early, self.max_hashes)
        except record_check.RejectedRecord as err:
            self.reject(record_check.SNAPSHOT, err)
            raise
        _, from_wall = wall_mapping(self.clock(), self.wall_clock())
        registry = self.registry
        previous = registry.trackers
        registry.replace_all({})
        try:
            for entry in trackers:
                key = (entry["model_name"], entry["routing_group"])
                if type(key[0]) is not str or type(key[1]) is not str:
                    raise ValueError(f"snapshot tracker key {key!r:.120} is not two strings")
                data = entry["tracker"]
                registry.create(key, data["block_size"], capped=False).restore(data, from_wall)
            if self.early is not None:
                self.early.restore(early or [], self.wall_clock())
            if self.selection is not None:
                self.selection.restore_selection(selection, self.wall_clock() - self.clock())
        except Exception as err:
            registry.replace_all(previous)
            if isinstance(err, (KeyError, TypeError, ValueError)):
                self.reject(record_check.SNAPSHOT, err)  # the checks above do not reach every value
            raise
        registry.prune_counters()
        # own records not in the snapshot are applied like peers' when read back
        self._own_adds.clear()
        self._superseded.clear()


def _topology_args(op: records.Topology) -> tuple[str, Any]:
    """A topology change's kind and, typed, what the service's topology methods take:
    ``(worker_id, dp_start, dp_size)`` for an upsert, ``worker_id`` for an unregister or a
    lease renewal and a list of those triples for a reconcile."""
    if type(op) is records.Upsert:
        return "upsert", (op.worker_id, op.dp_start, op.dp_size)
    if type(op) is records.Reconcile:
        return "reconcile", op.workers
    if type(op) is records.Renew:
        return "renew", op.worker_id
    assert type(op) is records.Unregister
    return "unregister", op.worker_id


def _reason(err: BaseException) -> str:
    """The rejection reason of ``err`` raised while applying a record."""
    if isinstance(err, record_check.RejectedRecord):
        return err.reason
    if isinstance(err, (TrackerError, ServiceError)):
        return record_check.CONFLICT
    if not isinstance(err, (KeyError, TypeError, ValueError)):
        log.error("applying a replica record failed unexpectedly", exc_info=err)
    return record_check.ENVELOPE


_ANY_RANK = WorkerWithDpRank(0, 0)  # replica frees and marks find the rank by request id
