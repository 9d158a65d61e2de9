"""The pending-selection cache: per partition and id, bounded by count, bytes and age."""

from __future__ import annotations

from kv_slot_tracker.core.selection.pending import (
    DEFAULT_MAX_BYTES,
    PendingSelection,
    PendingSelections,
)
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


def prompt_entry(blocks: int, first: int) -> PendingSelection:
    hashes = tuple(range(first, first + blocks))
    return PendingSelection(model_name="m", routing_group="default", worker=WorkerWithDpRank(1),
                            sequence_hashes=hashes, block_hashes=hashes, isl_tokens=16 * blocks,
                            effective_prefill_tokens=16 * blocks, track_prefill_tokens=True)  # fmt: skip


def fill(max_bytes: int, blocks: int, n: int, prefix: str) -> tuple[PendingSelections, list[int]]:
    """``n`` selections as the reference was sent them (``prefix`` + a 3-digit number); which
    of them a replay still finds."""
    cache = PendingSelections(100_000, 120 * NS_PER_S, max_bytes)
    for i in range(n):
        cache.put(f"{prefix}{i:03d}", prompt_entry(blocks, i * 100_000), i)
    alive = [i for i in range(n) if cache.get(("m", "default", f"{prefix}{i:03d}"), n)]
    return cache, alive


def test_the_byte_budget_keeps_what_the_reference_keeps() -> None:
    """Observed on the reference (``--selection-cache-max-bytes``, one worker, 200 selects of
    1-block prompts given as block and sequence hashes, then a replay of each): 35 are left,
    the newest, with 4-character ids; 12 with 53-character ids. An entry counts 16 bytes per
    block plus its model, routing group and id."""
    cache, alive = fill(1000, 1, 200, "s")
    assert alive == list(range(165, 200))
    assert (cache.bytes, cache.evicted) == (35 * 28, 165)
    cache, alive = fill(1000, 1, 200, "x" * 50)
    assert alive == list(range(188, 200))
    assert cache.bytes == 12 * 77


def test_the_default_budget_is_the_references() -> None:
    """Observed with the reference's default: of 700 selects of 50,000-block prompts (800,012
    bytes each) the newest 335 are left, which is 256 MiB."""
    assert DEFAULT_MAX_BYTES == 256 * 1024 * 1024
    assert DEFAULT_MAX_BYTES // (16 * 50_000 + 12) == 335


def test_an_entry_larger_than_the_budget_is_not_kept() -> None:
    """Observed: with a 100-byte budget no 100-block selection can be replayed."""
    cache, alive = fill(100, 100, 3, "s")
    assert (alive, len(cache), cache.bytes, cache.evicted) == ([], 0, 0, 3)


def test_bytes_follow_replays_expiry_and_replacement() -> None:
    cache = PendingSelections(10, 120 * NS_PER_S, 10_000)
    cache.put("a", prompt_entry(10, 0), 0)  # 160 + 1 + 7 + 1
    cache.put("b", prompt_entry(20, 0), 10 * NS_PER_S)  # 320 + 9
    assert cache.bytes == 169 + 329
    cache.put("a", prompt_entry(1, 0), 20 * NS_PER_S)  # replaces a: 16 + 9
    assert cache.bytes == 329 + 25
    assert cache.discard(("m", "default", "b"))
    assert cache.bytes == 25
    cache.expire(140 * NS_PER_S)
    assert (len(cache), cache.bytes) == (0, 0)
