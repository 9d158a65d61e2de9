"""Strings a client may make the service keep have a length limit (``kv_slot_tracker.core.limits``): at the
limit a call is served, one character over it is a 422 that changes nothing, on the plain
(msgspec) path and the validating (pydantic) path alike."""

from __future__ import annotations

from typing import Any

import pytest

from kv_slot_tracker.core.limits import MAX_ID_LENGTH, MAX_NAME_LENGTH, MAX_TEXT_LENGTH
from tests.api.conftest import post_json

pytestmark = pytest.mark.asyncio

NAME, ID = "n" * MAX_NAME_LENGTH, "i" * MAX_ID_LENGTH


def reg(model: str, group: str = "default") -> dict[str, Any]:
    return {"model_name": model, "routing_group": group, "worker_id": 1, "block_size": 4,
            "dp_start": 0, "dp_size": 1}  # fmt: skip


def add(model: str, rid: str, **extra: Any) -> dict[str, Any]:
    return {"model_name": model, "request_id": rid, "worker_id": 1, "dp_rank": 0,
            "sequence_hashes": [1], **extra}  # fmt: skip


async def test_names_and_ids_at_the_limit_are_served_and_one_over_is_422(client) -> None:
    assert (await post_json(client, "/register", reg(NAME, NAME))).status_code == 201
    r = await post_json(client, "/register", reg(NAME + "x"))
    assert r.status_code == 422
    assert r.json() == {"error": "Failed to deserialize the JSON body into the target type: "
                        "model_name: String should have at most 1024 characters"}  # fmt: skip
    assert (await post_json(client, "/register", reg("m", NAME + "x"))).status_code == 422
    assert (await post_json(client, "/register", reg("m"))).status_code == 201

    assert (await post_json(client, "/add", add("m", ID, lora_name=NAME))).status_code == 201
    for body in (add("m", ID + "x"), add("m", "r", lora_name=NAME + "x"),
                 add("m", "r", routing_group=NAME + "x"),
                 add("m", "r", routing_group=NAME + "x", expected_prefill_ms=1.5)):  # fmt: skip
        r = await post_json(client, "/add", body)
        assert r.status_code == 422, body
    for path in ("/free", "/prefill_complete", "/output_block"):
        r = await post_json(client, path, {"model_name": "m", "request_id": ID + "x"})
        assert r.status_code == 422, path
    r = await post_json(client, "/potential_loads",
                        {"model_name": "m", "sequence_hashes": [1], "lora_name": NAME + "x"})  # fmt: skip
    assert r.status_code == 422
    r = await post_json(client, "/batch", {"operations": [
        {"op": "free", "model_name": "m", "request_id": ID + "x"},
        {"op": "add", **add("m", ID + "y")}]})  # fmt: skip
    assert r.json() == {"results": [{"status": 422, "error": (
        "Failed to deserialize the JSON body into the target type: request_id: String should "
        "have at most 1024 characters")}] * 2}  # fmt: skip
    loads = (await client.get("/loads", params={"model_name": "m"})).json()
    assert [row["active_requests"] for row in loads] == [1]  # only the add at the limit


async def test_what_a_selection_worker_declares_is_bounded(client) -> None:
    base = {"worker_id": 1, "endpoint": "http://w", "block_size": 4}
    long = "e" * (MAX_TEXT_LENGTH + 1)
    for extra in ({"endpoint": long}, {"kv_events_endpoint": long}, {"taints": [long]},
                  {"topology_domains": {"zone": long}}, {"kv_events_endpoints": {"0": long}},
                  {"model_name": NAME + "x"}, {"stable_routing_id": long}):  # fmt: skip
        r = await post_json(client, "/selection/workers", {**base, **extra})
        assert r.status_code == 422, extra
    assert (await client.get("/selection/workers")).json() == []
    r = await post_json(client, "/selection/workers", {**base, "endpoint": "e" * MAX_TEXT_LENGTH})
    assert r.status_code == 201
    prompt = {"sequence_hashes": [1], "block_hashes": [1], "isl_tokens": 4}
    r = await post_json(client, "/selection/select", {**prompt, "selection_id": ID + "x"})
    assert r.status_code == 422
    r = await post_json(client, "/selection/select", {**prompt, "selection_id": ID})
    assert r.status_code == 200
