"""The approximate cache: SELECTION.md §7 behaviour on a fake clock, a naive model, and its cost.

The TTL numbers are those observed on the reference (TTL 2 s: present at 1.2 s, gone at 2.5 s; a
re-booked prefix [1,2] of [1,2,3,4] leaves 2 blocks at 2.5 s and none at 4 s). A Hypothesis test
runs random bookings, clock advances, sweeps and rank removals against a dictionary of last-write
times and compares every lookup and the /dump listing. The counting test shows that a lookup's
work depends on the ranks that match the prompt, not on how many ranks the partition has.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_slot_tracker.core.hashing import chained_hashes, signed_hashes, to_signed
from kv_slot_tracker.core.selection import (
    ApproximateCache,
    CachedBlock,
    chain_keys,
    prompt_from_tokens,
)
from kv_slot_tracker.core.types import NS_PER_S, U64_MAX, WorkerWithDpRank
from tests.fakes import FakeClock
from tests.support.approx_cache import pending_expiries

A, B = WorkerWithDpRank(1, 0), WorkerWithDpRank(2, 0)


def cache_and_clock(ttl_s: float = 2.0) -> tuple[ApproximateCache, FakeClock]:
    return ApproximateCache(ttl_ns=round(ttl_s * NS_PER_S)), FakeClock()


def test_block_lives_ttl_after_its_write() -> None:
    cache, clock = cache_and_clock()
    cache.record(A, [1, 2, 3, 4], clock.now())
    clock.advance(1.2)
    assert cache.overlaps([1, 2, 3, 4], clock.now()) == {A: 4}
    clock.advance(1.3)  # 2.5 s
    assert len(cache) == 4  # expired, not yet swept
    assert cache.expire(clock.now()) == 4
    assert len(cache) == 0
    assert cache.ranks() == []
    assert cache.overlaps([1, 2, 3, 4], clock.now()) == {}


def test_a_lookup_sweeps_what_expired_first() -> None:
    cache, clock = cache_and_clock()
    cache.record(A, [1, 2, 3, 4], clock.now())
    clock.advance(2.5)
    assert len(cache) == 4
    assert cache.overlaps([1, 2, 3, 4], clock.now()) == {}
    assert len(cache) == 0
    assert cache.expire(clock.now()) == 0


def test_expiry_is_at_exactly_ttl() -> None:
    cache, clock = cache_and_clock()
    cache.record(A, [1], clock.now())
    clock.advance_ns(2 * NS_PER_S - 1)
    assert cache.overlaps([1], clock.now()) == {A: 1}
    assert len(cache) == 1
    clock.advance_ns(1)
    assert cache.overlaps([1], clock.now()) == {}
    assert len(cache) == 0


def test_a_later_block_expires_at_exactly_ttl_too() -> None:
    cache, clock = cache_and_clock()
    cache.record(A, [1, 2], clock.now())
    clock.advance(1)
    cache.record(A, [1], clock.now())  # block 0 now lives 1 s longer than block 1
    clock.advance(1)
    assert len(cache) == 2
    assert cache.overlaps([1, 2], clock.now()) == {A: 1}
    assert len(cache) == 1  # block 1 swept by the lookup, block 0 kept
    assert cache.overlaps([1, 2], clock.now()) == {A: 1}


def test_rebooking_a_prefix_refreshes_only_those_blocks() -> None:
    cache, clock = cache_and_clock()
    t0 = clock.now()
    cache.record(A, [1, 2, 3, 4], t0)
    clock.advance(1.0)
    cache.record(A, [1, 2], clock.now())
    clock.set(t0 + round(2.5 * NS_PER_S))
    assert cache.expire(clock.now()) == 2
    assert cache.overlaps([1, 2, 3, 4], clock.now()) == {A: 2}
    clock.set(t0 + 4 * NS_PER_S)
    assert cache.expire(clock.now()) == 2
    assert cache.overlaps([1, 2, 3, 4], clock.now()) == {}


def test_overlap_is_the_common_prefix_from_block_zero() -> None:
    cache, clock = cache_and_clock(120)
    now = clock.now()
    cache.record(A, [1, 2, 3], now)
    cache.record(B, [1, 2, 3, 4, 5], now)
    assert cache.overlaps([1, 2, 3, 4], now) == {A: 3, B: 4}
    assert cache.overlaps([1, 9, 3], now) == {A: 1, B: 1}
    assert cache.overlaps([9, 2, 3], now) == {}  # a prompt differing in block 0
    assert cache.overlaps([2, 3], now) == {}  # keyed by chain, not by block
    assert cache.overlaps([], now) == {}
    assert cache.overlaps([1, 2, 3, 4, 5, 6], now) == {A: 3, B: 5}


def test_signed_and_unsigned_hashes_are_the_same_block() -> None:
    """Blocks are kept signed; a record's u64 hashes convert to the same blocks."""
    cache, clock = cache_and_clock(120)
    cache.record(A, [-1, -2], clock.now())
    assert cache.overlaps(signed_hashes([U64_MAX, U64_MAX - 1]), clock.now()) == {A: 2}


