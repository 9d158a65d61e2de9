"""The selection API and the slot-tracker API on one server: one set of trackers.

A selection worker's ranks are registered in its partition's tracker, and a reservation is a
request of that tracker (its id is the selection id), so the slot-tracker routes and metrics see
reservations; what each API does alone is its reference's behaviour (docs/api.md, "Selection API").
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.conftest import post_json
from tests.api.selection.helpers import SEL, A, B, add_worker, book, post, prompt


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"selection_seed": 9}


async def slot_loads(client) -> list[tuple]:
    r = await client.get("/loads", params={"model_name": "default"})
    return [
        (x["worker_id"], x["dp_rank"], x["active_prefill_tokens"], x["active_decode_blocks"],
         x["active_requests"])
        for x in r.json()
    ]  # fmt: skip


async def test_a_reservation_shows_in_the_slot_tracker_loads_and_metrics(client) -> None:
    await add_worker(client, A)
    r = await post(client, "/select_and_reserve", {**prompt([1, 2, 3]), "selection_id": "s"})
    assert r.status_code == 200
    assert await slot_loads(client) == [(A, 0, 12, 3, 1)]
    metrics = (await client.get("/metrics")).text
    assert 'model_name="default"' in metrics
    # the slot-tracker lifecycle routes act on it too
    r = await post_json(client, "/prefill_complete", {"model_name": "default", "request_id": "s"})
    assert r.status_code == 200
    assert await slot_loads(client) == [(A, 0, 0, 3, 1)]
    await client.delete(f"{SEL}/reservations/s")
    assert await slot_loads(client) == [(A, 0, 0, 0, 0)]


async def test_a_request_freed_through_the_slot_routes_is_gone_for_selection(client) -> None:
    await add_worker(client, A)
    await book(client, "s", A, [1], isl=4)
    r = await post_json(client, "/free", {"model_name": "default", "request_id": "s"})
    assert r.status_code == 200
    r = await client.delete(f"{SEL}/reservations/s")
    assert (r.status_code, r.json()) == (404, {"error": "reservation s not found"})
    await book(client, "s", A, [1], isl=4)  # the id is free again


async def test_a_slot_request_id_cannot_be_booked(client) -> None:
    await add_worker(client, A)
    add = {
        "model_name": "default",
        "request_id": "r1",
        "worker_id": A,
        "dp_rank": 0,
        "sequence_hashes": [5],
    }
    assert (await post_json(client, "/add", add)).status_code == 201
    r = await post(client, "/reservations", {"selection_id": "r1", "worker_id": A, "sequence_hashes": [1], "isl_tokens": 4})  # fmt: skip
    assert (r.status_code, r.json()) == (
        409,
        {"error": "selection r1 is already reserved or being reserved"},
    )
    # the slot request still counts in the selection's view of the rank
    r = await client.get(f"{SEL}/loads")
    assert r.json()[0]["loads"][0]["active_requests"] == 1


async def test_slot_registered_workers_are_no_selection_candidates(client) -> None:
    await add_worker(client, A)
    reg = {"model_name": "default", "worker_id": B, "block_size": 4, "dp_start": 0, "dp_size": 1}
    assert (await post_json(client, "/register", reg)).status_code == 201
    picks = {(await post(client, "/select", prompt([1]))).json()["worker_id"] for _ in range(20)}
    assert picks == {A}
    r = await client.get(f"{SEL}/loads")
    assert [x["worker_id"] for x in r.json()[0]["loads"]] == [A]
    assert [x[0] for x in await slot_loads(client)] == [A, B]


async def test_a_worker_unregistered_through_the_slot_routes_stops_being_a_candidate(
    client,
) -> None:
    await add_worker(client, A)
    r = await post_json(client, "/unregister", {"model_name": "default", "worker_id": A})
    assert r.status_code == 200
    r = await post(client, "/select", prompt([1]))
    assert (r.status_code, r.json()) == (
        503,
        {"error": "no schedulable workers for model=default routing_group=default"},
    )
    # the catalog still lists it; upserting it places it again
    assert (await client.get(f"{SEL}/workers")).json()[0]["lifecycle"] == "schedulable"
    await add_worker(client, A)
    assert (await post(client, "/select", prompt([1]))).status_code == 200


async def test_the_tracker_block_size_decides_for_selection_workers(client) -> None:
    reg = {"model_name": "default", "worker_id": B, "block_size": 16, "dp_start": 0, "dp_size": 1}
    assert (await post_json(client, "/register", reg)).status_code == 201
    r = await post(client, "/workers", {"worker_id": A, "endpoint": "e", "block_size": 4})
    assert r.json()["not_schedulable_reasons"] == [
        "reconciliation failed: block_size mismatch for model=default routing_group=default: "
        "existing=16 requested=4"
    ]


async def test_after_the_last_worker_each_api_keeps_its_own_view(client) -> None:
    await add_worker(client, A)
    await client.delete(f"{SEL}/workers/{A}")
    assert (await client.get("/loads")).json() == []  # the slot tracker drops the tracker
    r = await client.get(f"{SEL}/loads")  # the selection API keeps listing the partition
    assert [(p["model_name"], p["loads"]) for p in r.json()] == [("default", [])]
