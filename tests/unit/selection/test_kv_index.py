"""The index of real cache contents, against behaviour observed on the reference (1.6.1).

Every scenario here was first run on ``python -m dynamo.select_service`` with KV events on, fed
by a vLLM-format publisher; the numbers are the reference's ``/overlap_scores`` columns
``(device_blocks, host_pinned_extension_blocks, disk_extension_blocks)``.
"""

from __future__ import annotations

from kv_slot_tracker.core.hashing import compute_seq_hash_for_block, sequence_hashes_for_tokens
from kv_slot_tracker.core.selection.kv_index import (
    DEVICE,
    DISK,
    HOST_PINNED,
    KvIndex,
    TierOverlap,
    local_hashes,
    orphan_key,
    tier_of_medium,
)
from kv_slot_tracker.core.types import WorkerWithDpRank as W

BS = 4
TOKENS = list(range(100, 124))  # six blocks of four tokens
LOCAL = local_hashes(TOKENS, BS, 6, BS)
KEYS = sequence_hashes_for_tokens(TOKENS, BS)
A, B = W(1, 0), W(2, 0)


def blocks(engine: list[int], first: int = 0) -> list[tuple[int, int]]:
    """``(engine hash, local hash)`` of consecutive blocks starting at block ``first``."""
    return [(h, LOCAL[first + i]) for i, h in enumerate(engine)]


def test_local_hashes_are_the_reference_tokens_hashes() -> None:
    # /dump of the reference after BlockStored([11, 12, 13], token_ids 100..111, block_size 4)
    assert LOCAL[:3] == [6320977984009303047, 16988655349664461655, 6717274780279712737]
    assert compute_seq_hash_for_block(LOCAL) == KEYS


def test_local_hashes_only_for_the_partition_block_size_and_full_blocks() -> None:
    assert local_hashes(TOKENS, 16, 2, BS) == []  # "Block size must be 4 tokens"
    assert local_hashes(TOKENS[:10], BS, 3, BS) == LOCAL[:2]  # "token_ids too short"
    assert local_hashes(TOKENS, BS, 2, BS) == LOCAL[:2]
    assert local_hashes(TOKENS[:8], BS, 2, BS, "ad1") != LOCAL[:2]  # LoRA changes the seed


def test_store_and_prefix_overlap() -> None:
    ix = KvIndex()
    assert ix.store(A, DEVICE, None, blocks([11, 12, 13]))
    assert ix.overlaps(KEYS) == {A: TierOverlap(3)}
    assert ix.overlaps(KEYS[:2]) == {A: TierOverlap(2)}
    assert ix.store(A, DEVICE, 13, blocks([14], 3))
    assert ix.store(B, DEVICE, None, blocks([21]))
    assert ix.overlaps(KEYS) == {A: TierOverlap(4), B: TierOverlap(1)}
    assert len(ix) == 5
    # another prompt sharing nothing
    assert ix.overlaps(sequence_hashes_for_tokens(list(range(8)), BS)) == {}


def test_removing_a_middle_block_removes_what_the_rank_stored_under_it() -> None:
    # reference: store [1,2,3], remove 2 -> /dump lists 1 only; store 2 again -> overlap 2;
    # a store under 3 is then refused (its parent is gone)
    ix = KvIndex()
    ix.store(A, DEVICE, None, blocks([1, 2, 3]))
    ix.store(A, DEVICE, 2, [(7, LOCAL[4])])  # a branch under 2
    assert ix.remove(A, DEVICE, [2]) == 3
    assert ix.overlaps(KEYS) == {A: TierOverlap(1)}
    assert [(b.block_hash, b.parent_hash) for b in ix.blocks()] == [(1, None)]
    assert ix.store(A, DEVICE, 1, blocks([2], 1))
    assert ix.overlaps(KEYS) == {A: TierOverlap(2)}
    assert not ix.store(A, DEVICE, 3, blocks([4], 3))
    assert ix.remove(A, DEVICE, [3, 999]) == 0  # unknown hashes are skipped
    assert len(ix) == 2


def test_parent_unknown_or_repeated_hash_stores_nothing() -> None:
    ix = KvIndex()
    assert not ix.store(A, DEVICE, 999, blocks([12], 1))
    assert not ix.store(A, DEVICE, None, [(5, LOCAL[0]), (5, LOCAL[1])])
    assert ix.store(A, DEVICE, None, blocks([11]))
    assert not ix.store(A, DEVICE, 11, blocks([11], 1))  # the parent again
    assert ix.overlaps(KEYS) == {A: TierOverlap(1)}
    assert len(ix) == 1


def test_signed_and_unsigned_engine_hashes_are_one_block() -> None:
    ix = KvIndex()
    ix.store(A, DEVICE, None, blocks([-5, 2**64 - 3]))
    assert ix.overlaps(KEYS) == {A: TierOverlap(2)}
    assert ix.remove(A, DEVICE, [2**64 - 5]) == 2  # -5 as u64, and its child
    assert ix.overlaps(KEYS) == {}


