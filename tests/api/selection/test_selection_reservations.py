"""Bookings, pending selections, the reservation lifecycle and the approximate cache over HTTP
(SELECTION.md §6, §7), with the time-dependent rules driven by the fake clock."""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.selection.helpers import P8, SEL, A, B, add_worker, book, holds_p8, post, prompt


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"selection_seed": 5}


async def rank_load(client, worker_id: int = A, dp_rank: int = 0, model: str = "default") -> tuple:
    r = await client.get(f"{SEL}/loads", params={"model_name": model})
    for row in r.json()[0]["loads"]:
        if (row["worker_id"], row["dp_rank"]) == (worker_id, dp_rank):
            return (
                row["potential_prefill_tokens"],
                row["potential_decode_blocks"],
                row["active_requests"],
            )
    raise AssertionError(f"no rank {worker_id}/{dp_rank}")


async def overlap(client, blocks: list[int], worker_id: int = A, dp_rank: int = 0) -> int:
    r = await post(client, "/overlap_scores", prompt(blocks))
    by_rank = {(w["worker_id"], w["dp_rank"]): w["device_blocks"] for w in r.json()["workers"]}
    return by_rank.get((worker_id, dp_rank), 0)


def pinned(worker_id: int, dp_rank: int = 0) -> dict[str, Any]:
    return {"pinned_worker": {"worker_id": worker_id, "dp_rank": dp_rank}}


OK = {"status": "ok"}


def booked(sid: str, worker_id: int = A, dp_rank: int = 0, model: str = "default") -> dict:
    """The answer of a booking of ``sid`` on ``worker_id``/``dp_rank``."""
    return {"selection_id": sid, "model_name": model, "routing_group": "default",
            "worker_id": worker_id, "dp_rank": dp_rank, "endpoint": f"http://w{worker_id}"}  # fmt: skip


def no_pending(sid: str, model: str = "default") -> dict:
    return {
        "error": f"no pending selection {sid} for model={model} routing_group=default "
        "(expired, already used, or never selected)"
    }


async def answer(call: Any) -> tuple[int, Any]:
    r = await call
    return r.status_code, r.json()


# -- replay of a pending selection --------------------------------------------------------------


async def test_replay_books_the_cached_pick_once(client) -> None:
    await add_worker(client, A)
    await add_worker(client, B)
    r = await post(client, "/select", {**prompt([1, 2], 7), "selection_id": "s", **pinned(B)})
    assert r.status_code == 200
    assert (r.json()["worker_id"], r.json()["dp_rank"]) == (B, 0)
    assert await rank_load(client, B) == (0, 0, 0)  # a select books nothing
    assert await overlap(client, [1, 2], B) == 0  # nor writes the cache
    r = await post(client, "/reservations", {"selection_id": "s", "worker_id": None})
    assert (r.status_code, r.json()) == (
        201,
        {
            "selection_id": "s",
            "model_name": "default",
            "routing_group": "default",
            "worker_id": B,
            "dp_rank": 0,
            "endpoint": f"http://w{B}",
        },
    )
    assert await rank_load(client, B) == (7, 2, 1)
    assert await overlap(client, [1, 2], B) == 2
    r = await post(client, "/reservations", {"selection_id": "s"})
    assert (r.status_code, r.json()["error"]) == (
        404,
        "no pending selection s for model=default routing_group=default "
        "(expired, already used, or never selected)",
    )


