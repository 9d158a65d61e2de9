"""A JSON array where a selection route takes a struct: the reference's serde reads it as well,
element ``i`` as the struct's field ``i`` (``kv_slot_tracker.core.serde.sequences``), and
answers its texts word for word, position included; a struct with a flattened part (the prompt routes,
reservations) refuses any array at its first byte, naming the route's own struct.

Every row was sent to the reference selection service (Dynamo 1.6.1, ``python -m
dynamo.select_service``, its routes without the ``/selection`` prefix) and its status and
answer copied here as it answered."""

from __future__ import annotations

from typing import Any

import httpx
import pytest


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    """KV events on, as the reference runs by default (a worker then needs its endpoints)."""
    return {"router_use_kv_events": True}


# (method, path, body, the reference's status, the reference's answer)
TABLE = [
    (
        "POST",
        "/selection/workers",
        "[]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid length 0, expected struct WorkerRequest with 22 elements at line 1 column 2"
        },
    ),
    (
        "POST",
        "/selection/workers",
        "[1]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid length 3, expected struct WorkerRequest with 22 elements at line 1 column 3"
        },
    ),
    (
        "POST",
        "/selection/workers",
        "[1,2]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [1]: invalid type: integer `2`, expected a string at line 1 column 4"
        },
    ),
    (
        "POST",
        "/selection/workers",
        '["a"]',
        422,
        {
            "error": 'Failed to deserialize the JSON body into the target type: [0]: invalid type: string "a", expected u64 at line 1 column 4'
        },
    ),
    (
        "POST",
        "/selection/workers",
        "[[1]]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [0]: invalid type: sequence, expected u64 at line 1 column 1"
        },
    ),
    (
        "POST",
        "/selection/workers",
        "[{}]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [0]: invalid type: map, expected u64 at line 1 column 1"
        },
    ),
    (
        "POST",
        "/selection/workers",
        " [ 1 , 2 ] ",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [1]: invalid type: integer `2`, expected a string at line 1 column 8"
        },
    ),
    (
        "POST",
        "/selection/workers",
        "[1,",
        400,
        {
            "error": "Failed to parse the request body as JSON: EOF while parsing a value at line 1 column 3"
        },
    ),
    (
        "POST",
        "/selection/workers",
        "[]x",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid length 0, expected struct WorkerRequest with 22 elements at line 1 column 2"
        },
    ),
    (
        "POST",
        "/selection/workers",
        "[1,]",
        400,
        {"error": "Failed to parse the request body as JSON: trailing comma at line 1 column 4"},
    ),
    (
        "POST",
        "/selection/workers",
        "[1 2]",
        400,
        {
            "error": "Failed to parse the request body as JSON: expected `,` or `]` at line 1 column 4"
        },
    ),
    (
        "POST",
        "/selection/workers",
        "\n[\n1, [2]]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [1]: invalid type: sequence, expected a string at line 3 column 3"
        },
    ),
    (
        "POST",
        "/selection/workers",
        "[true, true, true, true, true, true, true, true, true, true, true, true, true, true, true, true, true, true, true, true, true, true]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [0]: invalid type: boolean `true`, expected u64 at line 1 column 5"
        },
    ),
    (
        "POST",
        "/selection/workers",
        "[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [1]: invalid type: integer `1`, expected a string at line 1 column 5"
        },
    ),
    (
        "POST",
        "/selection/workers",
        '[1, "m", "g", "e", null, {"a": 1}]',
        400,
        {
            "error": "Failed to parse the request body as JSON: [5].?: invalid value: expected key to be a number in quotes at line 1 column 27"
        },
    ),
    (
        "POST",
        "/selection/workers",
        '[1, "m", "g", "e", null, {"1": 1}]',
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [5].1: invalid type: integer `1`, expected a string at line 1 column 32"
        },
    ),
    (
        "POST",
        "/selection/workers",
        '[1, "m", "g", "e", null, {}, null, -1]',
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [7]: invalid value: integer `-1`, expected u32 at line 1 column 37"
        },
    ),
    (
        "POST",
        "/selection/workers",
        '[1, "m", "g", "e", null, {}, null, 4294967296]',
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [7]: invalid value: integer `4294967296`, expected u32 at line 1 column 45"
        },
    ),
    (
        "POST",
        "/selection/workers",
        '[1, "m", "g", "e", null, {}, null, 1, 1, 1, 1, 1, "s", true, []]',
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid length 16, expected struct WorkerRequest with 22 elements at line 1 column 64"
        },
    ),
    (
        "POST",
        "/selection/workers",
        '[1, "m", "g", "e", null, {}, null, 1, 1, 1, 1, 1, "s", true, [], {"a": 3}]',
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [15].a: invalid type: integer `3`, expected a string at line 1 column 72"
        },
    ),
    (
        "POST",
        "/selection/workers",
        '[1, "m", "g", "e", null, {}, null, 1, 1, 1, 1, 1, "s", true, [], {}, "d", "zz"]',
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [17]: unknown variant `zz`, expected `required` or `preferred` at line 1 column 78"
        },
    ),
    (
        "POST",
        "/selection/workers",
        '[1, "m", "g", "e", null, {}, null, 1, 1, 1, 1, 1, "s", true, [], {}, "d", 5]',
        400,
        {
            "error": "Failed to parse the request body as JSON: [17]: expected value at line 1 column 75"
        },
    ),
    (
        "POST",
        "/selection/workers",
        '[1, "m", "g", "e", null, {}, null, 1, 1, 1, 1, 1, "s", true, [], {}, "d", {}]',
        400,
        {
            "error": "Failed to parse the request body as JSON: [17]: expected value at line 1 column 76"
        },
    ),
    (
        "POST",
        "/selection/workers",
        '[1, "m", "g", "e", null, {}, null, 1, 1, 1, 1, 1, "s", true,["a", 2]]',
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [14][1]: invalid type: integer `2`, expected a string at line 1 column 67"
        },
    ),
    (
        "POST",
        "/selection/workers",
        '[1, "m", "g", "e", null, {}, null, 1, 1, 1, 1, 1, "s", true, [], {}, "d", "required", 0.5, null, {}, null, 3]',
        400,
        {
            "error": "Failed to parse the request body as JSON: trailing characters at line 1 column 108"
        },
    ),
    (
        "POST",
        "/selection/workers",
        '[1, "m", "g", "e", null, {}, null, 1, 1, 1, 1, 1, "s", true, [], {}, "d", "required", 0.5, null, null]',
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [20]: invalid type: null, expected a map at line 1 column 101"
        },
    ),
    (
        "POST",
        "/selection/workers",
        '[1, "m", NaN]',
        400,
        {
            "error": "Failed to parse the request body as JSON: [2]: expected value at line 1 column 10"
        },
    ),
    (
        "PATCH",
        "/selection/workers/1",
        "[]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid length 0, expected struct WorkerPatchRequest with 19 elements at line 1 column 2"
        },
    ),
    (
        "PATCH",
        "/selection/workers/1",
        "[1]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [0]: invalid type: integer `1`, expected a string at line 1 column 2"
        },
    ),
    (
        "PATCH",
        "/selection/workers/1",
        '["a"]',
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid length 1, expected struct WorkerPatchRequest with 19 elements at line 1 column 5"
        },
    ),
    (
        "PATCH",
        "/selection/workers/1",
        "[null]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid length 1, expected struct WorkerPatchRequest with 19 elements at line 1 column 6"
        },
    ),
    (
        "PATCH",
        "/selection/workers/1",
        "[1,",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [0]: invalid type: integer `1`, expected a string at line 1 column 2"
        },
    ),
    (
        "PATCH",
        "/selection/workers/1",
        "[null, null, null, null, null, null, null, null, null, null, null, null, null, null, null, null, null, null, null, 1]",
        400,
        {
            "error": "Failed to parse the request body as JSON: trailing characters at line 1 column 116"
        },
    ),
    (
        "PATCH",
        "/selection/workers/1",
        "[null, null, null, null, null, null, null, null, null, null, null, null, null, null, null, null, null, null, null,]",
        400,
        {"error": "Failed to parse the request body as JSON: trailing comma at line 1 column 115"},
    ),
    (
        "PATCH",
        "/selection/workers/1",
        '[null, null, null, null, null, null, null, null, null, null, null, null, null, null, "zz"]',
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [14]: unknown variant `zz`, expected `required` or `preferred` at line 1 column 89"
        },
    ),
    (
        "PATCH",
        "/selection/workers/1",
        "[null, null, null, null, null, null, null, null, null, null, null, [1]]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [11][0]: invalid type: integer `1`, expected a string at line 1 column 69"
        },
    ),
    (
        "PATCH",
        "/selection/workers/1",
        '[null, null, null, null, null, null, null, null, null, null, null, null, {"a": 1}]',
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [12].a: invalid type: integer `1`, expected a string at line 1 column 80"
        },
    ),
    (
        "POST",
        "/selection/select",
        "[]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid type: sequence, expected struct SelectRequest at line 1 column 0"
        },
    ),
    (
        "POST",
        "/selection/select",
        " [ 1 , 2 ] ",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid type: sequence, expected struct SelectRequest at line 1 column 1"
        },
    ),
    (
        "POST",
        "/selection/select_and_reserve",
        "[]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid type: sequence, expected struct SelectAndReserveRequest at line 1 column 0"
        },
    ),
    (
        "POST",
        "/selection/select_and_reserve",
        "[1,",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid type: sequence, expected struct SelectAndReserveRequest at line 1 column 0"
        },
    ),
    (
        "POST",
        "/selection/potential_loads",
        "[1]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid type: sequence, expected struct PotentialLoadsRequest at line 1 column 0"
        },
    ),
    (
        "POST",
        "/selection/potential_loads",
        "\t[1,",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid type: sequence, expected struct PotentialLoadsRequest at line 1 column 1"
        },
    ),
    (
        "POST",
        "/selection/overlap_scores",
        "[]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid type: sequence, expected struct OverlapScoresRequest at line 1 column 0"
        },
    ),
    (
        "POST",
        "/selection/overlap_scores",
        "  []",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid type: sequence, expected struct OverlapScoresRequest at line 1 column 2"
        },
    ),
    (
        "POST",
        "/selection/reservations",
        "[]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid type: sequence, expected struct ReservationRequest at line 1 column 0"
        },
    ),
    (
        "POST",
        "/selection/reservations",
        "[1,",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid type: sequence, expected struct ReservationRequest at line 1 column 0"
        },
    ),
    (
        "POST",
        "/selection/reservations/abc/output_block",
        "[]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: invalid length 0, expected struct OutputBlockRequest with 1 element at line 1 column 2"
        },
    ),
    (
        "POST",
        "/selection/reservations/abc/output_block",
        "[1]",
        404,
        {"error": "reservation abc not found"},
    ),
    (
        "POST",
        "/selection/reservations/abc/output_block",
        "[null]",
        404,
        {"error": "reservation abc not found"},
    ),
    (
        "POST",
        "/selection/reservations/abc/output_block",
        "[1,2]",
        400,
        {
            "error": "Failed to parse the request body as JSON: trailing characters at line 1 column 4"
        },
    ),
    (
        "POST",
        "/selection/reservations/abc/output_block",
        '["a"]',
        422,
        {
            "error": 'Failed to deserialize the JSON body into the target type: [0]: invalid type: string "a", expected f64 at line 1 column 4'
        },
    ),
    (
        "POST",
        "/selection/reservations/abc/output_block",
        "[[1]]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [0]: invalid type: sequence, expected f64 at line 1 column 1"
        },
    ),
    (
        "POST",
        "/selection/reservations/abc/output_block",
        "[true]",
        422,
        {
            "error": "Failed to deserialize the JSON body into the target type: [0]: invalid type: boolean `true`, expected f64 at line 1 column 5"
        },
    ),
    (
        "POST",
        "/selection/reservations/abc/output_block",
        "[1,",
        400,
        {
            "error": "Failed to parse the request body as JSON: trailing characters at line 1 column 3"
        },
    ),
    (
        "POST",
        "/selection/reservations/abc/output_block",
        "[1 2]",
        400,
        {
            "error": "Failed to parse the request body as JSON: trailing characters at line 1 column 4"
        },
    ),
    (
        "POST",
        "/selection/reservations/abc/output_block",
        "[1,]",
        400,
        {"error": "Failed to parse the request body as JSON: trailing comma at line 1 column 4"},
    ),
]


