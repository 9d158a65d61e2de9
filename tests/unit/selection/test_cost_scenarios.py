"""The worked scenarios S1-S10 of SELECTION.md §4, rebuilt from their bookings, with exact costs.

Each scenario's state is replayed on a small ``Partition`` (bs 4, workers A=1, B=2, C=3, dp 1);
the test asserts both ranks' costs to the number and the winner (or that both win a tie). Further
tests pin the response fields of §5 (effective prefill tokens, potential decode blocks with the
tail term, the chosen worker's overlap per dp rank) and the prefill-tracking-off rule.
"""

from __future__ import annotations

import random

import pytest

from kv_slot_tracker.core.selection import (
    RankInput,
    RouterConfig,
    RouterConfigOverride,
    potential_prefill_tokens,
    rank_logit,
    select,
)
from kv_slot_tracker.core.types import WorkerWithDpRank
from tests.support.router_config import with_override
from tests.unit.selection.builders import BS, P8, Partition

A, B, C = WorkerWithDpRank(1), WorkerWithDpRank(2), WorkerWithDpRank(3)


def base() -> Partition:
    """'A holds P8': explicit 8-block booking (no ept -> P 0) on A, prefill completed; B empty."""
    p = Partition(A, B)
    p.book(A, P8, ept=0)
    return p


def new_blocks(n: int) -> list[int]:
    return [1000 + i for i in range(n)]


def winners(p: Partition, query: list[int], isl: int, config: RouterConfig) -> set[int]:
    rng = random.Random(7)
    return {p.select(query, isl, config, rng).worker.worker_id for _ in range(200)}


def check(
    p: Partition,
    query: list[int],
    isl: int,
    config: RouterConfig,
    a: float,
    b: float,
    winner: str,
) -> None:
    logits = p.select(query, isl, config).logits
    assert logits[A] == pytest.approx(a, rel=1e-12)
    assert logits[B] == pytest.approx(b, rel=1e-12)
    expected = {"A": {1}, "B": {2}, "tie": {1, 2}}[winner]
    if winner == "tie":
        assert logits[A] == logits[B]  # an exact tie, not a near one
    assert winners(p, query, isl, config) == expected


@pytest.mark.parametrize(("k", "a", "winner"), [(3, 18, "B"), (4, 16, "tie"), (5, 14, "A")])
def test_s1_overlap_against_load(k: int, a: float, winner: str) -> None:
    # A: 8-k + 8 + (8-k) = 24-2k; B: 8 + 8 = 16
    check(base(), P8[:k] + new_blocks(8 - k), 32, RouterConfig(), a, 16, winner)


def s2(t: int) -> Partition:
    """Base plus, on A, a 1-block booking with effective prefill tokens t."""
    p = base()
    p.book(A, [500], ept=t)
    return p


@pytest.mark.parametrize(
    ("t", "a", "winner"), [(27, 15.75, "A"), (28, 16, "tie"), (29, 16.25, "B")]
)
def test_s2_pending_prefill_against_overlap(t: int, a: float, winner: str) -> None:
    # A: (t+32)/4 - 8 + 9 = t/4 + 9; B: 16
    check(s2(t), P8, 32, RouterConfig(), a, 16, winner)


@pytest.mark.parametrize(("k", "a", "winner"), [(5, 16.5, "B"), (6, 15, "A")])
def test_s3_half_credit(k: int, a: float, winner: str) -> None:
    # A: 8 - 0.5k + 16 - k = 24 - 1.5k; B: 16
    check(
        base(),
        P8[:k] + new_blocks(8 - k),
        32,
        RouterConfig(overlap_score_credit=0.5),
        a,
        16,
        winner,
    )


@pytest.mark.parametrize(
    "config",
    [
        RouterConfig(prefill_load_scale=2.0),
        RouterConfig().with_env({"DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT": "2"}),
    ],
    ids=["SCALE=2", "OSW=2"],
)
@pytest.mark.parametrize(("k", "a", "winner"), [(2, 26, "B"), (3, 23, "A")])
def test_s4_prefill_scale(config: RouterConfig, k: int, a: float, winner: str) -> None:
    # A: 2(8-k) + 16-k = 32 - 3k; B: 2*8 + 8 = 24
    check(base(), P8[:k] + new_blocks(8 - k), 32, config, a, 24, winner)


def s5(j: int) -> Partition:
    """Base plus j extra 1-block bookings on A with ept 0."""
    p = base()
    for i in range(j):
        p.book(A, [600 + i], ept=0)
    return p


