"""The store of early lifecycle calls: tombstones and pending marks, bounded in number and age."""

from __future__ import annotations

import pytest

from kv_slot_tracker.service.early_calls import FREE, PREFILL_COMPLETE, EarlyCalls

S = 1_000_000_000
K = ("m", "g")


def key(rid: str) -> tuple[str, str, str]:
    return (*K, rid)


def test_free_supersedes_a_mark_and_not_the_other_way_round() -> None:
    early = EarlyCalls(capacity=10, ttl_ns=60 * S)
    early.put(key("a"), PREFILL_COMPLETE, 100 * S, 100 * S)
    early.put(key("a"), FREE, 101 * S, 101 * S)
    early.put(key("a"), PREFILL_COMPLETE, 102 * S, 102 * S)
    entry = early.get(key("a"), 102 * S)
    assert (entry.op, entry.ts) == (FREE, 101 * S)
    early.put(key("a"), FREE, 99 * S, 103 * S)  # an older free of the same id: the newest counts
    assert early.get(key("a"), 103 * S).ts == 101 * S
    assert early.tombstones() == 1 and len(early) == 1


def test_bounded_by_capacity_oldest_first_and_by_age() -> None:
    early = EarlyCalls(capacity=3, ttl_ns=10 * S)
    for i in range(5):
        early.put(key(f"r{i}"), FREE, (100 + i) * S, (100 + i) * S)
    assert [r[2] for r in early.export()] == ["r2", "r3", "r4"]
    assert early.counters.dropped == 2
    # an entry past its age is ignored at once and dropped at the next prune
    assert early.get(key("r2"), 112 * S + 1) is None
    assert early.get(key("r3"), 112 * S + 1) is not None
    early.prune(113 * S + 1)
    assert [r[2] for r in early.export()] == ["r4"]
    assert early.counters.dropped == 4


def test_export_and_restore() -> None:
    early = EarlyCalls(capacity=10, ttl_ns=60 * S)
    early.put(key("a"), FREE, 100 * S, 100 * S)
    early.put(("n", "h", "b"), PREFILL_COMPLETE, 101 * S, 101 * S)
    rows = early.export()
    assert rows == [["m", "g", "a", FREE, 100 * S], ["n", "h", "b", PREFILL_COMPLETE, 101 * S]]
    other = EarlyCalls(capacity=10, ttl_ns=60 * S)
    other.put(key("stale"), FREE, 100 * S, 100 * S)
    other.restore(rows, 120 * S)
    assert other.export() == rows
    with pytest.raises(ValueError):
        other.restore([["m", "g", "c", "add", 1]], 120 * S)
    assert other.export() == rows  # all or nothing
    other.restore(rows, 200 * S)  # older than the ttl by now
    assert other.export() == []


def test_bounded_by_the_bytes_of_names_and_ids_oldest_first() -> None:
    """A client chooses the ids (up to 1024 characters each): long ones fill the byte budget
    before the count, and the oldest go first, counted."""
    early = EarlyCalls(capacity=1000, ttl_ns=60 * S, max_bytes=3 * (2 + 1024))
    for i in range(5):
        early.put(key(f"{i}" * 1024), FREE, (100 + i) * S, (100 + i) * S)
    assert [r[2][0] for r in early.export()] == ["2", "3", "4"]
    assert (early.bytes, early.counters.dropped) == (3 * 1026, 2)
    early.put(key("4" * 1024), PREFILL_COMPLETE, 106 * S, 106 * S)  # the same key: no more bytes
    assert (early.bytes, len(early)) == (3 * 1026, 3)
    early.discard(key("3" * 1024))
    assert early.bytes == 2 * 1026
    other = EarlyCalls(capacity=1000, ttl_ns=60 * S, max_bytes=1026)
    other.restore(early.export(), 110 * S)  # a snapshot over the budget: the oldest goes
    assert ([r[2][0] for r in other.export()], other.bytes) == (["4"], 1026)
