"""The hot-path cost loop equals the one-rank cost function bit for bit.

``rank_logits`` recomputes ``rank_logit`` over columns without per-rank objects; an exact tie
decides a coin flip, so the two must agree exactly (``==`` on floats, NaN-free), over random
loads, overlaps, prompts and every knob.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_slot_tracker.core.selection import RankInput, RouterConfig, rank_logit, rank_logits
from kv_slot_tracker.core.types import WorkerWithDpRank

knobs = st.builds(
    RouterConfig,
    overlap_score_credit=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    overlap_score_credit_decay=st.sampled_from([0.0, 0.3, 1.0, 4.0]),
    prefill_load_scale=st.sampled_from([0.0, 1.0, 2.0, 0.1]),
    decode_active_request_weight=st.sampled_from([0.0, 3.0, 0.25]),
    track_prefill_tokens=st.booleans(),
)
rank = st.tuples(
    st.integers(0, 100_000),  # P
    st.integers(0, 5_000),  # D + new
    st.integers(0, 500),  # A
    st.integers(0, 300),  # k
)


@settings(max_examples=400, deadline=None)
@given(
    ranks=st.lists(rank, min_size=1, max_size=12),
    isl=st.integers(0, 20_000),
    block_size=st.sampled_from([1, 4, 16, 64]),
    config=knobs,
)
def test_rank_logits_equal_rank_logit(
    ranks: list[tuple[int, int, int, int]], isl: int, block_size: int, config: RouterConfig
) -> None:
    floor = min(p for p, _, _, _ in ranks)
    inputs = [
        RankInput(
            worker=WorkerWithDpRank(i),
            active_prefill_tokens=p,
            potential_decode_blocks=d,
            active_requests=a,
            overlap_blocks=k,
        )
        for i, (p, d, a, k) in enumerate(ranks)
    ]
    expected = [
        rank_logit(
            r, isl_tokens=isl, block_size=block_size, config=config, min_prefill_tokens=floor
        )
        for r in inputs
    ]
    columns = [list(c) for c in zip(*ranks, strict=True)]
    got = rank_logits(
        *columns, isl_tokens=isl, block_size=block_size, config=config, min_prefill_tokens=floor
    )
    assert got == expected


def test_an_empty_prompt_with_decay_gives_the_same_cost() -> None:
    config = RouterConfig(overlap_score_credit_decay=1.0)
    r = RankInput(
        worker=WorkerWithDpRank(1),
        active_prefill_tokens=8,
        potential_decode_blocks=3,
        active_requests=1,
        overlap_blocks=2,
    )
    one = rank_logit(r, isl_tokens=0, block_size=4, config=config, min_prefill_tokens=0)
    assert rank_logits(
        [8], [3], [1], [2], isl_tokens=0, block_size=4, config=config, min_prefill_tokens=0
    ) == [one]
