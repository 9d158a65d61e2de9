"""The index of real cache contents, against behaviour observed on the reference (1.6.1).

Every scenario here was first run on ``python -m dynamo.select_service`` with KV events on, fed
by a vLLM-format publisher; the numbers are the reference's ``/overlap_scores`` columns
``(device_blocks, host_pinned_extension_blocks, disk_extension_blocks)``.
"""

from __future__ import annotations

from kv_slot_tracker.core.hashing import (
    chained_hashes,
    sequence_hashes_for_tokens,
    to_signed,
    unsigned_hashes,
)
from kv_slot_tracker.core.selection.kv_blocks import (
    DEVICE,
    DISK,
    EXTERNAL,
    HOST_PINNED,
    local_hashes,
    tier_of_medium,
)
from kv_slot_tracker.core.selection.kv_index import KvIndex, TierOverlap
from kv_slot_tracker.core.types import WorkerWithDpRank as W
from tests.support.kv_index import rank_size

BS = 4
TOKENS = list(range(100, 124))  # six blocks of four tokens
LOCAL = local_hashes(TOKENS, BS, 6, BS)
KEYS = sequence_hashes_for_tokens(TOKENS, BS)  # the index's chain keys (signed)
A, B = W(1, 0), W(2, 0)


def blocks(engine: list[int], first: int = 0) -> list[tuple[int, int]]:
    """``(engine hash, local hash)`` of consecutive blocks starting at block ``first``."""
    return [(h, LOCAL[first + i]) for i, h in enumerate(engine)]


def test_local_hashes_are_the_reference_tokens_hashes() -> None:
    # /dump of the reference after BlockStored([11, 12, 13], token_ids 100..111, block_size 4)
    # (as u64; the index keeps them signed)
    assert unsigned_hashes(LOCAL[:3]) == [
        6320977984009303047,
        16988655349664461655,
        6717274780279712737,
    ]
    assert LOCAL[1] == 16988655349664461655 - 2**64
    assert chained_hashes(LOCAL) == KEYS


def test_local_hashes_only_for_the_partition_block_size_and_full_blocks() -> None:
    assert local_hashes(TOKENS, 16, 2, BS) == []  # "Block size must be 4 tokens"
    assert local_hashes(TOKENS[:10], BS, 3, BS) == LOCAL[:2]  # "token_ids too short"
    assert local_hashes(TOKENS, BS, 2, BS) == LOCAL[:2]
    assert local_hashes(TOKENS[:8], BS, 2, BS, "ad1") != LOCAL[:2]  # LoRA changes the seed


def test_store_and_prefix_overlap() -> None:
    ix = KvIndex()
    assert ix.store(A, DEVICE, None, blocks([11, 12, 13]))
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(3)}
    assert ix.overlaps(KEYS[:2], LOCAL[:2]) == {A: TierOverlap(2)}
    assert ix.store(A, DEVICE, 13, blocks([14], 3))
    assert ix.store(B, DEVICE, None, blocks([21]))
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(4), B: TierOverlap(1)}
    assert len(ix) == 5
    # another prompt sharing nothing
    assert ix.overlaps(sequence_hashes_for_tokens(list(range(8)), BS)) == {}


def alt(i: int) -> int:
    """The local hash of a block off the test prompt: tokens ``900 + 4 i ...`` (the probes'
    block ``-i``)."""
    return local_hashes(list(range(900 + 4 * i, 904 + 4 * i)), BS, 1, BS)[0]


def facts(ix: KvIndex) -> list[tuple[int, int, int | None]]:
    """``(worker, block, parent)`` of the device blocks, as the harness reads ``/dump``."""
    return sorted(
        (
            (b.worker.worker_id, b.block_hash, b.parent_hash)
            for b in ix.blocks()
            if b.tier == DEVICE
        ),
        key=lambda f: (f[0], f[1]),
    )


def device(ix: KvIndex, locals_: list[int]) -> dict[int, int]:
    return {w.worker_id: o.device for w, o in ix.overlaps(chained_hashes(locals_)).items()}


def test_removing_a_middle_block_removes_the_rest_of_its_run() -> None:
    # reference: store [1,2,3] (one run), remove 2 -> /dump lists 1 only; store 2 under 1
    # again -> overlap 2; a store under 3 is refused (the rank no longer holds 3)
    ix = KvIndex()
    ix.store(A, DEVICE, None, blocks([1, 2, 3]))
    assert ix.remove(A, DEVICE, [2]) == 2
    assert facts(ix) == [(1, 1, None)]
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(1)}
    assert ix.store(A, DEVICE, 1, blocks([2], 1))
    assert not ix.store(A, DEVICE, 3, blocks([4], 3))
    assert facts(ix) == [(1, 1, None), (1, 2, 1)]
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(2)}
    assert ix.remove(A, DEVICE, [3, 999]) == 0  # unknown hashes are skipped
    assert len(ix) == 2


