"""``/metrics`` for the selection API: catalog workers by lifecycle, reservations, approximate
cache entries and pending selections per partition (read at scrape time), and the counters of
selections, bookings, evictions and dropped ids, with exact values after known calls."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api.conftest import post_json
from tests.api.selection.helpers import BS, SEL, A, B, C, add_worker, book, post, prompt
from tests.api.test_metrics import Scrape, scrape
from tests.fakes import FakeClock

DEFAULT = ("default", "default")
M2 = ("m2", "default")
OUTCOMES = ("select", "select_and_reserve", "replay", "explicit")


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"selection_seed": 5, "selection_cache_max_entries": 2}


def workers(m: Scrape, key: tuple[str, str]) -> tuple:
    """(schedulable, incomplete, unschedulable) catalog workers of a partition."""
    return tuple(
        m.value(
            "kv_slot_tracker_selection_workers",
            model_name=key[0],
            routing_group=key[1],
            lifecycle=lifecycle,
        )
        for lifecycle in ("schedulable", "incomplete", "unschedulable")
    )


def reservations(m: Scrape, key: tuple[str, str]) -> tuple:
    """(active, lingering) reservation ids of a partition."""
    return tuple(
        m.value(
            "kv_slot_tracker_selection_reservations",
            model_name=key[0],
            routing_group=key[1],
            state=state,
        )
        for state in ("active", "lingering")
    )


def selections(m: Scrape, key: tuple[str, str]) -> tuple:
    """(select, select_and_reserve, replay, explicit) of a partition."""
    return tuple(
        m.value(
            "kv_slot_tracker_selections_total",
            model_name=key[0],
            routing_group=key[1],
            outcome=outcome,
        )
        for outcome in OUTCOMES
    )


def cached(m: Scrape, key: tuple[str, str]) -> float | None:
    return m.value(
        "kv_slot_tracker_selection_cached_blocks", model_name=key[0], routing_group=key[1]
    )


def dropped(m: Scrape) -> tuple:
    """(pending evicted, pending expired, lingering dropped, stale dropped) counters."""
    return tuple(
        m.value(f"kv_slot_tracker_selection_{name}_total")
        for name in ("pending_evicted", "pending_expired", "lingering_dropped", "stale_dropped")
    )


async def ok(resp: httpx.Response, status: int = 200) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()


async def test_catalog_reservations_cache_and_selections(client: httpx.AsyncClient) -> None:
    m = await scrape(client)
    assert m.series("kv_slot_tracker_selection_workers") == []
    assert m.value("kv_slot_tracker_selection_pending") == 0
    assert dropped(m) == (0, 0, 0, 0)

    await add_worker(client, A)
    body = await ok(await post(client, "/workers", {"worker_id": B, "block_size": BS}), 201)
    assert body["lifecycle"] == "incomplete"  # no endpoint
    await add_worker(client, C, model_name="m2")
    m = await scrape(client)
    assert m.families["kv_slot_tracker_selection_workers"].type == "gauge"
    assert m.families["kv_slot_tracker_selections"].type == "counter"
    assert workers(m, DEFAULT) == (1, 1, 0)
    assert workers(m, M2) == (1, 0, 0)
    assert selections(m, DEFAULT) == (0, 0, 0, 0)
    assert reservations(m, M2) == (0, 0)
    assert cached(m, DEFAULT) == 0

    ids = []
    for blocks in ([1, 2], [1, 2, 3], [7]):  # all on A, the only candidate: 4 distinct blocks
        body = await ok(await post(client, "/select_and_reserve", prompt(blocks)))
        ids.append(body["selection_id"])
    await ok(await post(client, "/select", {**prompt([7]), "selection_id": "p"}))
    await ok(await post(client, "/select", prompt([9])))  # no id: nothing kept, nothing booked
    m = await scrape(client)
    assert m.value("kv_slot_tracker_selection_pending") == 1
    await ok(await post(client, "/reservations", {"selection_id": "p"}), 201)  # replay
    await book(client, "e", C, [5, 6], isl=8, model_name="m2")
    await ok(await client.delete(f"{SEL}/reservations/{ids[0]}"))
    await ok(await post(client, "/select", prompt([1])), 200)
    r = await post(client, "/select", {**prompt([1]), "model_name": "none"})
    assert r.status_code == 503  # a failed selection counts nowhere

    m = await scrape(client)
    assert selections(m, DEFAULT) == (3, 3, 1, 0)
    assert selections(m, M2) == (0, 0, 0, 1)
    assert reservations(m, DEFAULT) == (3, 0)  # 3 reserved + 1 replayed - 1 released
    assert reservations(m, M2) == (1, 0)
    assert cached(m, DEFAULT) == 4
    assert cached(m, M2) == 2
    assert m.value("kv_slot_tracker_selection_pending") == 0  # the replay consumed it
    assert m.series("kv_slot_tracker_selections_total") == [
        {"model_name": model, "routing_group": "default", "outcome": outcome}
        for model in ("default", "m2")
        for outcome in OUTCOMES
    ]

    # deleting C: its booking lingers, its cached blocks go, its partition leaves the catalog
    await ok(await client.delete(f"{SEL}/workers/{C}"))
    # A's ranks removed through the slot-tracker route: listed schedulable, not a candidate
    await ok(await post_json(client, "/unregister", {"worker_id": A, "model_name": "default"}))
    m = await scrape(client)
    assert reservations(m, M2) == (0, 1)
    assert cached(m, M2) == 0
    assert workers(m, M2) == (None, None, None)
    assert workers(m, DEFAULT) == (0, 1, 1)
    assert selections(m, M2) == (0, 0, 0, 1)  # counters stay

    await add_worker(client, A)  # posted again: a candidate again
    m = await scrape(client)
    assert workers(m, DEFAULT) == (1, 1, 0)


async def test_pending_evictions_expiry_and_dropped_ids(
    app, client: httpx.AsyncClient, clock: FakeClock
) -> None:
    selection = app.state.selection
    await add_worker(client, A)
    for sid in ("a", "b", "c"):  # the cache holds 2 (selection_cache_max_entries)
        await ok(await post(client, "/select", {**prompt([1]), "selection_id": sid}))
    m = await scrape(client)
    assert m.value("kv_slot_tracker_selection_pending") == 2
    assert dropped(m) == (1, 0, 0, 0)

    clock.advance(app.state.settings.selection_cache_ttl_seconds)
    selection.sweep()
    m = await scrape(client)
    assert m.value("kv_slot_tracker_selection_pending") == 0
    assert dropped(m) == (1, 2, 0, 0)

    # a reservation freed through the slot-tracker route is stale until the sweep drops it
    await ok(await post(client, "/select_and_reserve", {**prompt([1]), "selection_id": "r1"}))
    await ok(await post_json(client, "/free", {"model_name": "default", "request_id": "r1"}))
    m = await scrape(client)
    assert reservations(m, DEFAULT) == (1, 0)
    selection.sweep()
    m = await scrape(client)
    assert reservations(m, DEFAULT) == (0, 0)
    assert dropped(m) == (1, 2, 0, 1)

    # a booking of a deleted worker lingers until the request expiry has passed
    await ok(await post(client, "/select_and_reserve", {**prompt([1]), "selection_id": "r2"}))
    await ok(await client.delete(f"{SEL}/workers/{A}"))
    selection.sweep()
    m = await scrape(client)
    assert reservations(m, DEFAULT) == (0, 1)
    clock.advance(app.state.settings.expiry_seconds + 1)
    selection.sweep()
    m = await scrape(client)
    assert reservations(m, DEFAULT) == (0, 0)
    assert dropped(m) == (1, 2, 1, 1)
    assert selections(m, DEFAULT) == (3, 2, 0, 0)
    for name in ("pending_evicted", "pending_expired", "lingering_dropped", "stale_dropped"):
        assert m.families[f"kv_slot_tracker_selection_{name}"].type == "counter"
