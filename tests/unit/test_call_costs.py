"""Lifecycle calls cost O(size of the call), never O(active requests).

Timing would be flaky, so these tests count work instead: request ids are a ``str`` subclass
that counts every ``==`` and ``hash`` it takes part in. A linear scan over the active requests
(``deque.remove``, ``list.index``, a comparing loop) compares the id with each of them, so the
counts of one call would grow with how many requests are active; here they must be identical
with 10 and with 1,000 active requests, and small.
"""

from __future__ import annotations

import random

import pytest

from kv_slot_tracker.core.blocks import BlockTracker
from kv_slot_tracker.core.prefill import PrefillLoadState, PrefillLoadTracker
from kv_slot_tracker.core.sequences import ActiveSequences
from kv_slot_tracker.core.types import NS_PER_S, PrefillLoadHint, WorkerWithDpRank
from tests.fakes import FakeClock
from tests.support.blocks import set_fraction
from tests.support.sequences import active_block_hashes
from tests.support.tracker import SequenceRequest, active_request_counts, add_request, new_tracker


class CountingId(str):
    """A request id that counts the comparisons and hashes it takes part in."""

    eq_calls = 0
    hash_calls = 0

    def __eq__(self, other: object) -> bool:
        CountingId.eq_calls += 1
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        CountingId.eq_calls += 1
        return str.__ne__(self, other)

    def __hash__(self) -> int:
        CountingId.hash_calls += 1
        return str.__hash__(self)

    @classmethod
    def reset(cls) -> None:
        cls.eq_calls = cls.hash_calls = 0

    @classmethod
    def counts(cls) -> tuple[int, int]:
        return cls.eq_calls, cls.hash_calls


def ids(n: int) -> list[CountingId]:
    return [CountingId(f"r{i}") for i in range(n)]


SIZES = (10, 1000)