def test_a_removal_keeps_the_runs_below_while_another_rank_holds_the_run() -> None:
    # reference (select_service 1.6.1), ranks 100 = A and 101 = B:
    #   A: BlockStored [1,2,3] (blocks 0,1,2)          -> one run [1,2,3]
    #   B: BlockStored [1,2];  B: BlockStored [9] (block -3) under 2  -> runs [1,2] | [3], [9]
    #   A: BlockRemoved [2];   A: BlockStored [4] (block 3) under 3
    # /dump: A 1, 3<-2, 4<-3; B 1, 2<-1, 9<-2.  Overlap of blocks 0-3: A 1, B 4 (the reference
    # credits B with A's run [3,4]: the run has as many full holders as there are ranks still
    # matching, so it compares nothing); of blocks 0-1: A 1, B 2.
    ix = KvIndex()
    ix.store(A, DEVICE, None, blocks([1, 2, 3]))
    ix.store(B, DEVICE, None, blocks([1, 2]))
    assert ix.store(B, DEVICE, 2, [(9, alt(3))])
    assert ix.remove(A, DEVICE, [2]) == 1
    assert ix.store(A, DEVICE, 3, blocks([4], 3))
    assert facts(ix) == [(1, 1, None), (1, 3, 2), (1, 4, 3), (2, 1, None), (2, 2, 1), (2, 9, 2)]
    assert device(ix, LOCAL[:4]) == {1: 1, 2: 4}
    assert device(ix, LOCAL[:2]) == {1: 1, 2: 2}
    # and before A's store under 3: blocks 0-2 -> A 1, B 3; blocks 0,1,-3 -> A 1, B 3
    ix2 = KvIndex()
    ix2.store(A, DEVICE, None, blocks([1, 2, 3]))
    ix2.store(B, DEVICE, None, blocks([1, 2]))
    ix2.store(B, DEVICE, 2, [(9, alt(3))])
    ix2.remove(A, DEVICE, [2])
    assert device(ix2, LOCAL[:3]) == {1: 1, 2: 3}
    assert device(ix2, [*LOCAL[:2], alt(3)]) == {1: 1, 2: 3}


def test_a_removal_follows_the_rank_s_own_run_of_each_hash() -> None:
    # reference (select_service 1.6.1), A and B dp ranks 0 and 1 of one worker, engine hashes
    # 1, 2, 3, 4 for blocks 0-3 (salted: other local hashes, so another run of the tree):
    #   A: BlockStored [1,2,3] cache_salt s2     B: BlockStored [1,2,3]
    #   B: BlockStored [1] cache_salt s2         (B's 1 now names the salted run)
    #   B: BlockRemoved [1, 3]                   (1 from the salted run, 3 from B's own run)
    #   B: BlockStored [3,4] under 2             (B still holds 2: stored)
    # /dump: A 1, 2<-1, 3<-2 (salted); B 1, 2<-1, 3<-2, 4<-3.  Overlap of blocks 0-3: A 0, B 4;
    # salted: A 3, B 0.
    salted = local_hashes(TOKENS, BS, 6, BS, cache_salt="s2")
    ix = KvIndex()
    assert ix.store(A, DEVICE, None, [(h, salted[i]) for i, h in enumerate([1, 2, 3])])
    assert ix.store(B, DEVICE, None, blocks([1, 2, 3]))
    assert ix.store(B, DEVICE, None, [(1, salted[0])])
    ix.remove(B, DEVICE, [1, 3])
    assert ix.store(B, DEVICE, 2, blocks([3, 4], 2))
    assert facts(ix) == [
        (1, 1, None),
        (1, 2, 1),
        (1, 3, 2),
        (2, 1, None),
        (2, 2, 1),
        (2, 3, 2),
        (2, 4, 3),
    ]
    assert device(ix, LOCAL[:4]) == {2: 4}
    assert device(ix, salted[:4]) == {1: 3}


