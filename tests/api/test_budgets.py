"""The global budgets: beyond one, a call that would grow the state is answered 503 with the
reason, counted in ``kv_slot_tracker_budget_refusals_total``, and changes nothing; calls that
shrink the state always pass, and what they free is room again (the counts follow the state)."""

from __future__ import annotations

from typing import Any

from tests.api.conftest import post_json


def reg(worker_id: int, dp_size: int, model: str = "m") -> dict[str, Any]:
    return {"model_name": model, "worker_id": worker_id, "block_size": 4, "dp_start": 0,
            "dp_size": dp_size}  # fmt: skip


def add(rid: str, hashes: list[int]) -> dict[str, Any]:
    return {"model_name": "m", "request_id": rid, "worker_id": 1, "dp_rank": 0,
            "sequence_hashes": hashes}  # fmt: skip


async def metric(client, name: str, budget: str) -> float:
    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith(f'{name}{{budget="{budget}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_the_ranks_budget_refuses_registrations_past_it(make_client) -> None:
    async with make_client(max_ranks=5) as (_, client):
        assert (await post_json(client, "/register", reg(1, 3))).status_code == 201
        r = await post_json(client, "/register", reg(2, 3, "other"))
        assert r.status_code == 503, r.text
        assert r.json()["error"].startswith(
            "this instance is at its worker ranks budget: it holds 3, the call adds 3, the "
            "budget is 5 (max_ranks)"
        )
        assert (await client.get("/workers", params={"model_name": "other"})).json() == []
        assert await metric(client, "kv_slot_tracker_budget_refusals_total", "worker ranks") == 1
        assert (await post_json(client, "/register", reg(2, 2, "other"))).status_code == 201
        upsert = await post_json(client, "/upsert", reg(1, 4))  # 3 -> 4 ranks: one too many
        assert upsert.status_code == 503, upsert.text
        assert (
            await post_json(client, "/unregister", {"model_name": "m", "worker_id": 1})
        ).status_code == 200
        assert await metric(client, "kv_slot_tracker_budget_used", "worker ranks") == 2
        assert (await post_json(client, "/upsert", reg(1, 3))).status_code == 201


async def test_the_active_requests_budget_counts_adds_frees_and_removed_ranks(make_client) -> None:
    async with make_client(max_active_requests=2) as (_, client):
        assert (await post_json(client, "/register", reg(1, 1))).status_code == 201
        assert (await post_json(client, "/add", add("a", [1]))).status_code == 201
        assert (await post_json(client, "/add", add("b", [2]))).status_code == 201
        r = await post_json(client, "/add", add("c", [3]))
        assert r.status_code == 503, r.text
        assert "active requests budget: it holds 2" in r.json()["error"]
        assert (
            await post_json(client, "/free", {"model_name": "m", "request_id": "a"})
        ).status_code == 200
        assert (await post_json(client, "/add", add("c", [3]))).status_code == 201
        # unregistering the worker frees its requests: all the room comes back
        await post_json(client, "/unregister", {"model_name": "m", "worker_id": 1})
        assert await metric(client, "kv_slot_tracker_budget_used", "active requests") == 0
        assert await metric(client, "kv_slot_tracker_budget_used", "block hashes") == 0
        assert await metric(client, "kv_slot_tracker_budget_refusals_total", "active requests") == 1


async def test_the_block_hashes_budget_counts_every_prompt_hash_held(make_client) -> None:
    async with make_client(max_block_hashes=10) as (_, client):
        await post_json(client, "/register", reg(1, 1))
        assert (await post_json(client, "/add", add("a", list(range(8))))).status_code == 201
        r = await post_json(client, "/add", add("b", list(range(3))))
        assert r.status_code == 503, r.text
        assert (
            "block hashes budget: it holds 8, the call adds 3, the budget is 10"
            in r.json()["error"]
        )
        assert (await post_json(client, "/add", add("b", list(range(2))))).status_code == 201
        await post_json(client, "/free", {"model_name": "m", "request_id": "a"})
        assert await metric(client, "kv_slot_tracker_budget_used", "block hashes") == 2


async def test_the_selection_workers_budget_counts_incomplete_workers(make_client) -> None:
    async with make_client(max_selection_workers=2) as (_, client):
        for wid in (1, 2):  # no endpoint: stored as incomplete all the same
            r = await post_json(
                client, "/selection/workers", {"worker_id": wid, "model_name": f"n{wid}"}
            )
            assert r.status_code == 201, r.text
        r = await post_json(client, "/selection/workers", {"worker_id": 3})
        assert r.status_code == 503, r.text
        assert "selection workers budget" in r.json()["error"]
        again = await post_json(client, "/selection/workers", {"worker_id": 2, "model_name": "x"})
        assert again.status_code == 201  # a known worker is replaced, not added
        assert len((await client.get("/selection/workers")).json()) == 2
        assert await metric(client, "kv_slot_tracker_budget_used", "selection workers") == 2
        assert await metric(client, "kv_slot_tracker_budget_limit", "selection workers") == 2
        assert (await client.delete("/selection/workers/1")).status_code == 200
        assert (await post_json(client, "/selection/workers", {"worker_id": 3})).status_code == 201


async def test_past_the_memory_budget_growing_calls_are_refused_and_shrinking_ones_pass(
    make_client,
) -> None:
    async with make_client(memory_budget_bytes=1) as (app, client):
        r = await post_json(client, "/register", reg(1, 1))
        assert r.status_code == 503, r.text
        assert r.json()["error"].startswith("this instance is at its memory budget: ")
        assert "(memory_budget_bytes)" in r.json()["error"]
        assert (
            await post_json(client, "/free", {"model_name": "m", "request_id": "a"})
        ).status_code in (200, 404)
        assert await metric(client, "kv_slot_tracker_budget_refusals_total", "memory") == 1
        assert await metric(client, "kv_slot_tracker_budget_limit", "memory") == 1


def test_default_budgets_are_sized_from_the_memory_limit() -> None:
    from kv_slot_tracker.core import limits
    from kv_slot_tracker.main import budgets_for
    from kv_slot_tracker.settings import load_settings

    b = budgets_for(load_settings(api_key="", redis_url=""), memory_limit=1 << 30)
    assert b.memory_bytes == int((1 << 30) * 0.85)
    quarter = b.memory_bytes * 0.25
    assert (b.active_requests, b.ranks, b.block_hashes, b.selection_workers) == (
        int(quarter // limits.BYTES_PER_REQUEST), int(quarter // limits.BYTES_PER_RANK),
        int(quarter // limits.BYTES_PER_HASH), int(quarter // limits.BYTES_PER_SELECTION_WORKER))  # fmt: skip
    assert limits.BYTES_PER_RANK == 6144  # measured: 5.2 kB a rank (bench/budget_bench.py)
    given = budgets_for(load_settings(api_key="", redis_url="", max_ranks=7), memory_limit=1 << 30)
    assert given.ranks == 7 and given.active_requests == b.active_requests


async def test_selection_workers_take_ranks_from_the_ranks_budget_on_post_and_patch(
    make_client,
) -> None:
    async with make_client(max_ranks=4) as (_, client):
        worker = {"worker_id": 1, "block_size": 16, "endpoint": "http://w1:8000",
                  "data_parallel_size": 2}  # fmt: skip
        r = await post_json(client, "/selection/workers", worker)
        assert r.status_code == 201 and r.json()["lifecycle"] == "schedulable", r.text
        grow = await client.patch("/selection/workers/1", json={"data_parallel_size": 5})
        assert grow.status_code == 503, grow.text
        assert (
            "worker ranks budget: it holds 2, the call adds 3, the budget is 4"
            in grow.json()["error"]
        )
        assert (await client.get("/selection/workers")).json()[0]["data_parallel_size"] == 2
        fits = await client.patch("/selection/workers/1", json={"data_parallel_size": 4})
        assert fits.status_code == 200, fits.text
        assert await metric(client, "kv_slot_tracker_budget_used", "worker ranks") == 4