async def test_pending_selections_are_kept_per_partition(make_client, clock) -> None:
    # a released id is refused until its tombstone goes (here after 1 s; the reference replays
    # the entry at once)
    async with make_client(selection_seed=5, reservation_tombstone_ttl_seconds=1) as (_, client):
        await add_worker(client, A)
        await add_worker(client, B, model_name="m2")
        await post(client, "/select", {**prompt([1]), "selection_id": "s"})
        await post(client, "/select", {**prompt([1]), "selection_id": "s", "model_name": "m2"})
        # an explicit booking drops only its own partition's pending entry
        await book(client, "s", B, [1], isl=4, model_name="m2")
        r = await post(client, "/reservations", {"selection_id": "s"})  # the id is reserved
        assert (r.status_code, r.json()["error"]) == (
            409,
            "selection s is already reserved or being reserved",
        )
        assert await answer(client.delete(f"{SEL}/reservations/s")) == (200, OK)
        assert (await post(client, "/reservations", {"selection_id": "s"})).status_code == 409
        clock.advance(1)
        r = post(client, "/reservations", {"selection_id": "s"})
        assert await answer(r) == (201, booked("s"))
        r = await post(client, "/reservations", {"selection_id": "s", "model_name": "m2"})
        assert (r.status_code, r.json()) == (404, no_pending("s", "m2"))


async def test_select_and_reserve_leaves_the_pending_entry(make_client, clock) -> None:
    async with make_client(selection_seed=5, reservation_tombstone_ttl_seconds=1) as (_, client):
        await add_worker(client, A)
        await post(client, "/select", {**prompt([1]), "selection_id": "s"})
        r = await post(client, "/select_and_reserve", {**prompt([1]), "selection_id": "s"})
        assert r.status_code == 200
        assert (r.json()["selection_id"], r.json()["worker_id"]) == ("s", A)
        assert await rank_load(client) == (4, 1, 1)
        assert await answer(client.delete(f"{SEL}/reservations/s")) == (200, OK)
        assert await rank_load(client) == (0, 0, 0)
        clock.advance(1)  # past the released id's tombstone
        r = post(client, "/reservations", {"selection_id": "s"})
        assert await answer(r) == (201, booked("s"))


async def test_replay_after_the_worker_went_keeps_the_entry(client) -> None:
    await add_worker(client, A)
    await add_worker(client, B)
    await post(client, "/select", {**prompt([1]), "selection_id": "s", **pinned(B)})
    await client.delete(f"{SEL}/workers/{B}")
    for _ in range(2):
        r = await post(client, "/reservations", {"selection_id": "s"})
        assert (r.status_code, r.json()["error"]) == (
            404,
            f"schedulable worker {B} (dp_rank 0) not found for model=default routing_group=default",
        )


async def test_pending_selections_expire_after_the_ttl(make_client, clock) -> None:
    async with make_client(selection_cache_ttl_seconds=120) as (_, client):
        await add_worker(client, A)
        for sid in ("early", "late"):
            await post(client, "/select", {**prompt([1]), "selection_id": sid})
        clock.advance(119.9)
        r = await post(client, "/reservations", {"selection_id": "early"})
        assert (r.status_code, r.json()) == (201, booked("early"))
        clock.advance(0.1)
        r = await post(client, "/reservations", {"selection_id": "late"})
        assert (r.status_code, r.json()) == (404, no_pending("late"))


async def test_pending_selections_are_bounded_by_count(make_client) -> None:
    async with make_client(selection_cache_max_entries=2) as (app, client):
        await add_worker(client, A)
        for sid in ("p1", "p2", "p3"):
            await post(client, "/select", {**prompt([1]), "selection_id": sid})
        assert app.state.selection.pending.evicted == 1
        r = await post(client, "/reservations", {"selection_id": "p1"})
        assert (r.status_code, r.json()) == (404, no_pending("p1"))
        for sid in ("p2", "p3"):
            r = await post(client, "/reservations", {"selection_id": sid})
            assert (r.status_code, r.json()) == (201, booked(sid))


# -- explicit bookings --------------------------------------------------------------------------


