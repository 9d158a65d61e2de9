"""Released reservation ids on one instance, over HTTP: a booking of an id whose reservation
was freed is refused (409, nothing changed) while its tombstone lasts, in every booking form;
lifecycle calls on it answer 404 as for any unknown reservation (SELECTION.md §8); tombstones
are bounded by their ttl and their count, and counted in the metrics. Time is the fake clock.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api.selection.helpers import SEL, A, B, add_worker, book, post, prompt


def released(sid: str) -> dict[str, str]:
    return {
        "error": f"selection {sid} was released and cannot be reserved again "
        "(a late duplicate of a finished booking; use a new selection_id)"
    }


async def state(client: httpx.AsyncClient) -> dict[str, Any]:
    """What a client can read of the selection state."""
    return {
        "loads": (await client.get(f"{SEL}/loads")).json(),
        "dump": (await client.get(f"{SEL}/dump")).json(),
    }


def metric(app: Any, name: str) -> float | None:
    return app.state.registry.get_sample_value(f"kv_slot_tracker_selection_{name}")


async def free(client: httpx.AsyncClient, sid: str) -> None:
    r = await client.delete(f"{SEL}/reservations/{sid}")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


BOOKINGS = {
    "select_and_reserve": ("/select_and_reserve", {**prompt([1, 2]), "selection_id": "s"}, 200),
    "explicit": (
        "/reservations",
        {**prompt([1, 2]), "selection_id": "s", "worker_id": A, "effective_prefill_tokens": 8},
        201,
    ),
}


@pytest.mark.parametrize("form", sorted(BOOKINGS))
async def test_the_same_booking_after_the_free_is_refused_and_changes_nothing(
    app, client, form: str
) -> None:
    await add_worker(client, A)
    await add_worker(client, B)
    path, body, ok = BOOKINGS[form]
    assert (await post(client, path, body)).status_code == ok
    await free(client, "s")
    await add_worker(client, 9, model_name="m2")
    before = await state(client)
    r = await post(client, path, body)
    assert (r.status_code, r.json()) == (409, released("s"))
    assert await state(client) == before  # no load, no cache write
    assert metric(app, "reservation_tombstones_refused_total") == 1
    # refused in another partition too (reservation ids are global)
    r = await post(client, "/reservations", {**body, "worker_id": 9, "model_name": "m2"})
    assert (r.status_code, r.json()) == (409, released("s"))
    assert await state(client) == before
    # a fresh id books as ever
    assert (await post(client, path, {**body, "selection_id": "t"})).status_code == ok


async def test_a_replay_of_a_pending_selection_after_the_free_is_refused(app, client) -> None:
    await add_worker(client, A)
    await post(client, "/select", {**prompt([3]), "selection_id": "p"})
    assert (await post(client, "/reservations", {"selection_id": "p"})).status_code == 201
    await free(client, "p")
    # a select may cache the id again (it books nothing), but its replay is refused
    assert (await post(client, "/select", {**prompt([3]), "selection_id": "p"})).status_code == 200
    before = await state(client)
    r = await post(client, "/reservations", {"selection_id": "p"})
    assert (r.status_code, r.json()) == (409, released("p"))
    assert await state(client) == before
    assert len(app.state.selection.pending) == 1  # the entry is kept, as for any 409


async def test_lifecycle_calls_on_a_freed_reservation_answer_404(client) -> None:
    await add_worker(client, A)
    assert (await post(client, "/select_and_reserve", {**prompt([1]), "selection_id": "s"})).status_code == 200  # fmt: skip
    await free(client, "s")
    before = await state(client)
    not_found = {"error": "reservation s not found"}
    for r in (
        await post(client, "/reservations/s/prefill_complete", {}),
        await post(client, "/reservations/s/output_block", {}),
        await post(client, "/reservations/s/output_block", {"decay_fraction": 0.5}),
        await client.delete(f"{SEL}/reservations/s"),
    ):
        assert (r.status_code, r.json()) == (404, not_found)
    assert await state(client) == before


async def test_a_tombstone_lasts_its_ttl(make_client, clock) -> None:
    async with make_client(reservation_tombstone_ttl_seconds=10) as (app, client):
        await add_worker(client, A)
        body = {**prompt([1]), "selection_id": "s"}
        assert (await post(client, "/select_and_reserve", body)).status_code == 200
        await free(client, "s")
        clock.advance(9.999)
        assert (await post(client, "/select_and_reserve", body)).status_code == 409
        clock.advance(0.001)
        assert (await post(client, "/select_and_reserve", body)).status_code == 200
        assert metric(app, "reservation_tombstones") == 1
        app.state.selection.sweep()  # as the expiry sweep does
        assert metric(app, "reservation_tombstones") == 0
        assert metric(app, "reservation_tombstones_dropped_total") == 1


async def test_tombstones_are_bounded_by_count_oldest_first(make_client) -> None:
    async with make_client(reservation_tombstone_capacity=2) as (app, client):
        await add_worker(client, A)
        for sid in ("a", "b", "c"):
            await book(client, sid, A, [1], isl=4)
            await free(client, sid)
        assert metric(app, "reservation_tombstones") == 2
        assert metric(app, "reservation_tombstones_created_total") == 3
        assert metric(app, "reservation_tombstones_dropped_total") == 1
        assert (await post(client, "/select_and_reserve", {**prompt([1]), "selection_id": "a"})).status_code == 200  # fmt: skip
        for sid in ("b", "c"):
            r = await post(client, "/select_and_reserve", {**prompt([1]), "selection_id": sid})
            assert (r.status_code, r.json()) == (409, released(sid))


async def test_a_slot_tracker_add_of_a_released_id_in_its_partition_is_refused(app, client) -> None:
    """The peers drop an add of a released reservation id in the partition (its record is a
    late booking's to them), so the instance taking the call refuses it too: every instance
    holds the same requests."""
    worker = await add_worker(client, A)
    assert (await post(client, "/select_and_reserve", {**prompt([1, 2]), "selection_id": "s"})
            ).status_code == 200  # fmt: skip
    await free(client, "s")
    add = {"model_name": worker["model_name"], "request_id": "s", "worker_id": A, "dp_rank": 0,
           "sequence_hashes": [1, 2]}  # fmt: skip
    if worker.get("routing_group"):
        add["routing_group"] = worker["routing_group"]
    before = await state(client)
    r = await client.post("/add", json=add)
    assert (r.status_code, r.json()) == (409, released("s"))
    assert await state(client) == before
    # another id in the partition is added as ever
    assert (await client.post("/add", json={**add, "request_id": "u"})).status_code == 201