def test_keys_are_the_chained_hashes_dump_shows() -> None:
    """tokens 0..9, bs 4: /dump shows block 1 as 9510318385840434533 under 9143094415614847814."""
    prompt = prompt_from_tokens(list(range(10)), 4)
    cache, clock = cache_and_clock(120)
    cache.record(A, list(prompt.block_hashes), clock.now())
    expires = clock.now() + 120 * NS_PER_S
    s = to_signed  # kept signed; /dump shows them as u64
    assert list(cache.blocks(clock.now())) == [
        CachedBlock(A, 9143094415614847814, None, 9143094415614847814, expires),
        CachedBlock(
            A, s(9510318385840434533), 9143094415614847814, s(12124091508212882195), expires
        ),
    ]
    assert chain_keys(list(prompt.block_hashes)) == list(prompt.sequence_hashes)
    # a token prompt's sequence hashes can be passed as the chain
    assert cache.overlaps(
        list(prompt.block_hashes), clock.now(), chain=prompt.precomputed_chain
    ) == {A: 2}


def test_remove_rank_and_worker() -> None:
    cache, clock = cache_and_clock(120)
    now = clock.now()
    a1 = WorkerWithDpRank(1, 1)
    cache.record(A, [1, 2], now)
    cache.record(a1, [1, 2, 3], now)
    cache.record(B, [1], now)
    assert len(cache) == 6
    assert cache.remove_rank(A) == 2
    assert cache.remove_rank(A) == 0
    assert cache.overlaps([1, 2, 3], now) == {a1: 3, B: 1}
    assert cache.remove_worker(1) == 3
    assert cache.remove_worker(1) == 0
    assert cache.overlaps([1, 2, 3], now) == {B: 1}
    assert len(cache) == 1
    assert cache.ranks() == [B]
    # stale heap entries of removed ranks are skipped by the sweep
    clock.advance(200)
    assert cache.expire(clock.now()) == 1
    assert len(cache) == 0


def test_refreshes_do_not_grow_the_expiry_heap_without_bound() -> None:
    cache, clock = cache_and_clock(120)
    for _ in range(5_000):
        cache.record(A, [1, 2, 3, 4], clock.now())
        clock.advance(0.001)
    assert len(cache) == 4
    assert pending_expiries(cache) <= 2 * len(cache) + 1024
    clock.advance(121)
    assert cache.expire(clock.now()) == 4
    assert pending_expiries(cache) == 0


# -- cost: a lookup does not visit ranks that do not match --------------------------------------


def probes_for_lookup(non_matching_ranks: int) -> int:
    cache, clock = cache_and_clock(120)
    now = clock.now()
    query = list(range(1, 9))
    for i in range(non_matching_ranks):
        cache.record(WorkerWithDpRank(100 + i, 0), [10_000 + i, 2, 3, 4], now)
    cache.record(A, query, now)
    cache.record(B, query[:3], now)
    before = cache.lookup_probes
    assert cache.overlaps(query, now) == {A: 8, B: 3}
    return cache.lookup_probes - before


