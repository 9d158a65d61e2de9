"""The receipt ring (``kv_slot_tracker.core.selection.receipt_ring``): bounded by count and by
bytes under a flood of selections, its byte estimate an upper bound of what a receipt holds
alive, the decision statistics and the reasons for non-optimal decisions."""

from __future__ import annotations

import gc
import random
import tracemalloc
from dataclasses import replace

import pytest

from kv_slot_tracker.core.selection import RouterConfig
from kv_slot_tracker.core.selection.receipt_ring import (
    RECEIPT_BASE_BYTES,
    RECEIPT_RANK_BYTES,
    ReceiptFilter,
    ReceiptRing,
)
from kv_slot_tracker.core.selection.receipts import Receipt, pack_columns
from kv_slot_tracker.core.selection.selector import select_columns
from kv_slot_tracker.core.types import WorkerWithDpRank

CONFIG = RouterConfig()


def selection(i: int, ranks: int, rng: random.Random, *, rid: str | None = None) -> Receipt:
    """A receipt of a real selection over ``ranks`` ranks with random loads and overlaps,
    built as the service builds it (fresh columns per call)."""
    workers = [WorkerWithDpRank(w, 0) for w in range(ranks)]
    prefill = [rng.randrange(0, 5000) for _ in workers]
    decode = [rng.randrange(0, 900) for _ in workers]
    requests = [rng.randrange(0, 40) for _ in workers]
    overlap = [rng.randrange(0, 33) for _ in workers]
    chosen = select_columns(
        workers, prefill, decode, requests, overlap,
        isl_tokens=512, block_size=16, num_sequence_hashes=32, config=CONFIG, rng=rng,
    )  # fmt: skip
    rid = rid or f"sel-{i:08d}"
    return Receipt(
        receipt_id=rid,
        selection_id=rid,
        action="select_and_reserve",
        at=1000.0 + i,
        decided_ns=i,
        key=("m", "default"),
        block_size=16,
        isl_tokens=512,
        prompt_blocks=32,
        workers=workers,
        values=pack_columns((prefill, decode, requests, overlap, chosen.costs)),
        max_overlap=max(overlap),
        lower=None,
        scored=chosen.scored,
        chosen=chosen.worker,
        chosen_overlap=chosen.overlap_blocks,
        effective_prefill_tokens=chosen.effective_prefill_tokens,
        config=CONFIG,
    )


def test_the_ring_keeps_its_count_bound() -> None:
    ring = ReceiptRing(max_entries=50, max_bytes=1 << 30)
    rng = random.Random(1)
    for i in range(1000):
        ring.put(selection(i, 4, rng))
    assert len(ring) == 50 and ring.evicted == 950
    assert [r.receipt_id for r in ring.newest(ReceiptFilter(), 3)] == [
        "sel-00000999",
        "sel-00000998",
        "sel-00000997",
    ]
    assert ring.get("sel-00000949") is None and ring.get("sel-00000950") is not None
    assert ring.stats["m", "default"].decisions == 1000  # the statistics outlive the ring


def test_the_ring_keeps_its_byte_bound_under_a_flood() -> None:
    per = RECEIPT_BASE_BYTES + len("sel-00000000") + RECEIPT_RANK_BYTES * 16
    ring = ReceiptRing(max_entries=1_000_000, max_bytes=100 * per)
    rng = random.Random(2)
    for i in range(5000):
        ring.put(selection(i, 16, rng))
        assert ring.bytes <= ring.max_bytes
    assert len(ring) == 100 and ring.bytes == 100 * per
    assert ring.bytes == sum(r.size for r in ring)


def test_a_receipt_given_again_replaces_the_older_one() -> None:
    ring = ReceiptRing(max_entries=10, max_bytes=1 << 30)
    rng = random.Random(3)
    ring.put(selection(0, 4, rng, rid="x"))
    first = ring.bytes
    ring.put(selection(1, 8, rng, rid="x"))
    assert len(ring) == 1 and ring.get("x").at == 1001.0  # type: ignore[union-attr]
    assert ring.bytes == first + 4 * RECEIPT_RANK_BYTES


@pytest.mark.parametrize("ranks", [1, 8, 64])
def test_the_byte_estimate_bounds_what_receipts_hold(ranks: int) -> None:
    """What a kept receipt holds alive (its object and the columns it keeps from the
    selection) never exceeds the estimate the ring counts: the bound is a bound of memory."""
    rng = random.Random(4)
    ring = ReceiptRing(max_entries=2000, max_bytes=1 << 40)
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for i in range(500):
            ring.put(selection(i, ranks, rng))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert 0 < held <= ring.bytes, (held, ring.bytes)


def test_decision_statistics_and_reasons() -> None:
    ring = ReceiptRing(max_entries=10, max_bytes=1 << 30)
    w = [WorkerWithDpRank(i, 0) for i in range(3)]

    def make(rid: str, overlap: list[int], costs: list[float], chosen: int, **kw) -> Receipt:
        scored = kw.pop("scored", w)
        r = Receipt(
            receipt_id=rid, selection_id=rid, action="select", at=0.0, decided_ns=0,
            key=("m", "g"), block_size=4, isl_tokens=40, prompt_blocks=10,
            workers=w, values=pack_columns(([0, 0, 0], [1, 2, 3], [0, 0, 0], overlap, costs)),
            max_overlap=max(overlap), lower=None,
            scored=scored, chosen=w[chosen], chosen_overlap=overlap[chosen],
            effective_prefill_tokens=0,
            config=replace(CONFIG, router_temperature=kw.pop("temperature", 0.0)), **kw,
        )  # fmt: skip
        ring.put(r)
        return r

    assert make("a", [6, 2, 0], [5.0, 9.0, 9.0], 0).non_optimal_reason() is None
    assert make("b", [6, 2, 0], [9.0, 5.0, 9.0], 1).non_optimal_reason() == "load"
    assert make("c", [6, 2, 0], [5.0, 5.0, 9.0], 1).non_optimal_reason() == "tie"
    tied_elsewhere = make("d", [6, 2, 0], [9.0, 5.0, 5.0], 2)
    assert (tied_elsewhere.decided_by, tied_elsewhere.non_optimal_reason()) == ("tie", "load")
    drawn = make("e", [6, 2, 0], [5.0, 6.0, 7.0], 2, temperature=1.0)
    assert (drawn.decided_by, drawn.non_optimal_reason()) == ("temperature", "temperature")
    allowed = make("f", [6, 2, 0], [9.0], 1, scored=[w[1]])
    assert (allowed.decided_by, allowed.non_optimal_reason()) == ("only_candidate", "allowed")
    s = ring.stats["m", "g"]
    assert (s.decisions, s.max_overlap_decisions) == (6, 1)
    assert s.non_max == {"load": 2, "tie": 1, "temperature": 1, "allowed": 1}
    assert s.overlap_blocks_lost == 4 + 4 + 6 + 6 + 4
    assert s.funnel == [60, 36, 6 + 2 + 2 + 0 + 0 + 2, 0]
    ring.report_cached(drawn, 12)
    ring.report_cached(drawn, 40)  # the first report counts
    assert (s.reported, s.funnel[3], drawn.cached_tokens) == (1, 3, 12)
    assert s.prediction_error.n == 1 and s.prediction_error.total == 0 - 12