@pytest.mark.parametrize(("j", "a", "winner"), [(1, 15, "A"), (2, 19, "B")])
def test_s5_active_request_weight(j: int, a: float, winner: str) -> None:
    # A: 0 + (8+j) + 3(1+j); B: 16
    check(s5(j), P8, 32, RouterConfig(decode_active_request_weight=3.0), a, 16, winner)


def test_s5_default_weight_ignores_requests() -> None:
    check(s5(2), P8, 32, RouterConfig(), 10, 16, "A")


@pytest.mark.parametrize(("t", "winner"), [(16, "A"), (17, "B")])
def test_s6_credit_decay(t: int, winner: str) -> None:
    # min P = 0 on B; RB = 8; A: (t+32)/4 - 8*32/(32+t) + 9
    a = (t + 32) / 4 - 8 * 32 / (32 + t) + 9
    check(s2(t), P8, 32, RouterConfig(overlap_score_credit_decay=1.0), a, 16, winner)
    assert round(a, 2) == {16: 15.67, 17: 16.03}[t]


@pytest.mark.parametrize(("t", "a", "winner"), [(27, 16.5, "A"), (28, 16.75, "tie"), (29, 17, "B")])
def test_s7_partial_tail_block(t: int, a: float, winner: str) -> None:
    # isl 35 with the 8 hashes of P8: A: (t+35)/4 - 8 + 9; B: 35/4 + 8 = 16.75
    check(s2(t), P8, 35, RouterConfig(), a, 16.75, winner)


@pytest.mark.parametrize(("t", "winner"), [(16, "A"), (17, "A"), (18, "B")])
def test_s8_decay_uses_ceil_request_blocks(t: int, winner: str) -> None:
    # RB = ceil(35/4) = 9: A: (t+35)/4 - 8*36/(36+t) + 9
    a = (t + 35) / 4 - 8 * 36 / (36 + t) + 9
    check(s2(t), P8, 35, RouterConfig(overlap_score_credit_decay=1.0), a, 16.75, winner)
    assert round(a, 2) == {16: 16.21, 17: 16.57, 18: 16.92}[t]


def test_s8_would_differ_with_floor_request_blocks() -> None:
    """With RB = 8 (len(block_hashes)) t=17 would cost 16.78 > 16.75 and B would win."""
    assert (17 + 35) / 4 - 8 * 32 / (32 + 17) + 9 > 16.75
    assert s2(17).select(P8, 35, RouterConfig(overlap_score_credit_decay=1.0)).worker == A


def test_s9_select_and_reserve_state() -> None:
    # W2 got [1..5] via select_and_reserve on an empty partition: P 20, D 5, cache [1..5].
    w1, w2 = WorkerWithDpRank(1), WorkerWithDpRank(2)
    p = Partition(w1, w2)
    p.book(w2, [1, 2, 3, 4, 5], ept=20)
    query = [1, 2, 3, 9]
    sel = p.select(query, 16)
    # W2: (20+16)/4 - 3 + (5+1) = 12; W1: 4 + 4 = 8
    assert sel.logits == {w1: 8.0, w2: 12.0}
    assert sel.worker == w1
    rows = {r.worker: r for r in p.candidates(query)}
    assert potential_prefill_tokens(rows[w2], 16, BS) == 24
    assert rows[w2].potential_decode_blocks == 6


def test_s10_temperature_one_frequencies() -> None:
    """T=1, costs A 8, C 12, B 16: frequencies follow softmax(-(c-8)/8) = .507/.307/.186."""
    p = Partition(A, B, C)
    p.book(A, P8)
    p.book(C, P8[:4])
    config = RouterConfig(router_temperature=1.0)
    assert p.select(P8, 32, config).logits == {A: 8.0, B: 16.0, C: 12.0}
    rng = random.Random(20261202)
    draws = 20_000
    counts = {A: 0, B: 0, C: 0}
    for _ in range(draws):
        counts[p.select(P8, 32, config, rng).worker] += 1
    # 0.015 is more than 4 standard deviations of each frequency at 20,000 draws
    assert counts[A] / draws == pytest.approx(0.5065, abs=0.015)
    assert counts[C] / draws == pytest.approx(0.3072, abs=0.015)
    assert counts[B] / draws == pytest.approx(0.1863, abs=0.015)


def test_prefill_tracking_off_keeps_the_prompt_term() -> None:
    """Tracking off: A (5 cached blocks, D 8) wins 8 vs 10 - the isl/bs - k term is still there."""
    p = base()
    config = RouterConfig(track_prefill_tokens=False)
    sel = p.select(P8[:5], 20, config)
    assert sel.logits == {A: 8.0, B: 10.0}
    assert sel.worker == A