def test_a_removal_takes_the_run_of_its_first_hash_by_engine_hash() -> None:
    # reference (select_service 1.6.1), one rank: BlockStored [1,2,3]; BlockStored [1,2]
    # cache_salt s2 (the rank's 1 and 2 now name the salted run); BlockRemoved [3, 1]: 3 names
    # the unsalted run and 1 is in it, so that run goes from 1; the salted run stays.
    # /dump: 1, 2<-1 (salted local hashes). Then BlockStored [5] under 2 (salted): refused, the
    # removal took 1 and 2 out of the rank's lookup (the /dump is unchanged).
    salted = local_hashes(TOKENS, BS, 6, BS, cache_salt="s2")
    ix = KvIndex()
    assert ix.store(A, DEVICE, None, blocks([1, 2, 3]))
    assert ix.store(A, DEVICE, None, [(1, salted[0]), (2, salted[1])])
    ix.remove(A, DEVICE, [3, 1])
    assert [(b.block_hash, b.tokens_hash) for b in ix.blocks()] == [(1, salted[0]), (2, salted[1])]
    assert device(ix, LOCAL[:3]) == {}
    assert device(ix, salted[:3]) == {1: 2}
    assert not ix.store(A, DEVICE, 2, [(5, salted[2])])
    assert [(b.block_hash, b.tokens_hash) for b in ix.blocks()] == [(1, salted[0]), (2, salted[1])]
    assert ix.clear_rank(A) == 0 and list(ix.blocks()) == []  # the clear finds the salted run


def test_a_rank_can_be_credited_with_a_run_it_does_not_hold() -> None:
    # reference: A [1,2]; B [1,2]; B [9] (block -3) under 2; A [3] (block 2) under 2;
    # A removes 1 -> /dump: A 3<-2; B 1, 2<-1, 9<-2; overlap of blocks 0-2: A 0, B 3
    ix = KvIndex()
    ix.store(A, DEVICE, None, blocks([1, 2]))
    ix.store(B, DEVICE, None, blocks([1, 2]))
    ix.store(B, DEVICE, 2, [(9, alt(3))])
    ix.store(A, DEVICE, 2, blocks([3], 2))
    ix.remove(A, DEVICE, [1])
    assert facts(ix) == [(1, 3, 2), (2, 1, None), (2, 2, 1), (2, 9, 2)]
    assert device(ix, LOCAL[:3]) == {2: 3}
    assert device(ix, [*LOCAL[:2], alt(3)]) == {2: 3}


def test_extending_a_shared_leaf_run_leaves_the_other_holders_their_part() -> None:
    # reference: A [1,2]; B [1,2]; B [3] under 2; B removes 2 -> /dump: A 1, 2<-1; B 1;
    # overlap of blocks 0-2: A 2, B 1
    ix = KvIndex()
    ix.store(A, DEVICE, None, blocks([1, 2]))
    ix.store(B, DEVICE, None, blocks([1, 2]))
    ix.store(B, DEVICE, 2, blocks([3], 2))
    assert ix.remove(B, DEVICE, [2]) == 2
    assert facts(ix) == [(1, 1, None), (1, 2, 1), (2, 1, None)]
    assert device(ix, LOCAL[:3]) == {1: 2, 2: 1}


def test_a_run_nobody_holds_whole_loses_its_children() -> None:
    # reference: A [1,2,3]; A [7] (block -3) under 2; A removes 1 -> nothing listed;
    # A [4] under 3 (kept out of reach); A [1,2] again -> /dump: A 1, 2<-1; overlap 0-3: 2
    ix = KvIndex()
    ix.store(A, DEVICE, None, blocks([1, 2, 3]))
    ix.store(A, DEVICE, 2, [(7, alt(3))])
    assert ix.remove(A, DEVICE, [1]) == 2
    assert facts(ix) == []
    ix.store(A, DEVICE, 3, blocks([4], 3))
    ix.store(A, DEVICE, None, blocks([1, 2]))
    assert facts(ix) == [(1, 1, None), (1, 2, 1)]
    assert device(ix, LOCAL[:4]) == {1: 2}
    # the same with 2 removed and then stored again under 1
    ix = KvIndex()
    ix.store(A, DEVICE, None, blocks([1, 2, 3]))
    ix.store(A, DEVICE, 2, [(7, alt(3))])
    assert ix.remove(A, DEVICE, [2]) == 1
    ix.store(A, DEVICE, 1, blocks([2], 1))
    ix.store(A, DEVICE, 3, blocks([4], 3))
    assert facts(ix) == [(1, 1, None), (1, 2, 1)]
    assert device(ix, LOCAL[:4]) == {1: 2}


def test_parent_unknown_or_repeated_hash_stores_nothing() -> None:
    ix = KvIndex()
    assert not ix.store(A, DEVICE, 999, blocks([12], 1))
    assert not ix.store(A, DEVICE, None, [(5, LOCAL[0]), (5, LOCAL[1])])
    assert ix.store(A, DEVICE, None, blocks([11]))
    assert not ix.store(A, DEVICE, 11, blocks([11], 1))  # the parent again
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(1)}
    assert len(ix) == 1


