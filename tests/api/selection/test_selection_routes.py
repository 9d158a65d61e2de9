"""Every route of the selection API (SELECTION.md §1-§7) through the ASGI app, exact bodies."""

from __future__ import annotations

from typing import Any

import pytest

from kv_slot_tracker.core.hashing import compute_block_hash_for_seq, compute_seq_hash_for_block
from tests.api.selection.helpers import (
    BS,
    P8,
    SEL,
    A,
    B,
    add_worker,
    book,
    holds_p8,
    pick,
    post,
    prompt,
)


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"selection_seed": 3}


def record(worker_id: int, **fields: Any) -> dict[str, Any]:
    """A catalog record as the reference writes it (omitted request fields echo null)."""
    out: dict[str, Any] = {
        "worker_id": worker_id,
        "model_name": "default",
        "routing_group": "default",
        "lifecycle": "schedulable",
        "endpoint": f"http://w{worker_id}",
        "kv_events_endpoint": None,
        "replay_endpoint": None,
        "block_size": BS,
        "data_parallel_start_rank": None,
        "data_parallel_size": None,
        "max_num_batched_tokens": None,
        "total_kv_blocks": None,
        "stable_routing_id": None,
        "is_eagle": None,
        "taints": [],
        "topology_domains": {},
        "kv_transfer_domain": None,
        "kv_transfer_enforcement": None,
        "kv_transfer_preferred_weight": None,
    }
    out.update(fields)
    return out


def load(worker_id: int, dp_rank: int = 0, p: int = 0, d: int = 0, a: int = 0) -> dict:
    return {
        "worker_id": worker_id,
        "dp_rank": dp_rank,
        "potential_prefill_tokens": p,
        "potential_decode_blocks": d,
        "active_requests": a,
    }


async def partition_loads(client, model: str = "default") -> list[dict]:
    r = await client.get(f"{SEL}/loads", params={"model_name": model})
    assert r.status_code == 200
    return r.json()[0]["loads"] if r.json() else []


# -- probes ------------------------------------------------------------------------------------