def test_clear_rank_keeps_the_other_ranks() -> None:
    ix = KvIndex()
    a1 = W(1, 1)
    ix.store(A, DEVICE, None, blocks([1, 2]))
    ix.store(a1, DEVICE, None, blocks([1, 2]))
    assert ix.clear_rank(A) == 2
    assert ix.overlaps(KEYS) == {a1: TierOverlap(2)}
    ix.store(A, DEVICE, None, blocks([1]))
    assert ix.remove_worker(1) == 3
    assert ix.overlaps(KEYS) == {} and len(ix) == 0


def test_tiers_extend_the_device_prefix() -> None:
    # reference: GPU [1,2], CPU [3,4] under 2, DISK [5] under 4 -> (2, 4, 5, ext 2, ext 1)
    ix = KvIndex()
    ix.store(A, DEVICE, None, blocks([1, 2]))
    assert ix.store(A, HOST_PINNED, 2, blocks([3, 4], 2))
    assert ix.store(A, DISK, 4, blocks([5], 4))
    assert ix.overlaps(KEYS) == {A: TierOverlap(2, 2, 1)}
    # the same blocks again in host memory from block 0 change nothing (the device prefix wins)
    ix.store(A, HOST_PINNED, None, blocks([1, 2, 3]))
    assert ix.overlaps(KEYS) == {A: TierOverlap(2, 2, 1)}
    # a rank holding only host blocks
    ix.store(B, HOST_PINNED, None, blocks([7, 8]))
    assert ix.overlaps(KEYS)[B] == TierOverlap(0, 2, 0)
    assert ix.remove(A, DEVICE, [1]) == 2  # and 2, stored under it
    assert ix.overlaps(KEYS)[A] == TierOverlap(0, 4, 1)


def test_medium_names() -> None:
    assert [tier_of_medium(m) for m in (None, "GPU", "CPU", "CPU_PINNED", "DISK", "NVME")] == [
        DEVICE, DEVICE, HOST_PINNED, HOST_PINNED, DISK, DISK,
    ]  # fmt: skip
    assert tier_of_medium("EXTERNAL") is None
    assert tier_of_medium("whatever") == DEVICE


def test_lookup_cost_does_not_grow_with_unrelated_ranks() -> None:
    ix = KvIndex()
    for wid in range(1000):
        ix.store(W(wid + 10, 0), DEVICE, None, [(1, 12345 + wid)])
    ix.store(A, DEVICE, None, blocks([11, 12, 13, 14, 15, 16]))
    before = ix.lookup_probes
    assert ix.overlaps(KEYS) == {A: TierOverlap(6)}
    assert ix.lookup_probes - before == 6 + 1
    ix.store(B, DEVICE, None, blocks([21, 22]))
    before = ix.lookup_probes
    assert ix.overlaps(KEYS) == {A: TierOverlap(6), B: TierOverlap(2)}
    assert ix.lookup_probes - before == 6 + 2 + 1


def test_a_removed_middle_block_credits_no_other_rank() -> None:
    # reference: rank 0 stores [11,12,13], rank 1 [11,12]; rank 0 removes 12 -> (1, 2), not 3
    ix = KvIndex()
    a1 = W(1, 1)
    ix.store(A, DEVICE, None, blocks([11, 12, 13]))
    ix.store(a1, DEVICE, None, blocks([11, 12]))
    ix.remove(A, DEVICE, [12])
    assert ix.overlaps(KEYS) == {A: TierOverlap(1), a1: TierOverlap(2)}
    assert ix.overlaps(KEYS[:1]) == {A: TierOverlap(1), a1: TierOverlap(1)}


def test_tier_rules_for_parents_removals_and_clears() -> None:
    # reference: a device store under a host-only parent is refused; a host store under a
    # device parent is taken; removing a device block leaves host blocks stored under it; a host
    # removal takes only the named block; AllBlocksCleared empties every tier
    ix = KvIndex()
    ix.store(A, HOST_PINNED, None, blocks([1, 2]))
    assert not ix.store(A, DEVICE, 2, blocks([3], 2))
    # a host store under a parent held nowhere is kept, but no prompt reaches it
    assert ix.store(B, HOST_PINNED, 999, blocks([6], 1))
    assert ix.overlaps(KEYS) == {A: TierOverlap(0, 2, 0)}
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