def test_signed_and_unsigned_engine_hashes_are_one_block() -> None:
    """Engine hashes come in either form; the ingest makes them signed (``to_signed``)."""
    ix = KvIndex()
    ix.store(A, DEVICE, None, blocks([to_signed(-5), to_signed(2**64 - 3)]))
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(2)}
    assert ix.remove(A, DEVICE, [to_signed(2**64 - 5)]) == 2  # -5 as u64, and the rest of its run
    assert ix.overlaps(KEYS, LOCAL) == {}


def test_clear_rank_keeps_the_other_ranks() -> None:
    ix = KvIndex()
    a1 = W(1, 1)
    ix.store(A, DEVICE, None, blocks([1, 2]))
    ix.store(a1, DEVICE, None, blocks([1, 2]))
    assert ix.clear_rank(A) == 2
    assert ix.overlaps(KEYS, LOCAL) == {a1: TierOverlap(2)}
    ix.store(A, DEVICE, None, blocks([1]))
    assert ix.remove_worker(1) == 3
    assert ix.overlaps(KEYS, LOCAL) == {} and len(ix) == 0


def test_tiers_extend_the_device_prefix() -> None:
    # reference: GPU [1,2], CPU [3,4] under 2, DISK [5] under 4 -> (2, 4, 5, ext 2, ext 1)
    ix = KvIndex()
    ix.store(A, DEVICE, None, blocks([1, 2]))
    assert ix.store(A, HOST_PINNED, 2, blocks([3, 4], 2))
    assert ix.store(A, DISK, 4, blocks([5], 4))
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(2, 2, 1)}
    # the same blocks again in host memory from block 0 change nothing (the device prefix wins)
    ix.store(A, HOST_PINNED, None, blocks([1, 2, 3]))
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(2, 2, 1)}
    # a rank holding only host blocks: under the same engine hashes it shares A's edges; the
    # same tokens under other hashes are not indexed (the first store of an edge wins)
    ix.store(B, HOST_PINNED, None, blocks([7, 8]))
    assert B not in ix.overlaps(KEYS, LOCAL) and B not in {b.worker for b in ix.blocks()}
    ix.store(B, HOST_PINNED, None, blocks([1, 2]))
    assert ix.overlaps(KEYS, LOCAL)[B] == TierOverlap(0, 2, 0)
    assert ix.remove(A, DEVICE, [1]) == 2  # and 2, stored with it
    assert ix.overlaps(KEYS, LOCAL)[A] == TierOverlap(0, 4, 1)


def test_medium_names() -> None:
    assert [tier_of_medium(m) for m in (None, "GPU", "CPU", "CPU_PINNED", "DISK", "NVME")] == [
        DEVICE, DEVICE, HOST_PINNED, HOST_PINNED, DISK, DISK,
    ]  # fmt: skip
    assert [tier_of_medium(m) for m in ("STORAGE", "CPU_TIER2", "EXTERNAL", "SHARED")] == [
        DISK, DISK, EXTERNAL, EXTERNAL,
    ]  # fmt: skip
    assert tier_of_medium("NVME_XYZ") is None  # not a tier: the event is skipped
    assert tier_of_medium("gpu") is None  # names are case-sensitive


def test_lookup_cost_does_not_grow_with_unrelated_ranks() -> None:
    ix = KvIndex()
    for wid in range(1000):
        ix.store(W(wid + 10, 0), DEVICE, None, [(1, 12345 + wid)])
    ix.store(A, DEVICE, None, blocks([11, 12, 13, 14, 15, 16]))
    before = ix.lookup_probes
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(6)}
    assert ix.lookup_probes - before == 6 + 1
    ix.store(B, DEVICE, None, blocks([21, 22]))
    before = ix.lookup_probes
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(6), B: TierOverlap(2)}
    assert ix.lookup_probes - before == 6 + 1  # B holds a prefix of A's run: no extra step


def test_a_removed_middle_block_credits_no_other_rank() -> None:
    # reference: rank 0 stores [11,12,13], rank 1 [11,12]; rank 0 removes 12 -> (1, 2), not 3
    ix = KvIndex()
    a1 = W(1, 1)
    ix.store(A, DEVICE, None, blocks([11, 12, 13]))
    ix.store(a1, DEVICE, None, blocks([11, 12]))
    ix.remove(A, DEVICE, [12])
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(1), a1: TierOverlap(2)}
    assert ix.overlaps(KEYS[:1], LOCAL[:1]) == {A: TierOverlap(1), a1: TierOverlap(1)}