async def test_health(client) -> None:
    r = await client.get(f"{SEL}/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    r = await client.head(f"{SEL}/health")
    assert (r.status_code, r.content) == (200, b"")


async def test_ready_is_503_until_a_worker_is_schedulable(client) -> None:
    r = await client.get(f"{SEL}/ready")
    assert (r.status_code, r.json()) == (
        503,
        {"ready": False, "schedulable_workers": 0, "workers": []},
    )
    r = await post(client, "/workers", {"worker_id": 9})  # incomplete: no endpoint, block size
    assert r.status_code == 201
    assert (await client.get(f"{SEL}/ready")).status_code == 503
    await add_worker(client, A)
    r = await client.get(f"{SEL}/ready")
    assert r.status_code == 200
    body = r.json()
    assert (body["ready"], body["schedulable_workers"]) == (True, 1)
    assert [w["worker_id"] for w in body["workers"]] == [A, 9]


# -- workers -----------------------------------------------------------------------------------


async def test_register_echoes_every_field(client) -> None:
    body = {
        "worker_id": 4,
        "model_name": "mm",
        "routing_group": "gg",
        "endpoint": "e",
        "kv_events_endpoint": "tcp://y",
        "kv_events_endpoints": {"1": "tcp://b", "0": "tcp://a"},
        "replay_endpoint": "r",
        "block_size": 4,
        "data_parallel_start_rank": 2,
        "data_parallel_size": 2,
        "max_num_batched_tokens": 7,
        "total_kv_blocks": 10,
        "stable_routing_id": "s",
        "is_eagle": True,
        "taints": ["t"],
        "topology_domains": {"rack": "r1"},
        "kv_transfer_domain": "d",
        "kv_transfer_enforcement": "preferred",
        "kv_transfer_preferred_weight": 0.1,
        "unknown_field": 1,
    }
    r = await post(client, "/workers", body)
    assert r.status_code == 201
    got = r.json()
    assert list(got) == [
        "worker_id", "model_name", "routing_group", "lifecycle", "endpoint", "kv_events_endpoint",
        "kv_events_endpoints", "replay_endpoint", "block_size", "data_parallel_start_rank",
        "data_parallel_size", "max_num_batched_tokens", "total_kv_blocks", "stable_routing_id",
        "is_eagle", "taints", "topology_domains", "kv_transfer_domain", "kv_transfer_enforcement",
        "kv_transfer_preferred_weight",
    ]  # fmt: skip
    expected = {k: v for k, v in body.items() if k != "unknown_field"}
    expected["kv_events_endpoints"] = {"0": "tcp://a", "1": "tcp://b"}
    assert got == {**expected, "lifecycle": "schedulable"}
    # ranks 2 and 3 are placed
    r = await client.get(f"{SEL}/loads", params={"model_name": "mm", "routing_group": "gg"})
    assert [(x["worker_id"], x["dp_rank"]) for x in r.json()[0]["loads"]] == [(4, 2), (4, 3)]


async def test_incomplete_workers_are_stored_with_reasons(client) -> None:
    r = await post(client, "/workers", {"worker_id": 2})
    assert r.status_code == 201
    assert r.json() == record(
        2,
        lifecycle="incomplete",
        endpoint=None,
        block_size=None,
        not_schedulable_reasons=["endpoint is required", "block_size must be greater than 0"],
    )
    r = await post(
        client,
        "/workers",
        {"worker_id": 5, "endpoint": "", "block_size": 0, "data_parallel_size": 0},
    )
    assert r.json()["not_schedulable_reasons"] == [
        "endpoint is required",
        "block_size must be greater than 0",
        "data_parallel_size must be greater than 0",
    ]
    await add_worker(client, A)
    r = await post(client, "/workers", {"worker_id": 6, "endpoint": "e", "block_size": 8})
    assert r.json()["lifecycle"] == "incomplete"
    assert r.json()["not_schedulable_reasons"] == [
        "reconciliation failed: block_size mismatch for model=default routing_group=default: "
        "existing=4 requested=8"
    ]


async def test_list_workers_sorted_and_filtered(client) -> None:
    await add_worker(client, 3, model_name="b")
    await add_worker(client, 2, model_name="a", routing_group="g1")
    await add_worker(client, 1, model_name="a")
    r = await client.get(f"{SEL}/workers")
    assert [(w["model_name"], w["routing_group"], w["worker_id"]) for w in r.json()] == [
        ("a", "default", 1),
        ("a", "g1", 2),
        ("b", "default", 3),
    ]
    r = await client.get(f"{SEL}/workers", params={"model_name": "a", "routing_group": "g1"})
    assert [w["worker_id"] for w in r.json()] == [2]
    r = await client.get(f"{SEL}/workers", params={"model_name": "zz"})
    assert r.json() == []
    r = await client.get(f"{SEL}/workers?model_name=a&model_name=b")
    assert (r.status_code, r.json()) == (
        400,
        {"error": "Failed to deserialize query string: duplicate field `model_name`"},
    )


async def test_patch_changes_only_given_fields(client) -> None:
    await add_worker(client, A, data_parallel_size=2)
    r = await client.patch(
        f"{SEL}/workers/{A}",
        json={"data_parallel_size": 3, "model_name": "ignored", "endpoint": None},
    )
    assert r.status_code == 200
    assert r.json() == record(A, data_parallel_size=3)
    assert [x["dp_rank"] for x in await partition_loads(client)] == [0, 1, 2]
    r = await client.patch(f"{SEL}/workers/{A}", json={"endpoint": ""})
    assert r.json()["lifecycle"] == "incomplete"
    assert r.json()["not_schedulable_reasons"] == ["endpoint is required"]
    assert await partition_loads(client) == []  # the partition stays listed, without ranks
    r = await client.patch(f"{SEL}/workers/+0{A}", json={"endpoint": "e2"})  # Rust u64 parse
    assert (r.status_code, r.json()["lifecycle"]) == (200, "schedulable")


async def test_delete_worker_returns_it_unschedulable(client) -> None:
    await add_worker(client, A)
    r = await client.delete(f"{SEL}/workers/{A}")
    assert (r.status_code, r.json()) == (200, record(A, lifecycle="unschedulable"))
    assert (await client.get(f"{SEL}/workers")).json() == []
    r = await client.delete(f"{SEL}/workers/{A}")
    assert (r.status_code, r.json()) == (404, {"error": f"worker {A} not found"})


async def test_upsert_moves_a_worker(client) -> None:
    await add_worker(client, A)
    await add_worker(client, A, model_name="other")
    r = await post(client, "/select", {**prompt([1]), "model_name": "default"})
    assert (r.status_code, r.json()) == (
        503,
        {"error": "no schedulable workers for model=default routing_group=default"},
    )
    assert await pick(client, {**prompt([1]), "model_name": "other"}) == A


# -- selection ---------------------------------------------------------------------------------


async def test_select_response(client) -> None:
    await add_worker(client, A, data_parallel_size=2)
    await book(client, "r1", A, [1, 2, 3, 4], isl=16, dp_rank=1)
    body = {**prompt([1, 2, 3, 4, 5, 6]), "pinned_worker": {"worker_id": A, "dp_rank": 0}}
    r = await post(client, "/select", body)
    assert r.status_code == 200
    assert r.json() == {
        "model_name": "default",
        "routing_group": "default",
        "worker_id": A,
        "dp_rank": 0,
        "endpoint": f"http://w{A}",
        "block_size": 4,
        # gpu etc. are the maximum over the chosen worker's ranks, not the pinned rank's
        "overlap": {
            "longest_matched": 16,
            "gpu": 16,
            "dp": {"0": 0, "1": 16},
            "cpu": 16,
            "disk": 16,
        },
        "effective_prefill_tokens": 24,
        "potential_decode_blocks": 6,
    }
    body = {**prompt([1, 2, 3], 14), "selection_id": "s1", "advisory": True}
    r = await post(client, "/select", body)
    assert r.json()["selection_id"] == "s1"
    assert r.json()["worker_id"] == A and r.json()["dp_rank"] == 1  # cheaper: cached and active
    assert r.json()["worker_load"] == {
        "active_prefill_tokens": 0,
        "prefill_token_capacity": 10_000_000,
    }
    assert r.json()["potential_decode_blocks"] == 4 + 1  # D 4, new 0, one uncovered tail block


async def test_select_and_reserve_books_and_answers_200(client) -> None:
    await add_worker(client, A)
    tokens = list(range(10))
    r = await post(client, "/select_and_reserve", {"token_ids": tokens, "advisory": True})
    assert r.status_code == 200
    body = r.json()
    blocks = compute_block_hash_for_seq(tokens, 4)
    seq = compute_seq_hash_for_block(blocks)
    assert blocks == [9143094415614847814, 12124091508212882195]  # SELECTION.md §3
    assert body["sequence_hashes"] == [9143094415614847814, -8936425687869117083]
    assert seq[1] == 9510318385840434533
    assert (body["isl_tokens"], body["track_prefill_tokens"]) == (10, True)
    assert "worker_load" not in body  # advisory is accepted, not answered, when reserving
    assert len(body["selection_id"]) == 36 and body["selection_id"][14] == "4"  # a UUID v4
    assert body["potential_decode_blocks"] == 3
    # the partial tail block is not booked: D = 2; P = the 10 effective prefill tokens
    assert await partition_loads(client) == [load(A, p=10, d=2, a=1)]
    dump = (await client.get(f"{SEL}/dump")).json()["default:default"]
    assert dump["block_size"] == 4
    assert dump["events"] == [
        {
            "worker_id": A,
            "storage_tier": "device",
            "residency_domain": "worker",
            "event": {
                "event_id": 0,
                "data": {
                    "stored": {
                        "parent_hash": None,
                        "start_position": None,
                        "blocks": [
                            {
                                "block_hash": 9143094415614847814,
                                "tokens_hash": 9143094415614847814,
                                "mm_extra_info": None,
                            },
                            {
                                "block_hash": 9510318385840434533,
                                "tokens_hash": 12124091508212882195,
                                "mm_extra_info": None,
                            },
                        ],
                    }
                },
                "dp_rank": 0,
            },
        }
    ]


async def test_dump_lists_branches_as_separate_events(client) -> None:
    await add_worker(client, A)
    await book(client, "x1", A, [1, 2], isl=8)
    await book(client, "x2", A, [1, 2, 3], isl=12)
    await book(client, "x3", A, [1, 5], isl=8)
    events = (await client.get(f"{SEL}/dump")).json()["default:default"]["events"]
    runs = [
        (
            e["event"]["data"]["stored"]["parent_hash"],
            [b["tokens_hash"] for b in e["event"]["data"]["stored"]["blocks"]],
        )
        for e in events
    ]
    assert runs == [(None, [1]), (1, [2, 3]), (1, [5])]
    assert [e["event"]["event_id"] for e in events] == [0, 1, 2]


async def test_lora_changes_token_hashes(client) -> None:
    await add_worker(client, A)
    tokens = list(range(8))
    plain = await post(client, "/select_and_reserve", {"token_ids": tokens})
    lora = await post(client, "/select_and_reserve", {"token_ids": tokens, "lora_name": "ad1"})
    assert plain.json()["sequence_hashes"] != lora.json()["sequence_hashes"]
    assert await partition_loads(client) == [load(A, p=16, d=4, a=2)]


async def test_potential_loads_and_overlap_scores(client) -> None:
    await add_worker(client, A)
    await add_worker(client, B)
    await holds_p8(client)
    body = prompt(P8[:5] + [77, 78, 79])
    r = await post(client, "/potential_loads", body)
    assert r.json() == [load(A, p=12, d=11, a=1), load(B, p=32, d=8)]
    r = await post(client, "/overlap_scores", body)
    assert r.json() == {
        "block_size": 4,
        "num_blocks": 8,
        "workers": [
            {
                "worker_id": w,
                "dp_rank": 0,
                "device_blocks": k,
                "host_pinned_blocks": k,
                "disk_blocks": k,
                "host_pinned_extension_blocks": 0,
                "disk_extension_blocks": 0,
                "shared_beyond_device_blocks": None,
            }
            for w, k in ((A, 5), (B, 0))
        ],
        "shared_cache": {"enabled": False, "total_hit_blocks": 0, "ranges": [], "error": None},
    }


async def test_loads_keep_a_partition_after_its_workers(client) -> None:
    await add_worker(client, A)
    await client.delete(f"{SEL}/workers/{A}")
    r = await client.get(f"{SEL}/loads")
    assert r.json() == [
        {
            "model_name": "default",
            "routing_group": "default",
            "loads": [],
            "pending_count": 0,
            "pending_isl_tokens": 0,
        }
    ]
    # and its block size stays fixed
    r = await post(client, "/workers", {"worker_id": 2, "endpoint": "e", "block_size": 8})
    assert r.json()["lifecycle"] == "incomplete"


# -- routing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/selection/nonexistent", 404),
        ("GET", "/selection/workers/", 404),
        ("POST", "/selection/%73elect", 404),
        ("DELETE", "/selection/reservations/", 404),
        ("GET", "/selection/select", 405),
        ("PUT", "/selection/workers", 405),
        ("GET", "/selection/reservations", 405),
        ("GET", "/selection/reservations/x", 405),
        ("POST", "/selection/dump", 405),
        ("DELETE", "/selection/select_and_reserve", 405),
    ],
)
async def test_unknown_routes_and_methods(client, method: str, path: str, status: int) -> None:
    r = await client.request(method, path)
    message = "route not found" if status == 404 else "method not allowed"
    assert (r.status_code, r.json()) == (status, {"error": message})