@pytest.mark.parametrize("method,path,body,status,answer", TABLE)
async def test_array_bodies_answer_the_reference_text(
    client: httpx.AsyncClient, method: str, path: str, body: str, status: int, answer: dict
) -> None:
    r = await client.request(
        method, path, content=body.encode(), headers={"content-type": "application/json"}
    )
    assert (r.status_code, r.json()) == (status, answer)


WORKER = {
    "worker_id": 41, "model_name": "m", "routing_group": "g", "lifecycle": "incomplete",
    "endpoint": "http://w", "kv_events_endpoint": "tcp://127.0.0.1:5557",
    "kv_events_endpoints": {"1": "tcp://127.0.0.1:5558"}, "replay_endpoint": None,
    "block_size": 16, "data_parallel_start_rank": 0, "data_parallel_size": 2,
    "max_num_batched_tokens": 8192, "total_kv_blocks": 1000, "stable_routing_id": "s",
    "is_eagle": True, "taints": ["t"], "topology_domains": {"zone": "a"},
    "kv_transfer_domain": "d", "kv_transfer_enforcement": "preferred",
    "kv_transfer_preferred_weight": 0.5,
    "not_schedulable_reasons": ["kv_events endpoint is required for dp_rank 0"],
}  # fmt: skip


async def test_a_whole_array_is_a_worker_as_the_object_would_be(
    client: httpx.AsyncClient,
) -> None:
    """The reference registers a worker given as an array of its fields in order, and patches
    one given as an array that reaches every field without a default (the reference's
    answers, copied)."""
    body = (
        '[41, "m", "g", "http://w", "tcp://127.0.0.1:5557", {"1": "tcp://127.0.0.1:5558"}, null,'
        ' 16, 0, 2, 8192, 1000, "s", true, ["t"], {"zone": "a"}, "d", "preferred", 0.5]'
    )
    headers = {"content-type": "application/json"}
    r = await client.post("/selection/workers", content=body, headers=headers)
    assert (r.status_code, r.json()) == (201, WORKER)
    patch = "[" + ", ".join(["null"] * 4 + ["32"] + ["null"] * 11) + "]"
    r = await client.patch("/selection/workers/41", content=patch, headers=headers)
    assert (r.status_code, r.json()) == (200, {**WORKER, "block_size": 32})
    r = await client.patch("/selection/workers/41", content="[null, null, null, null, 32]",
                           headers=headers)  # fmt: skip
    assert (r.status_code, r.json()) == (422, {
        "error": "Failed to deserialize the JSON body into the target type: invalid length 5, "
        "expected struct WorkerPatchRequest with 19 elements at line 1 column 28"
    })  # fmt: skip