def test_tier_rules_for_parents_removals_and_clears() -> None:
    # reference: a device store under a host-only parent is refused; a host store under a
    # device parent is taken; removing a device block leaves host blocks stored under it; a host
    # removal takes only the named block; AllBlocksCleared empties every tier
    ix = KvIndex()
    ix.store(A, HOST_PINNED, None, blocks([1, 2]))
    assert not ix.store(A, DEVICE, 2, blocks([3], 2))
    # a host store under a parent held nowhere is kept, but no prompt reaches it
    assert ix.store(B, HOST_PINNED, 999, blocks([6], 1))
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(0, 2, 0)}
    assert ix.remove(B, HOST_PINNED, [6]) == 1
    ix.store(B, DEVICE, None, blocks([1, 2]))
    assert ix.store(B, HOST_PINNED, 2, blocks([3], 2))
    assert ix.remove(B, DEVICE, [2]) == 1
    assert [(b.tier, b.block_hash) for b in ix.blocks() if b.worker == B] == [
        (DEVICE, 1), (HOST_PINNED, 3),
    ]  # fmt: skip
    ix.store(A, HOST_PINNED, 2, blocks([3, 4], 2))
    assert ix.remove(A, HOST_PINNED, [2]) == 1
    assert [b.block_hash for b in ix.blocks() if b.worker == A] == [1, 3, 4]
    assert ix.clear_rank(A) == 3


def test_after_a_pruning_clear_new_hashes_index_the_same_tokens() -> None:
    """An engine restarted stores the same tokens under new engine hashes. A clear that prunes
    (this service's own: a publisher restarting from 0, a rank leaving) drops the runs nobody
    holds, so the new chain is indexed whole, in two stores or one."""
    for split in (True, False):
        ix = KvIndex()
        assert ix.store(A, DEVICE, None, blocks([1])) and ix.store(A, DEVICE, 1, blocks([2], 1))
        assert ix.store(A, DEVICE, 1, [(3, LOCAL[3])])  # other tokens: the run splits after 1
        assert ix.clear_rank(A, prune=True) == 3
        if split:
            assert ix.store(A, DEVICE, None, blocks([50]))
            assert ix.store(A, DEVICE, 50, blocks([51], 1))
        else:
            assert ix.store(A, DEVICE, None, blocks([50, 51]))
        assert rank_size(ix, A) == 2
        assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(2)}
        assert [c.blocks for c in ix.device_runs()] == [tuple(blocks([50, 51]))]
        assert ix.remove(A, DEVICE, [51]) == 1 and ix.store(A, DEVICE, 50, blocks([52], 1))
        assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(2)}


def test_without_pruning_a_cleared_run_takes_new_hashes_as_the_reference() -> None:
    """``AllBlocksCleared`` (no pruning), as the reference (1.6.1): the run stays, a store of
    the same tokens under new hashes joins it (``/dump`` shows the old hash) and a store under
    the new hash is refused (stale parent); one store of both blocks joins the whole run."""
    ix = KvIndex()
    assert ix.store(A, DEVICE, None, blocks([1])) and ix.store(A, DEVICE, 1, blocks([2], 1))
    ix.clear_rank(A)
    assert ix.store(A, DEVICE, None, blocks([50]))
    assert ix.store(A, DEVICE, 50, blocks([51], 1)) is False
    assert rank_size(ix, A) == 1 and ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(1)}
    assert [c.blocks for c in ix.device_runs()] == [tuple(blocks([1]))]
    ix.clear_rank(A)
    assert ix.store(A, DEVICE, None, blocks([50, 51]))
    assert [c.blocks for c in ix.device_runs()] == [tuple(blocks([1, 2]))]


def test_a_pruning_clear_keeps_a_run_another_rank_holds() -> None:
    """As the reference: while B holds the old run the restarted rank joins it and stops."""
    ix = KvIndex()
    for w in (A, B):
        assert ix.store(w, DEVICE, None, blocks([1])) and ix.store(w, DEVICE, 1, blocks([2], 1))
    ix.clear_rank(A, prune=True)
    assert ix.store(A, DEVICE, None, blocks([50]))
    assert ix.store(A, DEVICE, 50, blocks([51], 1)) is False
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(1), B: TierOverlap(2)}
    # B keeps only a prefix of the run: the rest nobody holds is dropped with A's clear
    ix.clear_rank(A, prune=True)
    assert ix.remove(B, DEVICE, [2]) == 1
    ix.clear_rank(A, prune=True)
    assert ix.store(A, DEVICE, None, blocks([50]))
    assert ix.store(A, DEVICE, 50, blocks([51], 1)) is False  # B's first block: stale parent
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(1), B: TierOverlap(1)}