async def test_explicit_booking_rules(client) -> None:
    await add_worker(client, A, data_parallel_size=2)
    await book(client, "no-ept", A, [1], isl=4, track_prefill_tokens=True)
    assert await rank_load(client) == (0, 1, 1)  # no ept: no prefill tokens
    await book(client, "ept", A, [2], isl=8, ept=6)
    assert await rank_load(client) == (6, 2, 2)
    await book(client, "untracked", A, [3], isl=8, ept=6, track_prefill_tokens=False)
    assert await rank_load(client) == (6, 3, 3)
    await book(client, "empty", A, None, seq=[], isl=0)  # isl 0 and no blocks: accepted
    assert await rank_load(client) == (6, 3, 4)
    r = await book(client, "rank1", A, [9], isl=4, dp_rank=1)
    assert r.json()["dp_rank"] == 1
    assert await overlap(client, [1]) == 1
    await book(client, "no-blocks", A, None, seq=[50, 51], isl=8)
    assert await overlap(client, [50, 51]) == 0  # sequence hashes alone write no cache
    r = await post(
        client,
        "/reservations",
        {"selection_id": "tok", "worker_id": A, "token_ids": list(range(8))},
    )
    assert (r.status_code, r.json()) == (201, booked("tok"))
    r = await post(client, "/overlap_scores", {"token_ids": list(range(8))})
    assert r.json()["workers"][0] == {**r.json()["workers"][0], "dp_rank": 0, "device_blocks": 2}
    # (token prompts write the cache too)


async def test_reservation_ids_are_global(client) -> None:
    await add_worker(client, A)
    await add_worker(client, B, model_name="other")
    await book(client, "s", A, [1], isl=4)
    for path, body in (
        ("/reservations", {"selection_id": "s", "model_name": "other", "worker_id": B, "sequence_hashes": [1], "isl_tokens": 4}),
        ("/select_and_reserve", {**prompt([1]), "selection_id": "s", "model_name": "other"}),
    ):  # fmt: skip
        r = await post(client, path, body)
        assert (r.status_code, r.json()["error"]) == (
            409,
            "selection s is already reserved or being reserved",
        )


# -- lifecycle ----------------------------------------------------------------------------------


async def test_prefill_complete_and_delete(client) -> None:
    await add_worker(client, A)
    await book(client, "s", A, [1, 2], isl=8, ept=8)
    assert await rank_load(client) == (8, 2, 1)
    for _ in range(2):  # repeatable while booked; needs no body
        r = await client.post(f"{SEL}/reservations/s/prefill_complete")
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
    assert await rank_load(client) == (0, 2, 1)
    r = await client.delete(f"{SEL}/reservations/s")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    assert await rank_load(client) == (0, 0, 0)
    assert await overlap(client, [1, 2]) == 2  # the cache outlives the reservation
    for call in (
        client.delete(f"{SEL}/reservations/s"),
        client.post(f"{SEL}/reservations/s/prefill_complete"),
    ):
        r = await call
        assert (r.status_code, r.json()) == (404, {"error": "reservation s not found"})


async def test_output_blocks_and_decay(client) -> None:
    await add_worker(client, A)
    await book(client, "s", A, [1, 2], isl=8)
    path = f"{SEL}/reservations/s/output_block"
    for body, blocks in (
        ({}, 3),
        ({}, 4),
        ({"decay_fraction": 0.5}, 3),
        ({"decay_fraction": 0}, 0),
        ({"decay_fraction": 1}, 7),
    ):
        r = await client.post(path, json=body)
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
        assert (await rank_load(client))[1] == blocks
    r = await client.post(path)
    assert (r.status_code, r.json()["error"]) == (
        415,
        "Expected request with `Content-Type: application/json`",
    )
    r = await client.post(f"{SEL}/reservations/unknown/output_block", json={"decay_fraction": 2})
    assert (r.status_code, r.json()["error"]) == (400, "decay_fraction must be between 0.0 and 1.0")


