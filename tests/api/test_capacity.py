"""What a client can make the service hold is bounded: trackers and selection partitions
(``max_trackers``), with a clear answer when the bound is met."""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.conftest import post_json

pytestmark = pytest.mark.asyncio


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"max_trackers": 3}


def reg(model: str, worker_id: int = 1) -> dict[str, Any]:
    return {"model_name": model, "worker_id": worker_id, "block_size": 4, "dp_start": 0,
            "dp_size": 1}  # fmt: skip


async def test_a_new_tracker_beyond_max_trackers_is_refused_with_503(client) -> None:
    for m in ("a", "b", "c"):
        assert (await post_json(client, "/register", reg(m))).status_code == 201
    for path in ("/register", "/upsert"):
        r = await post_json(client, path, reg("d"))
        assert (r.status_code, r.json()) == (503, {"error": (
            "cannot create a tracker for model=d routing_group=default: this instance already "
            "holds 3 trackers (max_trackers); unregister unused ones first")})  # fmt: skip
    r = await post_json(client, "/reconcile", {"model_name": "d", "block_size": 4,
                                               "workers": [{"worker_id": 1, "dp_start": 0,
                                                            "dp_size": 1}]})  # fmt: skip
    assert r.status_code == 503
    assert (await post_json(client, "/register", reg("a", 2))).status_code == 201  # existing key
    assert len((await client.get("/workers")).json()) == 4
    await post_json(client, "/unregister", {"model_name": "c", "worker_id": 1})
    assert (await post_json(client, "/register", reg("d"))).status_code == 201  # room again


async def test_selection_partitions_share_the_limit_and_unused_ones_make_room(client) -> None:
    def worker(wid: int, model: str) -> dict[str, Any]:
        return {"worker_id": wid, "model_name": model, "endpoint": "http://w", "block_size": 4}

    for wid, m in ((1, "a"), (2, "b"), (3, "c")):
        r = await post_json(client, "/selection/workers", worker(wid, m))
        assert r.json()["lifecycle"] == "schedulable"
    r = await post_json(client, "/selection/workers", worker(4, "d"))
    assert r.status_code == 201
    assert r.json()["lifecycle"] == "incomplete"
    assert r.json()["not_schedulable_reasons"] == [
        "cannot create a tracker for model=d routing_group=default: this instance already "
        "holds 3 trackers (max_trackers); unregister unused ones first"
    ]
    # a deleted worker's partition stays listed until its place is needed
    assert (await client.delete("/selection/workers/3")).status_code == 200
    models = [p["model_name"] for p in (await client.get("/selection/loads")).json()]
    assert models == ["a", "b", "c"]
    r = await client.patch("/selection/workers/4", json={"endpoint": "http://w4"})
    assert r.json()["lifecycle"] == "schedulable"
    models = [p["model_name"] for p in (await client.get("/selection/loads")).json()]
    assert models == ["a", "b", "d"]
    assert 'model_name="c"' not in (await client.get("/metrics")).text


async def test_output_blocks_per_request_are_capped(client, monkeypatch) -> None:
    from kv_slot_tracker.core.sequences import ActiveSequences

    monkeypatch.setattr(ActiveSequences, "max_output_blocks", 3)
    assert (await post_json(client, "/register", reg("m"))).status_code == 201
    add = {"model_name": "m", "request_id": "r", "worker_id": 1, "dp_rank": 0,
           "sequence_hashes": [1]}  # fmt: skip
    assert (await post_json(client, "/add", add)).status_code == 201
    call = {"model_name": "m", "request_id": "r"}
    for _ in range(3):
        assert (await post_json(client, "/output_block", call)).status_code == 200
    r = await post_json(client, "/output_block", {**call, "decay_fraction": 0.5})
    assert (r.status_code, r.json()) == (
        422, {"error": "request r already holds the most output blocks, 3"})  # fmt: skip
    r = await post_json(client, "/batch", {"operations": [{"op": "output_block", **call}]})
    assert r.json() == {"results": [{"status": 422, "error": (
        "request r already holds the most output blocks, 3")}]}  # fmt: skip
    loads = (await client.get("/loads")).json()
    assert loads[0]["active_decode_blocks"] == 4  # the prompt's block and three output blocks
