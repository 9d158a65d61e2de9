"""Picking a rank: ties, temperature sampling, pinned and allowed workers, and a random check.

The tie rule and the sampling use a seeded ``random.Random``, so every count below is
deterministic; the bounds are still wide enough to hold for any seed (they sit several standard
deviations from the expected values). The property test mirrors SELECTION.md's random-state
check: over random candidate sets and knobs the winner's exact cost is always the minimum.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_slot_tracker.core.selection import RankInput, RouterConfig, select, softmax_probabilities
from kv_slot_tracker.core.selection.errors import NoEndpoints, PinnedWorkerNotAllowed
from kv_slot_tracker.core.selection.selector import pick_min, pick_softmax
from kv_slot_tracker.core.types import WorkerWithDpRank

BS = 4


def row(worker: int, dp: int = 0, *, p: int = 0, d: int = 0, a: int = 0, k: int = 0) -> RankInput:
    return RankInput(
        worker=WorkerWithDpRank(worker, dp),
        active_prefill_tokens=p,
        potential_decode_blocks=d,
        active_requests=a,
        overlap_blocks=k,
    )


def choose(rows: list[RankInput], rng: random.Random, config: RouterConfig | None = None, **kw):
    return select(
        rows,
        isl_tokens=32,
        block_size=BS,
        num_sequence_hashes=8,
        config=config or RouterConfig(),
        rng=rng,
        **kw,
    )


def test_exact_tie_is_split_and_a_worse_rank_never_wins() -> None:
    # S1 with k=4: A 4 + 12 = 16, B 8 + 8 = 16, C 8 + 12 = 20
    rows = [row(1, d=12, a=1, k=4), row(2, d=8), row(3, d=12)]
    rng = random.Random(42)
    draws = 2_000
    counts = Counter(choose(rows, rng).worker.worker_id for _ in range(draws))
    assert choose(rows, rng).logits == {
        WorkerWithDpRank(1): 16.0,
        WorkerWithDpRank(2): 16.0,
        WorkerWithDpRank(3): 20.0,
    }
    assert counts[3] == 0
    assert counts[1] + counts[2] == draws
    # binomial(2000, 1/2): sd 22; 850..1150 is wider than 6 sd
    assert 850 <= counts[1] <= 1150


def test_seven_tied_ranks_are_about_uniform() -> None:
    rows = [row(w, d=8) for w in range(1, 8)]
    rng = random.Random(3)
    draws = 7_000
    counts = Counter(choose(rows, rng).worker.worker_id for _ in range(draws))
    assert set(counts) == set(range(1, 8))
    assert all(850 <= n <= 1150 for n in counts.values()), counts


class Recording(random.Random):
    def __init__(self, answer: int) -> None:
        super().__init__(0)
        self.answer = answer
        self.bounds: list[int] = []

    def randrange(self, n):  # type: ignore[override]
        self.bounds.append(n)
        return self.answer


def test_pick_min_draws_once_among_the_ties() -> None:
    rng = Recording(1)
    assert pick_min([5.0, 3.0, 3.0, 9.0, 2.0, 3.0, 2.0], rng) == 6  # the second of the two 2.0s
    assert rng.bounds == [2]
    rng = Recording(0)
    assert pick_min([5.0, 1.0, 3.0], rng) == 1  # a single minimum draws nothing
    assert rng.bounds == []


def test_temperature_zero_is_argmin() -> None:
    rows = [row(1, d=9), row(2, d=7), row(3, d=8)]
    rng = random.Random(1)
    assert {choose(rows, rng).worker.worker_id for _ in range(100)} == {2}


def test_softmax_probabilities_match_the_reference_formula() -> None:
    p = softmax_probabilities([8.0, 12.0, 16.0], 1.0)
    z = 1 + math.exp(-0.5) + math.exp(-1)
    assert p == pytest.approx([1 / z, math.exp(-0.5) / z, math.exp(-1) / z], rel=1e-12)
    assert [round(x, 4) for x in p] == [0.5065, 0.3072, 0.1863]  # SELECTION.md: .507/.307/.186
    assert [round(x, 3) for x in softmax_probabilities([8.0, 16.0], 1.0)] == [0.731, 0.269]
    assert softmax_probabilities([3.0, 3.0, 3.0, 3.0], 0.5) == [0.25] * 4
    # normalised costs: the temperature acts on the spread, not on absolute cost units
    assert softmax_probabilities([80.0, 160.0], 1.0) == pytest.approx([0.731, 0.269], abs=5e-4)
    # a lower temperature sharpens the choice
    assert softmax_probabilities([8.0, 16.0], 0.1)[0] > 0.9999


def test_softmax_sampling_frequencies() -> None:
    rows = [row(1, d=8), row(2, d=16)]
    rng = random.Random(11)
    draws = 20_000
    counts = Counter(
        choose(rows, rng, RouterConfig(router_temperature=1.0)).worker.worker_id
        for _ in range(draws)
    )
    assert counts[1] / draws == pytest.approx(0.7311, abs=0.015)


def test_pick_softmax_walks_the_cumulative_distribution() -> None:
    class Fixed(random.Random):
        def __init__(self, value: float) -> None:
            super().__init__(0)
            self.value = value

        def random(self) -> float:
            return self.value

    # probabilities .5065 / .3072 / .1863 -> cumulative .5065 / .8137 / 1.0
    assert pick_softmax([8.0, 12.0, 16.0], 1.0, Fixed(0.50)) == 0
    assert pick_softmax([8.0, 12.0, 16.0], 1.0, Fixed(0.51)) == 1
    assert pick_softmax([8.0, 12.0, 16.0], 1.0, Fixed(0.82)) == 2
    assert pick_softmax([8.0, 12.0, 16.0], 1.0, Fixed(0.9999999)) == 2


# -- pinned and allowed workers ---------------------------------------------------------------


def test_pinned_rank_wins_even_when_worse() -> None:
    rows = [row(1, d=8), row(2, d=100)]
    sel = choose(rows, random.Random(0), pinned_worker=WorkerWithDpRank(2))
    assert sel.worker == WorkerWithDpRank(2)
    assert sel.logits == {WorkerWithDpRank(2): 108.0}


def test_pinned_worker_must_be_allowed() -> None:
    rows = [row(1, d=8), row(2, d=8)]
    with pytest.raises(PinnedWorkerNotAllowed) as e:
        choose(rows, random.Random(0), pinned_worker=WorkerWithDpRank(2), allowed_worker_ids=[1])
    assert str(e.value) == "pinned worker 2 is not in allowed worker set"
    sel = choose(rows, random.Random(0), pinned_worker=WorkerWithDpRank(2), allowed_worker_ids=[2])
    assert sel.worker == WorkerWithDpRank(2)


@pytest.mark.parametrize("pinned", [WorkerWithDpRank(9, 0), WorkerWithDpRank(1, 1)])
def test_pinned_rank_that_does_not_exist(pinned: WorkerWithDpRank) -> None:
    with pytest.raises(NoEndpoints) as e:
        choose([row(1, d=8)], random.Random(0), pinned_worker=pinned)
    assert str(e.value) == "no endpoints available to route work"


def test_allowed_worker_ids_restrict_candidates() -> None:
    rows = [row(1, 0, d=1), row(1, 1, d=2), row(2, 0, d=50), row(2, 1, d=40)]
    rng = random.Random(0)
    sel = choose(rows, rng, allowed_worker_ids={2})
    assert sel.worker == WorkerWithDpRank(2, 1)
    assert set(sel.logits) == {WorkerWithDpRank(2, 0), WorkerWithDpRank(2, 1)}
    with pytest.raises(NoEndpoints):
        choose(rows, rng, allowed_worker_ids={7})
    with pytest.raises(NoEndpoints):
        choose(rows, rng, allowed_worker_ids=[])
    with pytest.raises(NoEndpoints):
        choose([], rng)


def test_decay_floor_is_taken_over_allowed_ranks_only() -> None:
    """min P comes from the eligible candidates: excluding the idle rank changes A's credit."""
    rows = [row(1, p=64, d=8, a=1, k=8), row(2, p=64, d=16), row(3, p=0, d=99)]
    config = RouterConfig(overlap_score_credit_decay=1.0)
    all_ranks = choose(rows, random.Random(0), config).logits[WorkerWithDpRank(1)]
    allowed = choose(rows, random.Random(0), config, allowed_worker_ids={1, 2}).logits[
        WorkerWithDpRank(1)
    ]
    # all ranks: excess 16 blocks / RB 8 -> decay 1/3; allowed {1,2}: floor 64 -> decay 1
    assert all_ranks == pytest.approx(24 - 8 / 3 + 8, rel=1e-12)
    assert allowed == 24 - 8 + 8