async def test_percent_encoded_ids(client) -> None:
    await add_worker(client, A)
    await book(client, "a b/c", A, [1], isl=4)
    r = await client.post(f"{SEL}/reservations/a%20b%2Fc/prefill_complete")
    assert (r.status_code, r.json()) == (200, OK)
    r = await client.delete(f"{SEL}/reservations/a%20b%2Fc")
    assert (r.status_code, r.json()) == (200, OK)
    r = await client.delete(f"{SEL}/reservations/a%20b%2Fc")
    assert (r.status_code, r.json()) == (404, {"error": "reservation a b/c not found"})


async def test_a_deleted_workers_reservation_ids_linger(client) -> None:
    await add_worker(client, A)
    await book(client, "s", A, [1], isl=4, ept=4)
    await client.delete(f"{SEL}/workers/{A}")
    await add_worker(client, A)
    assert await rank_load(client) == (0, 0, 0)  # freed with the worker
    r = await post(
        client,
        "/reservations",
        {"selection_id": "s", "worker_id": A, "sequence_hashes": [1], "isl_tokens": 4},
    )
    # ... but the id stays taken
    assert (r.status_code, r.json()) == (
        409,
        {"error": "selection s is already reserved or being reserved"},
    )
    r = await client.post(f"{SEL}/reservations/s/output_block", json={})
    # until a lifecycle call on it answers 404
    assert (r.status_code, r.json()) == (404, {"error": "reservation s not found"})
    r = await post(
        client,
        "/reservations",
        {"selection_id": "s", "worker_id": A, "sequence_hashes": [1], "isl_tokens": 4},
    )
    assert (r.status_code, r.json()) == (201, booked("s"))
    assert await rank_load(client) == (0, 1, 1)


async def test_lingering_ids_are_dropped_by_the_sweep_after_the_expiry(app, client, clock) -> None:
    selection = app.state.selection
    await add_worker(client, A)
    await book(client, "s", A, [1], isl=4)
    await client.delete(f"{SEL}/workers/{A}")
    clock.advance(299)
    selection.sweep()
    assert "s" in selection.reservations
    clock.advance(2)
    selection.sweep()
    assert "s" not in selection.reservations
    assert selection.reservations.lingering_dropped == 1


# -- the approximate cache ----------------------------------------------------------------------


async def test_cache_blocks_expire_ttl_after_their_last_write(make_client, clock) -> None:
    async with make_client(router_ttl_seconds=2) as (_, client):
        await add_worker(client, A)
        await book(client, "s1", A, [1, 2, 3, 4], isl=16)
        clock.advance(1.0)
        await book(client, "s2", A, [1, 2], isl=8)  # refreshes those two blocks only
        clock.advance(0.2)
        assert await overlap(client, [1, 2, 3, 4]) == 4
        clock.advance(1.3)  # 2.5 s after the first write
        assert await overlap(client, [1, 2, 3, 4]) == 2
        clock.advance(1.5)  # 4 s
        assert await overlap(client, [1, 2, 3, 4]) == 0


async def test_cache_is_keyed_by_the_block_hash_chain(client) -> None:
    await add_worker(client, A)
    await book(client, "s", A, [1, 2, 3], seq=[11, 12, 13], isl=12)
    r = await post(
        client,
        "/overlap_scores",
        {"block_hashes": [1, 2, 3], "sequence_hashes": [7, 8, 9], "isl_tokens": 12},
    )
    assert r.json()["workers"][0]["device_blocks"] == 3  # other sequence hashes: full overlap
    r = await post(
        client,
        "/overlap_scores",
        {"block_hashes": [5, 2, 3], "sequence_hashes": [11, 12, 13], "isl_tokens": 12},
    )
    assert r.json()["workers"][0]["device_blocks"] == 0  # block 0 differs


