"""The memory budget's watch: past the budget, free heap pages are given back (at most every
``trim_interval``) before a growing call is refused, so memory freed by shrinking calls ends
the refusals without a restart. A fake reader and clock stand in for ``/proc`` and time."""

from __future__ import annotations

import pytest

from kv_slot_tracker.core.limits import Budgets
from kv_slot_tracker.service.errors import OverMemoryBudget
from kv_slot_tracker.service.memory import MemoryWatch
from kv_slot_tracker.service.registry import TrackerRegistry


class Heap:
    """Resident bytes as the allocator reports them: ``kept`` until a trim hands them back."""

    def __init__(self, used: int, kept: int) -> None:
        self.used, self.kept, self.trims = used, kept, 0

    def read(self) -> int:
        return self.used + self.kept

    def trim(self) -> bool:
        self.trims += 1
        self.kept = 0
        return True


def test_a_reading_past_the_budget_is_taken_again_after_a_trim() -> None:
    heap, now = Heap(used=100, kept=900), [0.0]
    watch = MemoryWatch(heap.read, lambda: now[0], trim=heap.trim, trim_interval=5.0)
    assert watch() == 1000
    assert watch.after_trim() == 100
    assert (heap.trims, watch.trims) == (1, 1)
    heap.kept = 900  # grown again: no second trim within the interval
    assert watch.after_trim() == 100
    now[0] = 5.0
    assert watch.after_trim() == 100
    assert heap.trims == 2


def test_the_registry_admits_once_the_kept_pages_are_given_back() -> None:
    heap = Heap(used=100, kept=900)
    registry = TrackerRegistry(clock=lambda: 0, expiry_ns=1, check_interval_ns=1, instance_id=1,
                               replicated=False, publisher_for=lambda key, bs: None)  # type: ignore[arg-type,return-value]  # fmt: skip
    registry.budgets = Budgets(500, 1 << 62, 1 << 62, 1 << 62, 1 << 62)
    now = [0.0]
    registry.resident = MemoryWatch(heap.read, lambda: now[0], trim=heap.trim)
    registry.admit_memory()  # 1,000 resident, 100 of it in use: admitted after the trim
    assert heap.trims == 1
    heap.used, now[0] = 600, 1.0  # really past the budget, read again
    with pytest.raises(OverMemoryBudget):
        registry.admit_memory()
    assert registry.refusals == {"memory": 1}


def test_adds_consult_the_reading_on_schedule_and_every_add_while_past_the_budget() -> None:
    """Under the budget an add consults the memory reading at most every ``MEMORY_CHECK_NS``
    of the service's clock; once a consulted reading is past the budget every add consults it
    (and is refused) until memory is back under it."""
    from kv_slot_tracker.service import commands
    from kv_slot_tracker.service.registry import MEMORY_CHECK_NS
    from kv_slot_tracker.service.service import SlotTrackerService

    now = [0]
    service = SlotTrackerService(clock=lambda: now[0])
    service.registry.budgets = Budgets(500, 1 << 62, 1 << 62, 1 << 62, 1 << 62)
    reads = []

    def resident() -> int:
        reads.append(now[0])
        return heap[0]

    heap = [100]
    service.registry.resident = resident
    service.register(commands.Register(model_name="m", worker_id=1, block_size=4))
    reads.clear()  # a registration consults it too

    def add(rid: str) -> None:
        service.add(commands.Add(model_name="m", request_id=rid, worker_id=1, dp_rank=0,
                                 sequence_hashes=[1, 2]))  # fmt: skip

    add("a")  # the first add consults it
    heap[0] = 600  # past the budget: not seen before the next consultation is due
    now[0] = MEMORY_CHECK_NS - 1
    add("b")
    assert reads == [0]
    now[0] = MEMORY_CHECK_NS
    with pytest.raises(OverMemoryBudget):
        add("c")
    now[0] += 1  # past the budget: every add consults it, however soon
    with pytest.raises(OverMemoryBudget):
        add("c")
    # each refusal reads it twice: the consultation, then the check after a trim
    assert reads[1:] == [MEMORY_CHECK_NS] * 2 + [MEMORY_CHECK_NS + 1] * 2
    heap[0] = 100
    now[0] += 1
    add("c")
    ids = sorted(r for r, _ in service.tracker(("m", "default")).indexed_requests())
    assert ids == ["a", "b", "c"]
    assert service.registry.refusals == {"memory": 2}
    service.registry.resident = None  # not watched: never consulted again
    now[0] += 10 * MEMORY_CHECK_NS
    add("d")
    assert len(reads) == 6