def prefill_removal_counts(n: int, which: str) -> tuple[tuple[int, int], PrefillLoadTracker]:
    tracker = PrefillLoadTracker()
    rids = ids(n)
    for i, rid in enumerate(rids):
        tracker.insert(rid, PrefillLoadState(10, NS_PER_S), i)
    victim = {"anchor": rids[0], "middle": rids[n // 2], "newest": rids[-1]}[which]
    CountingId.reset()
    tracker.discard(victim, 5 * NS_PER_S)  # what ``remove`` does, without building the state
    counts = CountingId.counts()
    assert victim not in tracker.prefills
    assert tracker.remove(victim, 5 * NS_PER_S) is None
    tracker.assert_consistent()
    return counts, tracker


@pytest.mark.parametrize("which", ["anchor", "middle", "newest"])
def test_removing_one_prefill_touches_no_other_prefill(which: str) -> None:
    results = {n: prefill_removal_counts(n, which) for n in SIZES}
    small, large = results[10][0], results[1000][0]
    assert small == large, f"removal work grows with the number of prefills: {small} -> {large}"
    eq_calls, hash_calls = large
    assert eq_calls <= 2 and hash_calls <= 3, large
    tracker = results[1000][1]
    assert len(tracker) == 999
    assert tracker.full_sum == 9990
    if which == "anchor":  # the next one is anchored at the removal time
        assert tracker.anchor_rid == "r1" and tracker.anchor_since == 5 * NS_PER_S
    else:  # the anchor is credited the freed prefill's second, capped at the removal time
        assert tracker.anchor_rid == "r0" and tracker.anchor_since == NS_PER_S


def slot_free_counts(n: int) -> tuple[int, int]:
    clock = FakeClock()
    slot = ActiveSequences(16, clock.now)
    rids = ids(n + 1)
    for i, rid in enumerate(rids):
        slot.add_request_with_prefill_tracking(
            rid, [1, 2, 1000 + i], None, True, PrefillLoadHint(64), clock.now()
        )
    assert slot.prefill.anchor_rid == "r0"
    CountingId.reset()
    slot.release(rids[-1], clock.now())
    counts = CountingId.counts()
    assert 1000 + n not in active_block_hashes(slot)
    assert len(slot.requests) == n and len(slot.prefill) == n
    return counts


def test_freeing_the_newest_request_of_a_rank_does_not_scan_the_others() -> None:
    assert slot_free_counts(10) == slot_free_counts(1000)


def tracker_add_free_counts(n: int) -> tuple[int, int]:
    clock = FakeClock()
    tracker = new_tracker(None, 16, {0: (0, 2)}, clock=clock.now)
    rank = WorkerWithDpRank(0, 1)
    prefix = list(range(1, 17))
    for i, rid in enumerate(ids(n)):
        add_request(
            tracker,
            SequenceRequest(rid, rank, prefix + [10_000 + i], True, None, PrefillLoadHint(512)),
            clock.now(),
        )
    new = CountingId("new")
    CountingId.reset()
    add_request(
        tracker,
        SequenceRequest(new, rank, prefix + [99], True, None, PrefillLoadHint(512)),
        clock.now(),
    )
    tracker.free(new, clock.now())
    counts = CountingId.counts()
    assert active_request_counts(tracker) == {WorkerWithDpRank(0, 0): 0, rank: n}
    assert tracker.active_blocks()[rank] == 16 + n
    return counts


def test_add_and_free_next_to_many_active_requests_does_not_scan_them() -> None:
    assert tracker_add_free_counts(10) == tracker_add_free_counts(1000)


class NoWalkDict(dict):
    """A dict that refuses to be walked: reading one key is fine, visiting all of them is not."""

    def _refuse(self, *args: object) -> None:
        raise AssertionError("walked every fractional block")

    __iter__ = keys = values = items = _refuse  # type: ignore[assignment]


def test_active_blocks_does_not_walk_the_fractional_blocks() -> None:
    bt = BlockTracker()
    bt._fraction = NoWalkDict()
    for h in range(1000):
        bt.touch(h)
        set_fraction(bt, h, 0.25 if h % 2 else 0.5)
    assert bt.active_blocks() == 375  # 500 * 0.5 + 500 * 0.25
    for h in range(0, 1000, 2):
        bt.release_and_try_remove(h)
    assert bt.active_blocks() == 125  # 500 * 0.25
    bt.touch(5000)
    assert bt.active_blocks() == 126
    set_fraction(bt, 5000, 0.5)
    assert bt.active_blocks() == 126  # 125.5 rounds half away from zero


class CountingHash(int):
    """A block hash that counts the hashes and comparisons it takes part in: every dict or set
    operation on a block, and every comparing step over a run of blocks, costs one or more."""

    calls = 0

    def __hash__(self) -> int:
        CountingHash.calls += 1
        return int.__hash__(self)

    def __eq__(self, other: object) -> bool:
        CountingHash.calls += 1
        return int.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        CountingHash.calls += 1
        return int.__ne__(self, other)


class CountingRandom(random.Random):
    """The rank's generator of output block hashes, giving ``CountingHash`` ints."""

    def getrandbits(self, k: int) -> int:
        return CountingHash(super().getrandbits(k))


def decay_call_counts(prompt_len: int, outputs_before: int) -> int:
    """Block operations of one output block with a decay fraction on a request whose prompt
    has ``prompt_len`` blocks (the first half shared with another request, the rest its own)
    and that has decayed ``outputs_before`` times already."""
    clock = FakeClock()
    slot = ActiveSequences(16, clock.now, expiry_ns=None, rng=CountingRandom(7))
    prompt = [CountingHash(h) for h in range(1, prompt_len + 1)]
    half = prompt_len // 2
    slot.add_request_with_prefill_tracking("other", prompt[:half], None, False, None, 0)
    slot.add_request_with_prefill_tracking("r", prompt, None, False, None, 0)
    for _ in range(outputs_before):
        slot.add_output_block("r", 0.5)
    CountingHash.calls = 0
    slot.add_output_block("r", 0.25)
    calls = CountingHash.calls
    # the shared half counts whole; the rest and the output blocks at 0.25
    expected = half + (prompt_len - half + outputs_before + 1) * 0.25
    assert slot.active_blocks() == int(expected + 0.5)
    slot.assert_consistent()
    return calls


def test_an_output_block_with_decay_does_not_walk_the_prompt_or_the_outputs() -> None:
    """After a request's first decay (which gives its fraction to every block it holds alone),
    each further one costs the same for a 10-block and a 10,000-block prompt, and the same
    after 1 or 300 output blocks: the blocks follow the request's one fraction."""
    counts = {(n, k): decay_call_counts(n, k) for n in (10, 10_000) for k in (1, 300)}
    assert len(set(counts.values())) == 1, counts
    assert counts[(10, 1)] <= 10, counts