async def test_worker_removal_drops_its_cache_a_shrink_does_not(client) -> None:
    await add_worker(client, A, data_parallel_size=2)
    await book(client, "s", A, [1, 2], isl=8, dp_rank=1)
    await client.patch(f"{SEL}/workers/{A}", json={"data_parallel_size": 1})
    # rank 1 left the worker: no candidate any more, but still listed while it holds the prompt
    r = await post(client, "/overlap_scores", prompt([1, 2]))
    assert [(w["dp_rank"], w["device_blocks"]) for w in r.json()["workers"]] == [(0, 0), (1, 2)]
    r = await post(client, "/potential_loads", prompt([1, 2]))
    assert [w["dp_rank"] for w in r.json()] == [0]
    await client.patch(f"{SEL}/workers/{A}", json={"data_parallel_size": 2})
    assert await overlap(client, [1, 2], dp_rank=1) == 2
    await client.patch(f"{SEL}/workers/{A}", json={"endpoint": ""})
    await client.patch(f"{SEL}/workers/{A}", json={"endpoint": "e"})
    assert await overlap(client, [1, 2], dp_rank=1) == 0


# -- prefill tracking ---------------------------------------------------------------------------


async def test_track_prefill_tokens_off(make_client) -> None:
    async with make_client(router_track_prefill_tokens=False) as (_, client):
        await add_worker(client, A)
        r = await post(client, "/select_and_reserve", prompt([1, 2]))
        assert (r.json()["track_prefill_tokens"], r.json()["effective_prefill_tokens"]) == (
            False,
            8,
        )
        assert await rank_load(client) == (0, 2, 1)
        # nor does /potential_loads add the prompt's prefill tokens
        r = await post(client, "/potential_loads", prompt([5, 6]))
        assert r.json()[0]["potential_prefill_tokens"] == 0
        # an explicit booking's given prefill tokens still count unless it says false
        await book(client, "e", A, None, seq=[9], isl=6, ept=3)
        assert await rank_load(client) == (3, 3, 2)


async def test_override_sets_only_prefill_tracking(client) -> None:
    """As Dynamo 1.6.1 does: the override's cost knobs (CREDIT, SCALE, T) are validated but not
    applied; its `track_prefill_tokens` is."""
    await add_worker(client, A)
    await add_worker(client, B)
    await holds_p8(client)
    body = prompt(P8[:3] + [91, 92, 93, 94, 95])  # A 18, B 16: B wins
    for override in (
        {"prefill_load_scale": 0},
        {"overlap_score_credit": 5},
        {"router_temperature": 100},
    ):
        for _ in range(5):
            r = await post(client, "/select", {**body, "router_config_override": override})
            assert r.json()["worker_id"] == B
    r = await post(
        client,
        "/select_and_reserve",
        {**prompt([7]), "router_config_override": {"track_prefill_tokens": False}},
    )
    assert r.json()["track_prefill_tokens"] is False
    w = r.json()["worker_id"]
    assert (await rank_load(client, w))[0] == 0


async def test_untracked_prefill_is_no_load(client) -> None:
    """Observed on the reference: with the override's `track_prefill_tokens: false` a rank's
    pending prefill tokens do not count, in the cost and in `/potential_loads`."""
    await add_worker(client, A, data_parallel_size=2)
    await book(client, "p100", A, None, seq=[], isl=100, ept=100)  # rank 0: P 100
    await book(client, "d3", A, None, seq=[7, 8, 9], isl=12, dp_rank=1)  # rank 1: D 3
    body = prompt([50])
    untracked = {**body, "router_config_override": {"track_prefill_tokens": False}}
    for _ in range(5):
        assert (await post(client, "/select", body)).json()["dp_rank"] == 1  # 27 vs 5
        assert (await post(client, "/select", untracked)).json()["dp_rank"] == 0  # 2 vs 5
    rows = (await post(client, "/potential_loads", untracked)).json()
    assert [r["potential_prefill_tokens"] for r in rows] == [100, 0]
    rows = (await post(client, "/potential_loads", body)).json()
    assert [r["potential_prefill_tokens"] for r in rows] == [104, 4]
