"""The worker catalog's changes, and where its schedulable workers sit.

``WorkerPlacement`` is one of ``SelectionService``'s collaborators (as ``Bookings``,
``Reservations``, ``SelectionReplica``, ``KvEvents`` and ``ReceiptKeeper`` are): it checks a
worker put into the catalog (the budgets, its own fields, the partition's block size, room for a
new partition and for its ranks), records why a worker cannot be placed (``incomplete``), and
registers a schedulable worker's ranks in its partition's tracker, or takes them off with their
requests and cached blocks. It works on the service's catalog and partitions
(``SelectionService.catalog``, ``.partitions``): the state the selection and the replica read.
Changes go through the service's ``commit`` like every other (``upsert``, ``patch``,
``delete``); ``put`` and ``remove`` apply one, on this instance or from a peer's record.
"""

from __future__ import annotations

from typing import Protocol

from kv_slot_tracker.core.limits import MAX_RANKS_PER_TRACKER
from kv_slot_tracker.core.selection import ApproximateCache, RouterConfig
from kv_slot_tracker.core.selection.catalog import (
    INCOMPLETE,
    MAX_DP_SIZE,
    REPLAY_NEEDS_ONE_RANK,
    SCHEDULABLE,
    WorkerRecord,
    WorkerSpec,
    block_size_mismatch,
    intrinsic_reasons,
    patched,
    replay_endpoints_problem,
)
from kv_slot_tracker.core.selection.errors import CatalogWorkerNotFound, InvalidReplayEndpoints
from kv_slot_tracker.core.selection.receipt_ring import ReceiptRing
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.errors import TooManyTrackers
from kv_slot_tracker.service.registry import TrackerRegistry
from kv_slot_tracker.service.selection import commands, mutations
from kv_slot_tracker.service.selection.kv_events import KvEvents, kv_endpoints
from kv_slot_tracker.service.selection.reservations import Reservations
from kv_slot_tracker.service.selection.types import SELECTION_OUTCOMES, Partition, SelectionCounters


class PlacementHost(Protocol):
    """What the placement needs of the selection service: the state it changes (the catalog and
    the partitions), its collaborators, and ``commit`` for the changes it decides."""

    catalog: dict[int, WorkerRecord]
    partitions: dict[Key, Partition]
    registry: TrackerRegistry
    config: RouterConfig
    kv_events: KvEvents
    reservations: Reservations
    counters: SelectionCounters
    receipts: ReceiptRing | None

    def commit(self, mutation: mutations.Mutation) -> None: ...


# Most ranks one tracker may hold (the slot-tracker routes' limit).
MAX_RANKS_PER_PARTITION = MAX_RANKS_PER_TRACKER