# -- random states: the winner always has the minimum exact cost ------------------------------


def exact_cost(r: RankInput, isl: int, bs: int, config: RouterConfig, floor: int) -> Fraction:
    """SELECTION.md §4 in exact arithmetic (for prompts whose cached prefix fits in isl)."""
    decay = Fraction(1)
    if config.track_prefill_tokens and config.overlap_score_credit_decay > 0:
        rb = -(-isl // bs)
        excess = Fraction(r.active_prefill_tokens - floor, bs)
        decay = 1 / (1 + Fraction(config.overlap_score_credit_decay) * excess / rb)
    active = r.active_prefill_tokens if config.track_prefill_tokens else 0
    prefill = max(
        Fraction(0),
        Fraction(active + isl, bs)
        - Fraction(config.overlap_score_credit) * decay * r.overlap_blocks,
    )
    return (
        Fraction(config.prefill_load_scale) * prefill
        + r.potential_decode_blocks
        + Fraction(config.decode_active_request_weight) * r.active_requests
    )


rank_rows = st.lists(
    st.tuples(
        st.integers(0, 200),  # P
        st.integers(0, 40),  # D + new
        st.integers(0, 6),  # A
        st.integers(0, 8),  # k
    ),
    min_size=1,
    max_size=6,
)
configs = st.builds(
    RouterConfig,
    overlap_score_credit=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    overlap_score_credit_decay=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    prefill_load_scale=st.sampled_from([0.0, 1.0, 2.0]),
    decode_active_request_weight=st.sampled_from([0.0, 1.0, 3.0]),
    track_prefill_tokens=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(rank_rows, configs, st.integers(32, 64), st.integers(0, 2**32))
def test_winner_has_the_minimum_exact_cost(rows, config, isl, seed) -> None:
    # k <= 8 blocks of 4 tokens, so the cached prefix always fits in isl >= 32
    ranks = [row(i + 1, p=p, d=d, a=a, k=k) for i, (p, d, a, k) in enumerate(rows)]
    sel = select(
        ranks,
        isl_tokens=isl,
        block_size=BS,
        num_sequence_hashes=8,
        config=config,
        rng=random.Random(seed),
    )
    floor = min(r.active_prefill_tokens for r in ranks)
    exact = {r.worker: exact_cost(r, isl, BS, config, floor) for r in ranks}
    best = min(exact.values())
    assert exact[sel.worker] - best <= Fraction(1, 10**9)
    for w, cost in sel.logits.items():
        assert cost == pytest.approx(float(exact[w]), rel=1e-12, abs=1e-12)
