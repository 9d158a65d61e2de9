"""The pending-selection cache: per partition and id, bounded by count and age."""

from __future__ import annotations

from kv_slot_tracker.core.selection.pending import PendingSelection, PendingSelections
from kv_slot_tracker.core.types import NS_PER_S, WorkerWithDpRank


def entry(model: str = "m", worker: int = 1) -> PendingSelection:
    return PendingSelection(
        model_name=model,
        routing_group="default",
        worker=WorkerWithDpRank(worker),
        sequence_hashes=(1,),
        block_hashes=(1,),
        isl_tokens=4,
        effective_prefill_tokens=4,
        track_prefill_tokens=True,
    )


def test_latest_select_wins_per_partition() -> None:
    cache = PendingSelections(10, 120 * NS_PER_S)
    cache.put("s", entry(worker=1), 0)
    cache.put("s", entry(worker=2), 1)
    cache.put("s", entry(model="other", worker=3), 2)
    assert len(cache) == 2
    assert cache.get(("m", "default", "s"), 3) == entry(worker=2)
    assert cache.get(("other", "default", "s"), 3) == entry(model="other", worker=3)
    assert cache.discard(("m", "default", "s"))
    assert cache.get(("m", "default", "s"), 3) is None
    assert cache.get(("other", "default", "s"), 3) is not None


def test_entries_expire_at_exactly_the_ttl() -> None:
    cache = PendingSelections(10, 120 * NS_PER_S)
    cache.put("a", entry(), 0)
    cache.put("b", entry(), 10 * NS_PER_S)
    assert cache.get(("m", "default", "a"), 120 * NS_PER_S - 1) is not None
    assert cache.get(("m", "default", "a"), 120 * NS_PER_S) is None  # counts as absent
    assert cache.expire(120 * NS_PER_S) == 1
    assert (len(cache), cache.expired) == (1, 1)
    cache.put("c", entry(), 200 * NS_PER_S)  # a write sweeps what expired
    assert (len(cache), cache.expired) == (1, 2)


def test_the_oldest_entry_is_evicted_when_full() -> None:
    cache = PendingSelections(2, 120 * NS_PER_S)
    for i, sid in enumerate(("p1", "p2", "p3")):
        cache.put(sid, entry(), i)
    assert cache.evicted == 1
    assert cache.get(("m", "default", "p1"), 5) is None
    assert cache.get(("m", "default", "p3"), 5) is not None
    cache.put("p2", entry(), 6)  # rewriting moves p2 to the back: p3 goes next
    cache.put("p4", entry(), 7)
    assert cache.get(("m", "default", "p3"), 8) is None
    assert cache.get(("m", "default", "p2"), 8) is not None