def test_a_worker_removed_and_back_indexes_new_hashes() -> None:
    """A worker leaving prunes (this service's own; the reference keeps the runs there too)."""
    ix = KvIndex()
    assert ix.store(A, DEVICE, None, blocks([1, 2]))
    assert ix.remove_worker(A.worker_id) == 2
    assert ix.store(A, DEVICE, None, blocks([50])) and ix.store(A, DEVICE, 50, blocks([51], 1))
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(2)}


class NaiveIndex:
    """The same rules, written as plainly as possible: device blocks per rank as engine hash ->
    (chain key, parent); host, disk and external blocks as the reference's shared edges
    ``(parent engine hash, local hash) -> (engine hash, ranks)``; every read scans everything.
    (Device removals, whose effect depends on how the reference's tree groups blocks into runs,
    are left to the tests above.)"""

    def __init__(self) -> None:
        self.maps: dict[W, list[dict[int, tuple]]] = {}
        self.edges: list[dict[tuple[int | None, int], tuple[int, set[W]]]] = [{}, {}, {}, {}]

    def store(self, w: W, tier: int, parent: int | None, blks: list[tuple[int, int]]) -> bool:
        hashes = [h for h, _ in blks]
        if len(set(hashes)) != len(hashes) or parent in hashes:
            return False
        maps = self.maps.setdefault(w, [{}, {}, {}, {}])
        if tier != DEVICE:
            prev = parent
            for h, local in blks:
                key = (prev, local)
                if h in maps[tier] and maps[tier][h] != key:
                    break
                edge = self.edges[tier].get(key)
                if edge is not None and edge[0] != h:
                    break  # another rank stored these tokens under other hashes first
                self.edges[tier].setdefault(key, (h, set()))[1].add(w)
                maps[tier][h] = key
                prev = h
            return True
        pkey = None
        if parent is not None:
            if parent not in maps[DEVICE]:
                return False
            pkey = maps[DEVICE][parent][0]
        for h, local in blks:
            ck = chained_hashes([local])[0] if pkey is None else (
                chained_hashes([pkey, local])[1]
            )  # fmt: skip
            maps[DEVICE][h] = (ck, parent)
            pkey, parent = ck, h
        return True

    def remove(self, w: W, tier: int, hashes: list[int]) -> None:
        maps = self.maps.get(w)
        if maps is None:
            return
        assert tier != DEVICE
        for h in hashes:
            key = maps[tier].pop(h, None)
            if key is not None:
                self._unhold(tier, key, w)

    def _unhold(self, tier: int, key: tuple, w: W) -> None:
        owners = self.edges[tier][key][1]
        owners.discard(w)
        if not owners:
            del self.edges[tier][key]

    def clear(self, w: W) -> None:
        maps = self.maps.pop(w, None)
        for tier in (HOST_PINNED, DISK, EXTERNAL):
            for key in (maps or [{}] * 4)[tier].values():
                self._unhold(tier, key, w)

    def overlaps(self, keys: list[int], local: list[int]) -> dict[W, TierOverlap]:
        conts: dict[W, tuple[int, int | None]] = {}
        for w, maps in self.maps.items():
            by_key = {k: h for h, (k, _) in maps[DEVICE].items()}
            d = 0
            while d < len(keys) and keys[d] in by_key:
                d += 1
            if d:
                conts[w] = (d, by_key[keys[d - 1]])
        device = {w: d for w, (d, _) in conts.items()}
        hits = {w: [0, 0] for w in self.maps}
        for tier in (HOST_PINNED, DISK, EXTERNAL):
            edges = self.edges[tier]
            if not edges:
                continue
            for w in edges.get((None, local[0]), (0, set()))[1]:
                conts.setdefault(w, (0, None))
            for w, (pos, last) in list(conts.items()):
                p = pos
                while p < len(local) and w in edges.get((last, local[p]), (0, set()))[1]:
                    last = edges[last, local[p]][0]
                    p += 1
                if p > pos:
                    conts[w] = (p, last)
                    hits[w][tier != HOST_PINNED] += p - pos
        out = {}
        for w, (h, lower) in hits.items():
            d = device.get(w, 0)
            if d or h or lower:
                out[w] = TierOverlap(d, h, lower)
        return out