def test_lookup_work_is_independent_of_non_matching_ranks() -> None:
    # the 8 nodes of the path; A handed out at depth 8 (1); at depth 3 the holders shrink from
    # {A, B} to {A}: that level's 2 ranks are compared; B gets 3
    assert probes_for_lookup(0) == 8 + 1 + 2
    assert probes_for_lookup(10) == probes_for_lookup(0)
    assert probes_for_lookup(2_000) == probes_for_lookup(0)


# -- Hypothesis: the cache equals a dictionary of last-write times -----------------------------

TTL_NS = 2 * NS_PER_S
RANKS = [WorkerWithDpRank(w, d) for w in (1, 2) for d in (0, 1)]
prompts = st.lists(st.integers(1, 3), max_size=6)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.sampled_from(RANKS), prompts),
        # half-second steps, so that lookups land exactly on expiry instants too
        st.tuples(st.just("advance"), st.integers(0, 6).map(lambda n: n * NS_PER_S // 2)),
        st.tuples(st.just("expire")),
        st.tuples(st.just("remove_rank"), st.sampled_from(RANKS)),
        st.tuples(st.just("remove_worker"), st.sampled_from([1, 2])),
    ),
    max_size=40,
)


class NaiveCache:
    def __init__(self) -> None:
        self.last_write: dict[tuple[WorkerWithDpRank, int], int] = {}
        self.parent: dict[int, tuple[int | None, int]] = {}

    def record(self, rank: WorkerWithDpRank, blocks: list[int], now: int) -> None:
        keys = chained_hashes(blocks)
        for i, key in enumerate(keys):
            self.last_write[(rank, key)] = now
            self.parent[key] = (keys[i - 1] if i else None, blocks[i])

    def live(self, rank: WorkerWithDpRank, key: int, now: int) -> bool:
        t = self.last_write.get((rank, key))
        return t is not None and now < t + TTL_NS

    def overlaps(self, blocks: list[int], now: int) -> dict[WorkerWithDpRank, int]:
        keys = chained_hashes(blocks)
        out = {}
        for rank in RANKS:
            n = 0
            while n < len(keys) and self.live(rank, keys[n], now):
                n += 1
            if n:
                out[rank] = n
        return out

    def blocks(self, now: int) -> set[CachedBlock]:
        return {
            CachedBlock(rank, key, *self.parent[key], t + TTL_NS)
            for (rank, key), t in self.last_write.items()
            if now < t + TTL_NS
        }


QUERIES = [[1], [1, 2], [1, 1, 1, 1], [2, 3, 1], [3, 3, 3, 3, 3, 3], [1, 2, 3, 1, 2, 3]]


@settings(max_examples=300, deadline=None)
@given(ops)
def test_matches_a_naive_model(operations) -> None:
    cache, naive, now = ApproximateCache(ttl_ns=TTL_NS), NaiveCache(), 0
    for op in operations:
        kind = op[0]
        if kind == "record":
            cache.record(op[1], op[2], now)
            naive.record(op[1], op[2], now)
        elif kind == "advance":
            now += op[1]
        elif kind == "expire":
            cache.expire(now)
            naive.last_write = {k: t for k, t in naive.last_write.items() if now < t + TTL_NS}
        elif kind == "remove_rank":
            cache.remove_rank(op[1])
            naive.last_write = {k: t for k, t in naive.last_write.items() if k[0] != op[1]}
        else:
            cache.remove_worker(op[1])
            naive.last_write = {
                k: t for k, t in naive.last_write.items() if k[0].worker_id != op[1]
            }
        for q in QUERIES:
            assert cache.overlaps(q, now) == naive.overlaps(q, now)
        listed = list(cache.blocks(now))
        assert set(listed) == naive.blocks(now)
        assert len(listed) == len(set(listed))
        seen: set[tuple[WorkerWithDpRank, int]] = set()
        for b in listed:  # a parent is listed before its children
            assert b.parent_hash is None or (b.worker, b.parent_hash) in seen
            seen.add((b.worker, b.block_hash))
    cache.expire(now)
    assert len(cache) == len(naive.blocks(now))


def test_rejects_negative_ttl() -> None:
    with pytest.raises(ValueError):
        ApproximateCache(ttl_ns=-1)