class NaiveIndex:
    """The same rules, written as plainly as possible: per rank and tier, engine hash -> (chain
    key, parent); every read scans everything."""

    def __init__(self) -> None:
        self.maps: dict[W, list[dict[int, tuple[int, int | None]]]] = {}

    def store(self, w: W, tier: int, parent: int | None, blks: list[tuple[int, int]]) -> bool:
        hashes = [h for h, _ in blks]
        if len(set(hashes)) != len(hashes) or parent in hashes:
            return False
        maps = self.maps.get(w)
        pkey = None
        if parent is not None:
            tiers = [tier] if tier == DEVICE else [tier, DEVICE, HOST_PINNED, DISK]
            found = [maps[t][parent][0] for t in tiers if maps and parent in maps[t]]
            if not found and tier == DEVICE:
                return False
            pkey = found[0] if found else orphan_key(parent)
        maps = self.maps.setdefault(w, [{}, {}, {}])
        prev = parent
        for h, local in blks:
            pkey = compute_seq_hash_for_block([local])[0] if pkey is None else (
                compute_seq_hash_for_block([pkey, local])[1]
            )  # fmt: skip
            maps[tier][h] = (pkey, prev)
            prev = h
        return True

    def remove(self, w: W, tier: int, hashes: list[int]) -> None:
        maps = self.maps.get(w)
        if maps is None:
            return
        for h in hashes:
            if h not in maps[tier]:
                continue
            gone = [h]
            while gone:
                b = gone.pop()
                if maps[tier].pop(b, None) is not None and tier == DEVICE:
                    gone += [c for c, (_, p) in maps[tier].items() if p == b]

    def overlaps(self, keys: list[int]) -> dict[W, TierOverlap]:
        out = {}
        for w, maps in self.maps.items():
            held = [{k for k, _ in m.values()} for m in maps]
            i = 0
            while i < len(keys) and keys[i] in held[DEVICE]:
                i += 1
            d = i
            while i < len(keys) and keys[i] in held[HOST_PINNED]:
                i += 1
            h = i - d
            while i < len(keys) and keys[i] in held[DISK]:
                i += 1
            if i:
                out[w] = TierOverlap(d, h, i - d - h)
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
            w, tier = rng.choice(ranks), rng.choice([DEVICE, DEVICE, HOST_PINNED, DISK])
            roll = rng.random()
            if roll < 0.6:
                p = rng.randrange(2)
                start = rng.randrange(6)
                n = rng.randrange(1, 7 - start)
                # engine hashes: content-addressed (same prefix, same hash), as vLLM's
                blks = [(engine(p, start + i), local[p][start + i]) for i in range(n)]
                parent = engine(p, start - 1) if start else None
                assert fast.store(w, tier, parent, blks) == slow.store(w, tier, parent, blks)
            elif roll < 0.9:
                hashes = [engine(rng.randrange(2), rng.randrange(6)) for _ in range(2)]
                fast.remove(w, tier, hashes)
                slow.remove(w, tier, hashes)
            else:
                fast.clear_rank(w)
                slow.maps.pop(w, None)
            for p in range(2):
                keys = compute_seq_hash_for_block(local[p])
                assert fast.overlaps(keys) == slow.overlaps(keys), seed
        assert len(fast) == sum(len(m) for maps in slow.maps.values() for m in maps)


def test_a_rank_dumped_and_loaded_elsewhere_answers_the_same() -> None:
    import random

    rng = random.Random(7)
    src = KvIndex()
    assert src.store(A, DEVICE, None, blocks([11, 12, 13, 14]))
    assert src.store(A, HOST_PINNED, 14, blocks([15, 16], 4))
    assert src.store(A, DISK, 999, blocks([17], 5))  # parent unknown: an orphan, kept
    assert src.store(B, DEVICE, None, blocks([21, 22]))
    assert src.store(A, DEVICE, 11, blocks([31], 1))  # a second child of block 0
    prompts = [KEYS, KEYS[:3], sequence_hashes_for_tokens(TOKENS[:4] + TOKENS[8:12], BS)]
    want = [src.overlaps(p) for p in prompts]
    for order in range(4):  # in dump order, then shuffled: each block waits for its parent
        dst = KvIndex()
        for w in (A, B):
            entries = src.rank_entries(w)
            if order:
                rng.shuffle(entries)
            assert dst.load_rank(w, entries) == 0
        assert [dst.overlaps(p) for p in prompts] == want
        assert sorted(dst.blocks(), key=repr) == sorted(src.blocks(), key=repr)
        assert len(dst) == len(src) == 10


def test_loading_refuses_device_blocks_whose_parent_never_comes() -> None:
    ix = KvIndex()
    entries = [(DEVICE, 12, 11, LOCAL[1]), (DEVICE, 11, None, LOCAL[0]), (DEVICE, 40, 41, 5),
               (HOST_PINNED, 50, 51, 6), (DEVICE, 60, 61, 7), (DEVICE, 61, 60, 8)]  # fmt: skip
    assert ix.load_rank(A, entries) == 3  # 40 (no parent), 60 and 61 (a cycle)
    assert ix.overlaps(KEYS) == {A: TierOverlap(2)}
    assert ix.rank_size(A) == 3  # 11, 12 and the host orphan 50