class WorkerPlacement:
    """The catalog's changes and its workers' places (module notes)."""

    def __init__(self, service: PlacementHost) -> None:
        self.service = service
        self.schedulable = 0  # schedulable workers in the catalog

    def replace(self, catalog: dict[int, WorkerRecord], partitions: dict[Key, Partition]) -> None:
        """Replace the catalog and the partitions (a snapshot's, restored by the replica)."""
        self.service.catalog, self.service.partitions = catalog, partitions
        self.schedulable = sum(r.schedulable for r in catalog.values())

    def _admit_put(self, spec: WorkerSpec) -> None:
        """The global budgets' check of a worker put into the catalog: a new entry, and the
        ranks it may place beyond those its record has placed (``OverBudget``)."""
        held = self.service.catalog.get(spec.worker_id)
        if held is None:
            self.service.registry.admit_selection_worker(len(self.service.catalog))
        if spec.block_size is not None:
            before = held.spec.dp_size if held is not None and held.schedulable else 0
            self.service.registry.admit_ranks(spec.dp_size - before)

    def upsert(self, cmd: commands.UpsertWorker) -> WorkerRecord:
        _check_replay_endpoints(cmd.spec)
        self._admit_put(cmd.spec)
        self.service.commit(mutations.PutWorker(cmd.spec))
        return self.service.catalog[cmd.spec.worker_id]

    def patch(self, cmd: commands.PatchWorker) -> WorkerRecord:
        record = self.service.catalog.get(cmd.worker_id)
        if record is None:
            raise CatalogWorkerNotFound(cmd.worker_id)
        spec = patched(record.spec, cmd.changes)
        _check_replay_endpoints(spec)
        self._admit_put(spec)
        self.service.commit(mutations.PutWorker(spec))
        return self.service.catalog[cmd.worker_id]

    def delete(self, cmd: commands.DeleteWorker) -> WorkerRecord:
        record = self.service.catalog.get(cmd.worker_id)
        if record is None:
            raise CatalogWorkerNotFound(cmd.worker_id)
        self.service.commit(mutations.RemoveWorker(cmd.worker_id))
        return WorkerRecord(record.spec, "unschedulable")

    def records_of(self, model_name: str | None, routing_group: str | None) -> list[WorkerRecord]:
        """Catalog records, sorted by partition then id, optionally filtered."""
        return [
            r
            for r in sorted(self.service.catalog.values(), key=_record_order)
            if (model_name is None or r.spec.model_name == model_name)
            and (routing_group is None or r.spec.routing_group == routing_group)
        ]

    def _existing_block_size(self, key: Key) -> int | None:
        t = self.service.registry.find(key)
        if t is not None:
            return t.block_size
        part = self.service.partitions.get(key)
        return part.block_size if part is not None else None

    def _reasons(self, spec: WorkerSpec, placed_here: int) -> list[str]:
        """Why ``spec`` cannot be placed; ``placed_here`` = its ranks already in that tracker."""
        reasons = intrinsic_reasons(spec)
        if self.service.config.use_kv_events and spec.dp_size <= MAX_DP_SIZE:
            endpoints = kv_endpoints(spec)
            reasons += [
                f"kv_events endpoint is required for dp_rank {rank}"
                for rank in range(spec.dp_start, spec.dp_start + spec.dp_size)
                if not endpoints.get(rank)
            ]
            if spec.dp_size > 1 and spec.replay_endpoint is not None:
                reasons.append(REPLAY_NEEDS_ONE_RANK)
        if reasons:
            return reasons
        assert spec.block_size is not None
        existing = self._existing_block_size(spec.key)
        if existing is not None and existing != spec.block_size:
            return [block_size_mismatch(spec.key, existing, spec.block_size)]
        t = self.service.registry.find(spec.key)
        if t is None:
            try:
                self.service.registry.check_room(spec.key)
            except TooManyTrackers as e:
                return [str(e)]
            if not self._room_for_partition(spec.key):
                return [
                    f"too many partitions: this instance already holds "
                    f"{self.service.registry.max_trackers} (max_trackers)"
                ]
        ranks = (t.num_ranks() if t is not None else 0) - placed_here + spec.dp_size
        if ranks > MAX_RANKS_PER_PARTITION:
            return [
                f"reconciliation failed: too many ranks for model={spec.model_name} "
                f"routing_group={spec.routing_group}: {ranks} > {MAX_RANKS_PER_PARTITION}"
            ]
        return []

    def _set_record(self, worker_id: int, record: WorkerRecord | None) -> None:
        old = self.service.catalog.get(worker_id)
        self.schedulable -= old is not None and old.schedulable
        if record is None:
            self.service.catalog.pop(worker_id, None)
        else:
            self.service.catalog[worker_id] = record
            self.schedulable += record.schedulable

    def put(self, spec: WorkerSpec) -> None:
        old = self.service.catalog.get(spec.worker_id)
        old_spec = old.spec if old is not None and old.schedulable else None
        same_place = old_spec is not None and old_spec.key == spec.key
        placed_here = old_spec.dp_size if same_place and old_spec is not None else 0
        reasons = self._reasons(spec, placed_here)
        if reasons:
            if old_spec is not None:
                self._unplace(old_spec)
            self._set_record(spec.worker_id, WorkerRecord(spec, INCOMPLETE, tuple(reasons)))
        else:
            if old_spec is not None and not same_place:
                self._unplace(old_spec)
            self._place(spec)
            self._set_record(spec.worker_id, WorkerRecord(spec, SCHEDULABLE))

    def remove(self, worker_id: int) -> None:
        record = self.service.catalog[worker_id]
        self._set_record(worker_id, None)
        if record.schedulable:
            self._unplace(record.spec)

    def _unused_partition(self) -> Key | None:
        """A partition no catalog worker names and no reservation is held in, if any. Such a
        partition stays listed, as the reference lists it after its last worker goes, until
        its place is needed (``_room_for_partition``)."""
        named = {r.spec.key for r in self.service.catalog.values()}
        held = self.service.reservations.partitions_held()
        for key, part in self.service.partitions.items():  # oldest first
            if not part.workers and key not in named and key not in held:
                return key
        return None

    def _room_for_partition(self, key: Key) -> bool:
        """Whether a partition for ``key`` exists or may be made (an unused one is dropped,
        with its series, to make room beyond ``max_trackers``). O(catalog + partitions), only
        when a new partition meets the limit."""
        if (
            key in self.service.partitions
            or len(self.service.partitions) < self.service.registry.max_trackers
        ):
            return True
        unused = self._unused_partition()
        if unused is None:
            return False
        del self.service.partitions[unused]
        made = self.service.counters.made
        for outcome in SELECTION_OUTCOMES:
            made.pop((unused, outcome), None)
        if self.service.receipts is not None:
            self.service.receipts.forget_partition(unused)
        return True

    def _place(self, spec: WorkerSpec) -> None:
        """Register (or re-range) a schedulable worker's ranks in its partition's tracker."""
        self.service.kv_events.worker_placed()
        key = spec.key
        assert spec.block_size is not None
        t = self.service.registry.find(key)
        if t is None:
            t = self.service.registry.create(key, spec.block_size)
        change = t.upsert_worker(spec.dp_range)
        part = self.service.partitions.get(key)
        if part is None:
            part = self.service.partitions[key] = Partition(
                key, t.block_size, ApproximateCache(self.service.config.router_ttl_ns)
            )
        part.block_size = t.block_size
        part.workers[spec.worker_id] = spec
        if change.removed:
            for w in change.removed:
                part.index.clear_rank(w, prune=True)
            self.service.reservations.orphan(spec.worker_id, {w.dp_rank for w in change.removed})

    def _unplace(self, spec: WorkerSpec) -> None:
        """Take a worker off its partition: ranks, their requests and its cached blocks."""
        key = spec.key
        t = self.service.registry.find(key)
        if t is not None and t.has_worker(spec.worker_id):
            t.unregister_worker(spec.worker_id)
            self.service.registry.drop_if_empty(key)
        part = self.service.partitions.get(key)
        if part is not None:
            part.workers.pop(spec.worker_id, None)
            part.cache.remove_worker(spec.worker_id)
            part.index.remove_worker(spec.worker_id)
        self.service.kv_events.worker_left(spec.worker_id)
        self.service.reservations.orphan(spec.worker_id, None)


def _record_order(r: WorkerRecord) -> tuple[str, str, int]:
    return (r.spec.model_name, r.spec.routing_group, r.spec.worker_id)


def _check_replay_endpoints(spec: WorkerSpec) -> None:
    """Refuse (400, nothing changed) ``replay_endpoints`` that do not fit the worker's ranks."""
    problem = replay_endpoints_problem(spec)
    if problem is not None:
        raise InvalidReplayEndpoints(problem)
