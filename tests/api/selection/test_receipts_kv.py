"""Routing receipts with KV events on: what the engine's events show without a client's help.

A receipt records the overlap the chosen rank had at decision time; when that rank next stores
blocks of the prompt (the first block past the predicted prefix), the receipt learns how many of
the predicted blocks the rank still held. Events go through the service's KV apply call, as the
ZMQ listener delivers them (``KvEvents.apply_kv_batch``). Workers A=1, B=2, block size 4; the
prompt is tokens 0..31 (8 blocks); A holds its first 4 blocks (engine hashes 101..104).
"""

from __future__ import annotations

from typing import Any

import pytest

from kv_slot_tracker.ingest.records import BlocksRemoved, BlocksStored, KvBatch
from tests.api.selection.helpers import SEL, A, B, add_worker, post

TOKENS = list(range(32))
GPU = 0


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"router_use_kv_events": True, "selection_seed": 5}


class Engine:
    """A's engine, publishing batches into the service as its listener would."""

    def __init__(self, app) -> None:
        self.kv = app.state.selection.kv_events
        self.seq = 0

    def send(self, *events) -> None:
        self.seq += 1
        self.kv.apply_kv_batch(A, 0, KvBatch(self.seq, 0, tuple(events)))

    def store(self, hashes: list[int], parent: int | None, first_block: int) -> None:
        tokens = TOKENS[first_block * 4 : (first_block + len(hashes)) * 4]
        self.send(BlocksStored(tuple(hashes), parent, tuple(tokens), 4, GPU, None))


async def fleet(client, app) -> Engine:
    for w in (A, B):
        await add_worker(client, w, kv_events_endpoint="tcp://127.0.0.1:9")
    engine = Engine(app)
    engine.store([101, 102, 103, 104], None, 0)
    return engine


async def receipt(client, rid: str) -> dict[str, Any]:
    r = await client.get(f"{SEL}/receipts/{rid}")
    assert r.status_code == 200, r.text
    return r.json()


async def test_the_predicted_blocks_were_still_held(client, app) -> None:
    engine = await fleet(client, app)
    r = await post(client, "/select_and_reserve", {"token_ids": TOKENS, "selection_id": "k1"})
    assert r.json()["worker_id"] == A
    body = await receipt(client, "k1")
    assert (body["chosen_overlap_blocks"], body["max_overlap_blocks"]) == (4, 4)
    assert [c["cost"] for c in body["candidates"]] == [12.0, 16.0]  # (8 - 4) + 8, 8 + 8
    assert body["outcome"]["kv_predicted_blocks"] is None
    engine.store([105, 106, 107, 108], 104, 4)  # the engine stores the rest of the prompt
    out = (await receipt(client, "k1"))["outcome"]
    assert (out["kv_predicted_blocks"], out["kv_still_held_blocks"]) == (4, 4)


async def test_blocks_evicted_before_the_rest_was_stored(client, app) -> None:
    engine = await fleet(client, app)
    await post(client, "/select_and_reserve", {"token_ids": TOKENS, "selection_id": "k2"})
    engine.send(BlocksRemoved((103, 104), GPU))  # evicted before the request ran
    engine.store([203, 204, 205, 206, 207, 208], 102, 2)  # recomputed from block 2 on
    out = (await receipt(client, "k2"))["outcome"]
    assert (out["kv_predicted_blocks"], out["kv_still_held_blocks"]) == (4, 2)
    text = (await client.get("/metrics")).text
    assert (
        'kv_slot_tracker_router_kv_check_blocks_total{kind="predicted",model_name="default",'
        'routing_group="default"} 4.0' in text
    )
    assert (
        'kv_slot_tracker_router_kv_check_blocks_total{kind="still_held",model_name="default",'
        'routing_group="default"} 2.0' in text
    )


async def test_a_selection_on_an_empty_rank_is_not_watched(client, app) -> None:
    engine = await fleet(client, app)
    r = await post(
        client,
        "/select_and_reserve",
        {
            "token_ids": TOKENS,
            "selection_id": "k3",
            "pinned_worker": {"worker_id": B, "dp_rank": 0},
        },
    )
    assert r.json()["worker_id"] == B
    body = await receipt(client, "k3")
    assert (body["chosen_overlap_blocks"], body["non_optimal_reason"]) == (0, "pin")
    engine.store([105, 106, 107, 108], 104, 4)  # A's store: not the chosen rank
    assert (await receipt(client, "k3"))["outcome"]["kv_predicted_blocks"] is None


async def test_a_select_then_an_explicit_booking_is_watched_as_a_reservation(client, app) -> None:
    engine = await fleet(client, app)
    r = await post(client, "/select", {"token_ids": TOKENS, "selection_id": "k4"})
    assert r.json()["worker_id"] == A
    engine.store([105, 106, 107, 108], 104, 4)  # not booked yet: nothing is watched
    assert (await receipt(client, "k4"))["outcome"]["kv_predicted_blocks"] is None
    engine.send(BlocksRemoved((105, 106, 107, 108, 104), GPU))
    r = await post(
        client, "/reservations", {"token_ids": TOKENS, "selection_id": "k4", "worker_id": A}
    )
    assert r.status_code == 201, r.text
    assert (await receipt(client, "k4"))["outcome"]["state"] == "booked"
    engine.store([204, 205, 206, 207, 208], 103, 3)  # block 3 was evicted: recomputed from it
    out = (await receipt(client, "k4"))["outcome"]
    assert (out["kv_predicted_blocks"], out["kv_still_held_blocks"]) == (4, 3)