def test_prefill_tracking_off_ignores_pending_prefill_and_the_decay() -> None:
    p = s2(16)
    on = p.select(P8, 32, RouterConfig(overlap_score_credit_decay=1.0)).logits[A]
    off = p.select(
        P8, 32, RouterConfig(overlap_score_credit_decay=1.0, track_prefill_tokens=False)
    ).logits[A]
    assert on == pytest.approx(15.0 + 2 / 3, rel=1e-12)
    # observed on the reference: untracked, A's 16 pending tokens are no load and the full credit
    # of 8 blocks applies; only the prompt's own isl/bs - k stays
    assert off == 32 / 4 - 8 + 9


def test_override_applies_like_the_config() -> None:
    p = base()
    query = P8[:6] + new_blocks(2)
    override = RouterConfigOverride.from_json({"overlap_score_credit": 0.5})
    sel = p.select(query, 32, with_override(RouterConfig(), override))
    assert sel.logits[A] == 15.0
    assert sel.worker == A


# -- response fields (SELECTION.md §5) --------------------------------------------------------


def test_effective_prefill_tokens_is_not_credit_scaled() -> None:
    """CREDIT 0.5, k 6, isl 32 -> effective_prefill_tokens 32 - 24 = 8."""
    sel = base().select(P8[:6] + new_blocks(2), 32, RouterConfig(overlap_score_credit=0.5))
    assert sel.worker == A
    assert sel.overlap_blocks == 6
    assert sel.effective_prefill_tokens == 8


@pytest.mark.parametrize(("isl", "expected"), [(33, 9), (35, 9), (40, 10), (47, 12), (3, 8)])
def test_response_decode_blocks_add_the_uncovered_tail(isl: int, expected: int) -> None:
    """8 hashes on an empty rank: D + new = 8, plus max(0, ceil(isl/4) - 8)."""
    p = Partition(A)
    sel = p.select(P8, isl)
    assert sel.potential_decode_blocks == expected
    assert sel.effective_prefill_tokens == isl


def test_overlap_lists_every_rank_of_the_chosen_worker() -> None:
    """Pinned to rank 0 (no overlap) while rank 1 holds 4 blocks: gpu 16, dp {0: 0, 1: 16}."""
    r0, r1 = WorkerWithDpRank(1, 0), WorkerWithDpRank(1, 1)
    other = WorkerWithDpRank(2, 0)
    p = Partition(r0, r1, other)
    p.book(r1, P8[:4])
    p.book(other, P8)
    sel = p.select(P8, 32, pinned_worker=r0)
    assert sel.worker == r0
    assert sel.overlap.dp_tokens == {0: 0, 1: 16}
    assert sel.overlap.max_tokens == 16
    assert sel.overlap_blocks == 0
    assert sel.effective_prefill_tokens == 32


def test_overlap_of_other_workers_is_not_reflected() -> None:
    p = base()
    sel = p.select(P8, 32, allowed_worker_ids={2})
    assert sel.worker == B
    assert sel.overlap.dp_tokens == {0: 0}
    assert sel.overlap.max_tokens == 0


def test_overlap_beyond_a_short_isl_adds_cached_tokens_back() -> None:
    """A hash prompt with isl 3 but 8 cached blocks: raw prefill is (P + 32)/4, not (P + 3)/4."""
    row = RankInput(
        worker=A,
        active_prefill_tokens=8,
        potential_decode_blocks=8,
        active_requests=1,
        overlap_blocks=8,
    )
    cost = rank_logit(row, isl_tokens=3, block_size=BS, config=RouterConfig(), min_prefill_tokens=0)
    assert cost == (8 + 32) / 4 - 8 + 8  # 10.0; SELECTION.md's (P + isl)/bs would give 8.0
    assert potential_prefill_tokens(row, 3, BS) == 8


def test_empty_prompt_with_decay_does_not_divide_by_zero() -> None:
    """isl 0 (token_ids []) with DECAY > 0: request blocks are 0, costs stay defined."""
    rows = [
        RankInput(
            worker=A,
            active_prefill_tokens=8,
            potential_decode_blocks=3,
            active_requests=1,
            overlap_blocks=0,
        ),
        RankInput(
            worker=B,
            active_prefill_tokens=0,
            potential_decode_blocks=1,
            active_requests=0,
            overlap_blocks=0,
        ),
    ]
    sel = select(
        rows,
        isl_tokens=0,
        block_size=BS,
        num_sequence_hashes=0,
        config=RouterConfig(overlap_score_credit_decay=1.0),
        rng=random.Random(0),
    )
    # A: decay 0 (excess / 0 = inf), raw 8/4 = 2 -> 2 + 3; B: 0/0 -> NaN credit, max(NaN, 0) = 0
    assert sel.logits == {A: 5.0, B: 1.0}
    assert sel.worker == B
