"""A large batch applied in slices leaves the index exactly as the whole batch would.

The service's own sink (``KvEvents``) over a real ``KvIndex``; random batches of chained stores
(device and host tiers), removals and clears, applied once whole and once cut in slices of a
few blocks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kv_slot_tracker.core.selection.kv_index import KvIndex
from kv_slot_tracker.ingest.records import AllCleared, BlocksRemoved, BlocksStored, KvBatch
from kv_slot_tracker.ingest.slices import apply_in_slices, batch_blocks
from kv_slot_tracker.service.selection.kv_events import KvEvents

BS = 4


@dataclass
class Part:
    block_size: int = BS
    index: KvIndex = field(default_factory=KvIndex)


class Placed:
    def __init__(self) -> None:
        self.part = Part()
        self.partitions = {("m", "g"): self.part}

    def placed_partition(self, worker_id: int) -> Part:
        return self.part


def sink() -> tuple[KvEvents, KvIndex]:
    placed = Placed()
    return KvEvents(placed, enabled=True), placed.part.index  # type: ignore[arg-type]


def random_batch(rng: random.Random) -> KvBatch:
    events: list = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        if kind < 0.6:
            n = rng.randint(1, 40)
            start = rng.randint(0, 30)
            hashes = tuple(rng.sample(range(1, 120), n)) if rng.random() < 0.8 else (5,) * n
            parent = None if start == 0 or rng.random() < 0.3 else rng.randint(1, 119)
            tokens = tuple(rng.randint(0, 30) for _ in range(n * BS - rng.choice((0, 0, 2))))
            tier = rng.choice((0, 0, 0, 1, 2))
            events.append(BlocksStored(hashes, parent, tokens, BS, tier, None))
        elif kind < 0.9:
            n = rng.randint(1, 30)
            events.append(BlocksRemoved(tuple(rng.sample(range(1, 120), n)), rng.choice((0, 1))))
        else:
            events.append(AllCleared())
    return KvBatch(0, None, tuple(events))


class Recording:
    """The sink, with the size of every call it gets."""

    def __init__(self, inner: KvEvents) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    @property
    def stores_refused(self) -> int:
        return self.inner.stores_refused

    def apply_kv_batch(self, worker_id: int, dp_rank: int, batch: KvBatch) -> None:
        self.sizes.append(batch_blocks(batch))
        self.inner.apply_kv_batch(worker_id, dp_rank, batch)


def kept_whole(e: object) -> bool:
    """A store ``apply_in_slices`` does not cut: host or disk tier, or refused whole anyway."""
    return isinstance(e, BlocksStored) and (
        e.tier != 0 or len(set(e.block_hashes)) < len(e.block_hashes)
        or e.parent_hash in e.block_hashes
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(60))
def test_slices_apply_as_the_whole_batch(seed: int) -> None:
    rng = random.Random(seed)
    whole, whole_index = sink()
    cut, cut_index = sink()
    rec = Recording(cut)
    for _ in range(12):
        batch = random_batch(rng)
        whole.apply_kv_batch(1, 0, batch)
        rec.sizes.clear()
        turns = sum(1 for _ in apply_in_slices(rec, 1, 0, batch, 7))  # type: ignore[arg-type]
        assert set(cut_index.blocks()) == set(whole_index.blocks())
        big = [len(e.block_hashes) for e in batch.events if kept_whole(e)]
        assert all(n <= 7 or n in big for n in rec.sizes)
        assert turns >= len(rec.sizes) - 1  # the loop's turn between two calls


def test_a_batch_that_fits_is_one_call() -> None:
    calls: list[KvBatch] = []
    rec = type(
        "Rec", (), {"stores_refused": 0, "apply_kv_batch": lambda s, w, r, b: calls.append(b)}
    )()
    batch = KvBatch(3, 0, (BlocksRemoved(tuple(range(10)), 0), AllCleared()))
    assert list(apply_in_slices(rec, 1, 0, batch, 10)) == []
    assert calls == [batch]
    calls.clear()
    assert len(list(apply_in_slices(rec, 1, 0, batch, 4))) == 3
    assert [batch_blocks(b) for b in calls] == [4, 4, 2, 0]