def engine(prompt: int, depth: int) -> int:
    """The engine hash of a block of the two test prompts (they share their first two blocks)."""
    return 1000 * (prompt if depth >= 2 else 0) + depth + 1


def test_random_operations_agree_with_a_naive_model() -> None:
    import random

    for seed in range(150):
        rng = random.Random(seed)
        fast, slow = KvIndex(), NaiveIndex()
        ranks = [W(1, 0), W(1, 1), W(2, 0)]
        prompts = [TOKENS, TOKENS[:8] + list(range(500, 516))]
        local = [local_hashes(p, BS, 6, BS) for p in prompts]
        for _ in range(40):
            w, tier = rng.choice(ranks), rng.choice([DEVICE, DEVICE, HOST_PINNED, DISK, EXTERNAL])
            roll = rng.random()
            if roll < 0.6:
                p = rng.randrange(2)
                start = rng.randrange(6)
                n = rng.randrange(1, 7 - start)
                # engine hashes: content-addressed (same prefix, same hash), as vLLM's; rank
                # (1, 1) sometimes stores host, disk and external blocks under other hashes
                # (another seed: the same tokens), which the first store of an edge shuts out
                salt = 7 if w == W(1, 1) and tier != DEVICE and rng.random() < 0.5 else 0
                blks = [(engine(p, start + i) + salt, local[p][start + i]) for i in range(n)]
                parent = engine(p, start - 1) + salt if start else None
                assert fast.store(w, tier, parent, blks) == slow.store(w, tier, parent, blks)
            elif roll < 0.9:
                tier = rng.choice([HOST_PINNED, DISK, EXTERNAL])
                hashes = [engine(rng.randrange(2), rng.randrange(6)) for _ in range(2)]
                fast.remove(w, tier, hashes)
                slow.remove(w, tier, hashes)
            else:
                # pruning or not: the model's ranks store one content under one set of hashes
                fast.clear_rank(w, prune=rng.random() < 0.5)
                slow.clear(w)
            for p in range(2):
                keys = chained_hashes(local[p])
                assert fast.overlaps(keys, local[p]) == slow.overlaps(keys, local[p]), seed
        assert len(fast) == sum(len(m) for maps in slow.maps.values() for m in maps)


def test_a_host_block_stays_where_it_was_first_stored() -> None:
    # reference: CPU [5] (block 2) under 999, held nowhere; then CPU [1,2,5,6] (blocks 0-3) from
    # block 0 -> /dump: 1, 2<-1, 5<-999 (5 keeps its parent, and the walk stops: 6 is not kept);
    # a store repeating blocks in their places adds the new ones (CPU [1,2], then [1,2,3])
    ix = KvIndex()
    ix.store(A, HOST_PINNED, 999, blocks([5], 2))
    ix.store(A, HOST_PINNED, None, blocks([1, 2, 5, 6]))
    assert sorted((b.block_hash, b.parent_hash) for b in ix.blocks()) == [
        (1, None), (2, 1), (5, 999),
    ]  # fmt: skip
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(0, 2, 0)}
    ix = KvIndex()
    ix.store(A, HOST_PINNED, None, blocks([1, 2]))
    ix.store(A, HOST_PINNED, None, blocks([1, 2, 3]))
    assert sorted((b.block_hash, b.parent_hash) for b in ix.blocks()) == [
        (1, None), (2, 1), (3, 2),
    ]  # fmt: skip
    assert len(ix) == 3


def test_long_runs_and_hashes_equal_to_other_fields() -> None:
    # a run longer than the searched length keeps an index; it must agree with the search
    toks = list(range(1000, 1000 + 4 * 100))
    loc = local_hashes(toks, BS, 100, BS)
    keys = chained_hashes(loc)
    ix = KvIndex()
    ix.store(A, DEVICE, None, [(5000 + i, loc[i]) for i in range(100)])
    ix.store(B, DEVICE, None, [(5000 + i, loc[i]) for i in range(70)])
    assert ix.store(A, DEVICE, 5069, [(9000, alt(1))])  # splits the run after block 69
    assert ix.remove(A, DEVICE, [5080]) == 20  # the rest of its run: blocks 80-99
    assert device(ix, loc) == {1: 80, 2: 70}
    # blocks 30-69; B still holds 0-69 whole, so 70-79 and 9000 stay listed below them
    assert ix.remove(A, DEVICE, [5030]) == 40
    assert device(ix, loc) == {1: 30, 2: 70}
    assert ix.overlaps(keys[:30]) == {A: TierOverlap(30), B: TierOverlap(30)}
    assert (1, 9000, 5069) in facts(ix) and (1, 5075, 5074) in facts(ix)
    assert len(ix) == 30 + 10 + 1 + 70
    # an engine hash equal to another block's local hash or chain key is found as the hash
    ix = KvIndex()
    # (block 1's engine hash is block 0's local hash, block 2's is block 1's chain key)
    assert ix.store(A, DEVICE, None, [(111, LOCAL[0]), (LOCAL[0], LOCAL[1]), (KEYS[1], LOCAL[2])])
    assert ix.remove(A, DEVICE, [KEYS[1]]) == 1
    assert ix.remove(A, DEVICE, [LOCAL[0]]) == 1
    assert facts(ix) == [(1, 111, None)]


