"""Worker topology: authoritative dp ranges and the set of tracked rank slots (SPEC §4.2).

A slot may exist without an authoritative range (a *lazily created* slot, made by a local add
under LazyRegister or by a replicated add). Operations return the ranks they added and removed;
the tracker applies that change to its state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .errors import DuplicateWorker, InvalidDpRange, InvalidDpSize, WorkerIdNotRegistered
from .types import U32_MAX, WorkerDpRange, WorkerWithDpRank


@dataclass(slots=True)
class TopologyChange:
    added: list[WorkerWithDpRank] = field(default_factory=list)
    removed: list[WorkerWithDpRank] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.added and not self.removed


def validate_range(r: WorkerDpRange) -> None:
    if r.dp_size <= 0:
        raise InvalidDpSize(r.worker_id)
    if r.dp_start + r.dp_size > U32_MAX:
        raise InvalidDpRange(r.worker_id, r.dp_start, r.dp_size)


class WorkerTable:
    """Pure bookkeeping of ranges and slot keys; slot contents belong to the tracker."""

    __slots__ = ("ranges", "slots")

    def __init__(self) -> None:
        self.ranges: dict[int, WorkerDpRange] = {}
        self.slots: set[WorkerWithDpRank] = set()

    def register(self, r: WorkerDpRange) -> TopologyChange:
        validate_range(r)
        if r.worker_id in self.ranges:
            raise DuplicateWorker(r.worker_id)
        self.ranges[r.worker_id] = r
        return self._reconcile_worker_id(r.worker_id)

    def upsert(self, r: WorkerDpRange) -> TopologyChange:
        validate_range(r)
        if self.ranges.get(r.worker_id) == r:
            return TopologyChange()
        self.ranges[r.worker_id] = r
        return self._reconcile_worker_id(r.worker_id)

    def unregister(self, worker_id: int) -> TopologyChange:
        if worker_id not in self.ranges:
            raise WorkerIdNotRegistered(worker_id)
        del self.ranges[worker_id]
        return self._reconcile_worker_id(worker_id)

    def reconcile(self, ranges: Iterable[WorkerDpRange]) -> TopologyChange:
        new: dict[int, WorkerDpRange] = {}
        for r in ranges:
            validate_range(r)
            if r.worker_id in new:
                raise DuplicateWorker(r.worker_id)
            new[r.worker_id] = r
        self.ranges = new
        target = {w for r in new.values() for w in r.ranks()}
        change = TopologyChange(
            added=sorted(target - self.slots), removed=sorted(self.slots - target)
        )
        self.slots = target
        return change

    def ensure(self, worker: WorkerWithDpRank) -> TopologyChange:
        if worker in self.slots:
            return TopologyChange()
        self.slots.add(worker)
        return TopologyChange(added=[worker])

    def _reconcile_worker_id(self, worker_id: int) -> TopologyChange:
        r = self.ranges.get(worker_id)
        target = set(r.ranks()) if r is not None else set()
        current = {w for w in self.slots if w.worker_id == worker_id}
        change = TopologyChange(added=sorted(target - current), removed=sorted(current - target))
        self.slots -= current - target
        self.slots |= target
        return change

    def worker_ranges(self) -> list[WorkerDpRange]:
        return [self.ranges[k] for k in sorted(self.ranges)]

    def has_registered_workers(self) -> bool:
        return bool(self.ranges)
