"""SELECTION.md §4's worked scenarios S1-S10 over HTTP, with their exact numbers.

Workers A=1, B=2 (C=3), block size 4. For each scenario the test reads what the API shows
(P, D + new, A from ``/loads`` and ``/potential_loads``, k from ``/overlap_scores``), checks that
the table's costs follow from them by the formula, and checks the winner: the cheaper rank every
time, or both ranks over repeated query-only selects when the costs tie. Knobs are set with the
``router_*`` settings (or a ``DYN_ROUTER_*`` variable); the seed makes the coin flips
reproducible.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from tests.api.selection.helpers import (
    P8,
    A,
    B,
    C,
    add_worker,
    book,
    cost,
    holds_p8,
    inputs,
    pick,
    picks,
    post,
    prompt,
)

NEW = [900 + i for i in range(8)]  # blocks no rank holds


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"selection_seed": 7}


async def two_workers(client) -> None:
    await add_worker(client, A)
    await add_worker(client, B)
    await holds_p8(client)


async def assert_costs(
    client, body: dict, expected: dict[int, float], *, sampled: bool = False, **knobs: Any
) -> None:
    """The costs computed from the API's numbers equal the table's; the winner follows (unless
    ``sampled``: at a positive temperature every rank can be drawn)."""
    isl = body["isl_tokens"]
    seen = await inputs(client, body)
    min_p = min(v[0] for v in seen.values())
    costs = {w: cost(*seen[w], isl=isl, min_p=min_p, **knobs) for w in expected}
    assert costs == pytest.approx(expected, abs=0.005)
    if sampled:
        return
    best = min(costs.values())
    winners = {w for w, c in costs.items() if c == best}
    got = await picks(client, body, 60 if len(winners) > 1 else 10)
    assert set(got) == winners, (costs, got)
    if len(winners) > 1:
        assert min(got.values()) >= 10  # a fair coin: each side about half of 60


# -- S1: overlap on A against an empty B --------------------------------------------------------


@pytest.mark.parametrize(("k", "a_cost"), [(3, 18), (4, 16), (5, 14)])
async def test_s1_overlap(client, k: int, a_cost: int) -> None:
    await two_workers(client)
    body = prompt(P8[:k] + NEW[: 8 - k])
    await assert_costs(client, body, {A: a_cost, B: 16})  # A: 24 - 2k


# -- S2 / S7: prefill backlog on A ------------------------------------------------------------


async def backlog(client, t: int, worker: int = A) -> None:
    await book(client, f"t{t}", worker, None, seq=[500], isl=t, ept=t)


@pytest.mark.parametrize(("t", "a_cost"), [(27, 15.75), (28, 16), (29, 16.25)])
async def test_s2_prefill_backlog(client, t: int, a_cost: float) -> None:
    await two_workers(client)
    await backlog(client, t)
    await assert_costs(client, prompt(P8), {A: a_cost, B: 16})  # t/4 + 9


@pytest.mark.parametrize(("t", "a_cost"), [(27, 16.5), (28, 16.75), (29, 17)])
async def test_s7_partial_block_prompt(client, t: int, a_cost: float) -> None:
    await two_workers(client)
    await backlog(client, t)
    await assert_costs(client, prompt(P8, 35), {A: a_cost, B: 16.75})  # (t+35)/4 + 1


# -- S3 / S4 / S5: credit, scale and active-request weight -------------------------------------


@pytest.mark.parametrize(("k", "a_cost", "b_wins"), [(5, 16.5, True), (6, 15, False)])
async def test_s3_credit_half(make_client, k: int, a_cost: float, b_wins: bool) -> None:
    async with make_client(selection_seed=1, router_overlap_score_credit=0.5) as (_, client):
        await two_workers(client)
        body = prompt(P8[:k] + NEW[: 8 - k])
        await assert_costs(client, body, {A: a_cost, B: 16}, credit=0.5)
        assert await pick(client, body) == (B if b_wins else A)
        r = await post(client, "/select", body)
        if not b_wins:  # the prefill tokens answered are never credit-scaled
            assert r.json()["effective_prefill_tokens"] == 32 - k * 4


@pytest.mark.parametrize("how", ["setting", "scale_env", "weight_env"])
@pytest.mark.parametrize(("k", "a_cost"), [(2, 26), (3, 23)])
async def test_s4_prefill_scale(
    make_client, monkeypatch: pytest.MonkeyPatch, how: str, k: int, a_cost: int
) -> None:
    overrides: dict[str, Any] = {"selection_seed": 1}
    if how == "setting":
        overrides["router_prefill_load_scale"] = 2.0
    elif how == "scale_env":
        monkeypatch.setenv("DYN_ROUTER_PREFILL_LOAD_SCALE", "2")
    else:  # the deprecated alias sets the same knob
        monkeypatch.setenv("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "2")
    async with make_client(**overrides) as (_, client):
        await two_workers(client)
        await assert_costs(client, prompt(P8[:k] + NEW[: 8 - k]), {A: a_cost, B: 24}, scale=2)


@pytest.mark.parametrize(
    ("w", "j", "a_cost", "winner"), [(3, 1, 15, A), (3, 2, 19, B), (0, 2, 10, A)]
)
async def test_s5_active_request_weight(make_client, w: float, j: int, a_cost: int, winner) -> None:
    async with make_client(selection_seed=1, router_decode_active_request_weight=w) as (_, client):
        await two_workers(client)
        for i in range(j):
            await book(client, f"j{i}", A, None, seq=[600 + i], isl=4, ept=0)
        await assert_costs(client, prompt(P8), {A: a_cost, B: 16}, w=w)  # (8+j) + W(1+j)
        assert await pick(client, prompt(P8)) == winner


# -- S6 / S8: credit decay with a backlog ------------------------------------------------------


@pytest.mark.parametrize(("t", "a_cost", "winner"), [(16, 15.67, A), (17, 16.03, B)])
async def test_s6_decay(make_client, t: int, a_cost: float, winner: int) -> None:
    async with make_client(selection_seed=1, router_overlap_score_credit_decay=1.0) as (_, c):
        await two_workers(c)
        await backlog(c, t)
        await assert_costs(c, prompt(P8), {A: a_cost, B: 16}, decay=1.0)
        assert await pick(c, prompt(P8)) == winner


@pytest.mark.parametrize(
    ("t", "a_cost", "winner"), [(16, 16.21, A), (17, 16.57, A), (18, 16.92, B)]
)
async def test_s8_decay_counts_the_partial_block(
    make_client, t: int, a_cost: float, winner: int
) -> None:
    """RB = ceil(35/4) = 9: with RB = 8, t = 17 would already go to B."""
    async with make_client(selection_seed=1, router_overlap_score_credit_decay=1.0) as (_, c):
        await two_workers(c)
        await backlog(c, t)
        await assert_costs(c, prompt(P8, 35), {A: a_cost, B: 16.75}, decay=1.0)
        assert await pick(c, prompt(P8, 35)) == winner


# -- S9: a booked prefix through select_and_reserve ---------------------------------------------


async def test_s9_reserved_prefix(client) -> None:
    await add_worker(client, A)  # W1, empty
    await add_worker(client, B)  # W2
    r = await post(
        client,
        "/select_and_reserve",
        {**prompt([1, 2, 3, 4, 5], 20), "pinned_worker": {"worker_id": B, "dp_rank": 0}},
    )
    assert r.status_code == 200, r.text
    body = prompt([1, 2, 3, 9], 16)
    seen = await inputs(client, body)
    assert seen[B] == (20, 6, 1, 3)  # P=20, D=5 + 1 new, k=3
    pot = {row["worker_id"]: row for row in (await post(client, "/potential_loads", body)).json()}
    assert (pot[B]["potential_prefill_tokens"], pot[B]["potential_decode_blocks"]) == (24, 6)
    await assert_costs(client, body, {B: 12, A: 8})


# -- S10: temperature --------------------------------------------------------------------------


async def test_s10_temperature_one(make_client) -> None:
    async with make_client(selection_seed=11, router_temperature=1.0) as (_, client):
        for w in (A, B, C):
            await add_worker(client, w)
        await holds_p8(client, A)
        await book(client, "c", C, P8[:4], isl=16)
        await assert_costs(client, prompt(P8), {A: 8, C: 12, B: 16}, sampled=True)
        # with T = 1 the ranks are drawn: p ∝ exp(-(cost - 8) / (16 - 8)) = .507 / .307 / .186
        n = 1500
        got: Counter[int] = await picks(client, prompt(P8), n)
        for w, p in ((A, 0.5065), (C, 0.3072), (B, 0.1863)):
            sd = (n * p * (1 - p)) ** 0.5
            assert abs(got[w] - n * p) < 5 * sd, got