def test_a_rank_dumped_and_loaded_elsewhere_answers_the_same() -> None:
    import random

    rng = random.Random(7)
    src = KvIndex()
    assert src.store(A, DEVICE, None, blocks([11, 12, 13, 14]))
    assert src.store(A, HOST_PINNED, 14, blocks([15, 16], 4))
    assert src.store(A, DISK, 999, blocks([17], 5))  # parent unknown: an orphan, kept
    assert src.store(B, DEVICE, None, blocks([21, 22]))
    assert src.store(A, DEVICE, 11, blocks([31], 1))  # a second child of block 0
    other = TOKENS[:4] + TOKENS[8:12]
    prompts = [
        (KEYS, LOCAL),
        (KEYS[:3], LOCAL[:3]),
        (sequence_hashes_for_tokens(other, BS), local_hashes(other, BS, 2, BS)),
    ]
    want = [src.overlaps(*p) for p in prompts]
    assert want[0] == {A: TierOverlap(4, 2, 0), B: TierOverlap(2)}
    for order in range(4):  # in dump order, then shuffled: each block waits for its parent
        dst = KvIndex()
        by_rank = src.entries_by_rank()
        assert set(by_rank) == {A, B}
        for w in (A, B):
            entries = by_rank[w]
            if order:
                rng.shuffle(entries)
            assert dst.load_rank(w, entries) == 0
        assert [dst.overlaps(*p) for p in prompts] == want
        assert sorted(dst.blocks(), key=repr) == sorted(src.blocks(), key=repr)


def test_loading_refuses_device_blocks_whose_parent_never_comes() -> None:
    ix = KvIndex()
    entries = [(DEVICE, 12, 11, LOCAL[1]), (DEVICE, 11, None, LOCAL[0]), (DEVICE, 40, 41, 5),
               (HOST_PINNED, 50, 51, 6), (DEVICE, 60, 61, 7), (DEVICE, 61, 60, 8)]  # fmt: skip
    assert ix.load_rank(A, entries) == 3  # 40 (no parent), 60 and 61 (a cycle)
    assert ix.overlaps(KEYS, LOCAL) == {A: TierOverlap(2)}
    assert rank_size(ix, A) == 3  # 11, 12 and the host orphan 50


def test_maps_that_lost_most_of_their_blocks_give_their_tables_back() -> None:
    """A dict keeps its table after deletions: a rank's maps (device ``engine hash -> run``,
    host ``engine hash -> entry``) and the host holders that grew during a burst of stores and
    then lost most of their blocks are copied right-sized, so the memory follows the blocks
    still indexed."""
    import tracemalloc

    chains = [[(10_000_000 + 8 * c + i, 5_000_000 + 8 * c + i) for i in range(8)]
              for c in range(2_000)]  # fmt: skip
    host = [(20_000_000 + i, 6_000_000 + i) for i in range(16_000)]
    tracemalloc.start()
    try:
        ix = KvIndex()
        start = tracemalloc.get_traced_memory()[0]
        for chain in chains:
            assert ix.store(A, DEVICE, None, chain)
        assert ix.store(A, HOST_PINNED, None, host)
        stored = tracemalloc.get_traced_memory()[0] - start
        for chain in chains[1:]:  # evicted, one event per prompt
            assert ix.remove(A, DEVICE, [h for h, _ in chain]) == 8
        assert ix.remove(A, HOST_PINNED, [h for h, _ in host[8:]]) == 16_000 - 8
        left = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert rank_size(ix, A) == len(ix) == 16
    assert left < 0.4 * stored, (left, stored)  # 0.49 without the copies
    # what is left still answers: the first chain, and the host blocks' first eight
    keys = chained_hashes([local for _, local in chains[0]])
    assert ix.overlaps(keys) == {A: TierOverlap(8)}
    assert ix.store(A, HOST_PINNED, host[7][0], [host[8]])  # its parent is still held
