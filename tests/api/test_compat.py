"""Conformance with the reference slot tracker's HTTP API (SPEC §7, scenarios H01–H19 of §9.6).

Status codes, JSON bodies and orderings are asserted exactly as the SPEC states them. Where the
reference's wording comes from its JSON parser (serde), only the fixed prefix is asserted.

Deliberate differences from the reference, asserted as such:

* ``/loads`` rows carry two extra fields after the reference's six (``active_requests``,
  ``modeled_remaining_prefill_ms``); the reference fields are compared exactly and in order.
* A duplicate query key is a 400 with a JSON ``{"error": ...}`` body, not ``text/plain``.
* ``/metrics`` exists (the reference answers 404); ``/replica_sync/*`` answers as the
  reference does with replica sync off (this service replicates through Redis, not a ZMQ
  mesh): ``tests/api/selection/test_selection_replica_sync.py``.
* A JSON array in place of the body object is rejected with 422 (reproducing that serde quirk
  is optional).

H20–H24 concern the reference's ZMQ replica mesh and are out of scope here.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api.conftest import PostJson
from tests.fakes import FakeClock

JSON_PARSE = "Failed to parse the request body as JSON: "
JSON_SHAPE = "Failed to deserialize the JSON body into the target type: "
CONTENT_TYPE = "Expected request with `Content-Type: application/json`"
TOO_LARGE = "Failed to buffer the request body: length limit exceeded"
BODY_LIMIT = 2_097_152

OK = {"status": "ok"}
LOAD_KEYS = [
    "model_name",
    "routing_group",
    "worker_id",
    "dp_rank",
    "active_prefill_tokens",
    "active_decode_blocks",
]
LOAD_EXTRA_KEYS = ["active_requests", "modeled_remaining_prefill_ms"]
WORKER_KEYS = ["worker_id", "model_name", "routing_group", "block_size", "dp_start", "dp_size"]
POTENTIAL_KEYS = [
    "worker_id",
    "dp_rank",
    "potential_prefill_tokens",
    "potential_decode_blocks",
    "active_requests",
]


# -- helpers -----------------------------------------------------------------------------------


def reg(
    worker_id: int,
    model: str,
    block_size: int,
    dp_start: int,
    dp_size: int,
    group: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "worker_id": worker_id,
        "model_name": model,
        "block_size": block_size,
        "dp_start": dp_start,
        "dp_size": dp_size,
    }
    if group is not None:
        body["routing_group"] = group
    return body


def add_body(
    model: str,
    request_id: str,
    worker_id: int,
    dp_rank: int,
    hashes: list[int],
    tokens: int | None = None,
    group: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model_name": model,
        "request_id": request_id,
        "worker_id": worker_id,
        "dp_rank": dp_rank,
        "sequence_hashes": hashes,
    }
    if tokens is not None:
        body["new_isl_tokens"] = tokens
    if group is not None:
        body["routing_group"] = group
    return body


def req_body(model: str, request_id: str, group: str | None = None) -> dict[str, Any]:
    body = {"model_name": model, "request_id": request_id}
    if group is not None:
        body["routing_group"] = group
    return body


def expect(resp: httpx.Response, status: int, body: Any) -> None:
    """Exact status and exact JSON body, served as ``application/json``."""
    assert (resp.status_code, resp.json()) == (status, body), resp.text
    assert resp.headers["content-type"] == "application/json"


def expect_error(resp: httpx.Response, status: int, message: str) -> None:
    expect(resp, status, {"error": message})


def expect_error_prefix(resp: httpx.Response, status: int, prefix: str) -> str:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert list(body) == ["error"]
    assert body["error"].startswith(prefix), body
    return body["error"]


def anchor_loads(resp: httpx.Response) -> list[dict[str, Any]]:
    """The reference's six ``/loads`` fields of every row, after checking their order."""
    assert resp.status_code == 200, resp.text
    rows = resp.json()
    for row in rows:
        assert list(row) == LOAD_KEYS + LOAD_EXTRA_KEYS
    return [{k: row[k] for k in LOAD_KEYS} for row in rows]


def load_row(
    model: str, worker_id: int, dp_rank: int, tokens: int, blocks: int, group: str = "default"
) -> dict[str, Any]:
    return {
        "model_name": model,
        "routing_group": group,
        "worker_id": worker_id,
        "dp_rank": dp_rank,
        "active_prefill_tokens": tokens,
        "active_decode_blocks": blocks,
    }


def worker_row(
    worker_id: int,
    model: str,
    block_size: int,
    dp_start: int,
    dp_size: int,
    group: str = "default",
) -> dict[str, Any]:
    return {
        "worker_id": worker_id,
        "model_name": model,
        "routing_group": group,
        "block_size": block_size,
        "dp_start": dp_start,
        "dp_size": dp_size,
    }


def potential_row(
    worker_id: int, dp_rank: int, tokens: int, blocks: int, requests: int
) -> dict[str, Any]:
    return {
        "worker_id": worker_id,
        "dp_rank": dp_rank,
        "potential_prefill_tokens": tokens,
        "potential_decode_blocks": blocks,
        "active_requests": requests,
    }


async def loads(client: httpx.AsyncClient, **params: str) -> list[dict[str, Any]]:
    return anchor_loads(await client.get("/loads", params=params))


async def workers(client: httpx.AsyncClient, **params: str) -> list[dict[str, Any]]:
    resp = await client.get("/workers", params=params)
    assert resp.status_code == 200, resp.text
    rows = resp.json()
    for row in rows:
        assert list(row) == WORKER_KEYS
    return rows


async def potential(post: PostJson, body: dict[str, Any]) -> list[dict[str, Any]]:
    """``/potential_loads`` rows sorted by rank (the reference's order is unspecified)."""
    resp = await post("/potential_loads", body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/json"
    rows = resp.json()
    for row in rows:
        assert list(row) == POTENTIAL_KEYS
    return sorted(rows, key=lambda r: (r["worker_id"], r["dp_rank"]))


async def decode_blocks(post: PostJson, model: str, hashes: list[int]) -> int:
    rows = await potential(post, {"model_name": model, "sequence_hashes": hashes})
    assert len(rows) == 1
    return rows[0]["potential_decode_blocks"]


# -- H01 .. H19 --------------------------------------------------------------------------------


async def test_h01_health(client: httpx.AsyncClient) -> None:
    resp = await client.get("/health")
    assert resp.status_code == 200
    assert resp.content == b""
    assert "content-type" not in resp.headers


async def test_h02_register_and_list(client: httpx.AsyncClient, post: PostJson) -> None:
    expect(await post("/register", reg(1, "m", 16, 2, 2)), 201, OK)

    resp = await client.get("/workers")
    expect(resp, 200, [worker_row(1, "m", 16, 2, 2)])
    assert resp.content == (
        b'[{"worker_id":1,"model_name":"m","routing_group":"default","block_size":16,'
        b'"dp_start":2,"dp_size":2}]'
    )
    assert await loads(client) == [load_row("m", 1, 2, 0, 0), load_row("m", 1, 3, 0, 0)]


async def test_h03_register_validation_order(client: httpx.AsyncClient, post: PostJson) -> None:
    expect_error(
        await post("/register", reg(1, "m", 0, 0, 0)), 400, "block_size must be greater than 0"
    )
    expect_error(
        await post("/register", reg(1, "m", 8, 0, 0)), 400, "dp_size must be greater than 0"
    )
    expect_error(
        await post("/register", reg(1, "m", 8, 4294967295, 1)),
        400,
        "dp range overflows u32: start=4294967295 size=1",
    )
    assert await workers(client) == []
    expect(await post("/register", reg(1, "m", 8, 4294967294, 1)), 201, OK)
    assert await workers(client) == [worker_row(1, "m", 8, 4294967294, 1)]


async def test_h04_conflicts(client: httpx.AsyncClient, post: PostJson) -> None:
    expect(await post("/register", reg(1, "m", 4, 0, 2)), 201, OK)
    expect_error(
        await post("/register", reg(1, "m", 4, 0, 2)),
        409,
        "worker 1 already registered for model=m routing_group=default",
    )
    mismatch = "block_size mismatch for model=m routing_group=default: existing=4, requested=8"
    expect_error(await post("/register", reg(2, "m", 8, 0, 2)), 409, mismatch)
    # the block size is checked before the duplicate worker id
    expect_error(await post("/register", reg(1, "m", 8, 0, 2)), 409, mismatch)
    assert await workers(client) == [worker_row(1, "m", 4, 0, 2)]


async def test_h05_unregister(client: httpx.AsyncClient, post: PostJson) -> None:
    expect(await post("/register", reg(1, "m", 4, 0, 1)), 201, OK)
    expect_error(
        await post("/unregister", {"worker_id": 99, "model_name": "m"}),
        404,
        "worker 99 not found for model=m routing_group=default",
    )
    expect_error(
        await post("/unregister", {"worker_id": 1, "model_name": "nomodel"}),
        404,
        "worker 1 not found for model=nomodel routing_group=default",
    )
    expect(await post("/unregister", {"worker_id": 1, "model_name": "m"}), 200, OK)
    assert await workers(client) == []
    expect_error(
        await post("/unregister", {"worker_id": 1, "model_name": "m"}),
        404,
        "worker 1 not found for model=m routing_group=default",
    )


async def test_h06_add_errors(client: httpx.AsyncClient, post: PostJson) -> None:
    expect_error(
        await post("/add", add_body("m2", "r1", 1, 0, [1])),
        404,
        "no slot tracker for model=m2 routing_group=default",
    )
    expect(await post("/register", reg(1, "m2", 4, 0, 2)), 201, OK)
    expect(await post("/add", add_body("m2", "r1", 1, 0, [1])), 201, OK)
    exists = (
        "Request r1 already exists "
        "(assigned to worker WorkerWithDpRank { worker_id: 1, dp_rank: 0 })"
    )
    expect_error(await post("/add", add_body("m2", "r1", 1, 0, [1])), 409, exists)
    expect_error(await post("/add", add_body("m2", "r1", 1, 1, [2, 3], 5)), 409, exists)
    expect_error(
        await post("/add", add_body("m2", "r2", 1, 2, [1])),
        404,
        "Worker WorkerWithDpRank { worker_id: 1, dp_rank: 2 } not found",
    )
    expect_error(
        await post("/add", add_body("m2", "r2", 9, 0, [1])),
        404,
        "Worker WorkerWithDpRank { worker_id: 9, dp_rank: 0 } not found",
    )
    # the failed adds changed nothing: only r1's block on (1,0)
    assert await loads(client) == [load_row("m2", 1, 0, 0, 1), load_row("m2", 1, 1, 0, 0)]


async def test_h07_lifecycle_and_strict_admission(
    client: httpx.AsyncClient, post: PostJson
) -> None:
    expect(await post("/register", reg(1, "h", 16, 0, 1)), 201, OK)
    expect(await post("/free", req_body("h", "early-free")), 200, OK)
    expect_error(
        await post("/prefill_complete", req_body("h", "early-complete")),
        404,
        "Request early-complete not found",
    )
    expect_error(
        await post("/add", add_body("h", "bad-rank", 1, 1, [1], 8)),
        404,
        "Worker WorkerWithDpRank { worker_id: 1, dp_rank: 1 } not found",
    )
    expect(await post("/add", add_body("h", "early-free", 1, 0, [1, 2], 8)), 201, OK)
    assert await loads(client) == [load_row("h", 1, 0, 8, 2)]
    expect_error(
        await post("/add", add_body("h", "early-free", 1, 0, [1, 2], 8)),
        409,
        "Request early-free already exists "
        "(assigned to worker WorkerWithDpRank { worker_id: 1, dp_rank: 0 })",
    )
    expect(await post("/prefill_complete", req_body("h", "early-free")), 200, OK)
    expect(await post("/prefill_complete", req_body("h", "early-free")), 200, OK)
    assert await loads(client) == [load_row("h", 1, 0, 0, 2)]
    expect(await post("/free", req_body("h", "early-free")), 200, OK)
    expect(await post("/free", req_body("h", "early-free")), 200, OK)
    assert await loads(client) == [load_row("h", 1, 0, 0, 0)]
    expect(await post("/add", add_body("h", "early-complete", 1, 0, [3], 8)), 201, OK)
    assert await loads(client) == [load_row("h", 1, 0, 8, 1)]
    expect(await post("/free", req_body("h", "early-complete")), 200, OK)
    assert await loads(client) == [load_row("h", 1, 0, 0, 0)]
    # a freed request is unknown to prefill_complete
    expect_error(
        await post("/prefill_complete", req_body("h", "early-free")),
        404,
        "Request early-free not found",
    )


async def test_h08_potential_loads(post: PostJson) -> None:
    expect(await post("/register", reg(1, "h", 16, 0, 1)), 201, OK)
    expect(await post("/add", add_body("h", "req-1", 1, 0, [1, 2, 3], 8)), 201, OK)
    resp = await post(
        "/potential_loads", {"model_name": "h", "sequence_hashes": [1, 2, 4], "new_isl_tokens": 5}
    )
    expect(resp, 200, [potential_row(1, 0, 13, 4, 1)])
    assert resp.content == (
        b'[{"worker_id":1,"dp_rank":0,"potential_prefill_tokens":13,'
        b'"potential_decode_blocks":4,"active_requests":1}]'
    )


async def test_h09_worked_example(client: httpx.AsyncClient, post: PostJson) -> None:
    expect(await post("/register", reg(1, "m2", 4, 0, 2)), 201, OK)
    expect(await post("/add", add_body("m2", "r1", 1, 0, [1, 2, 3], 12)), 201, OK)
    assert await loads(client, model_name="m2") == [
        load_row("m2", 1, 0, 12, 3),
        load_row("m2", 1, 1, 0, 0),
    ]
    expect(await post("/add", add_body("m2", "r2", 1, 0, [1, 2, 4, 5], 16)), 201, OK)
    assert await loads(client, model_name="m2") == [
        load_row("m2", 1, 0, 28, 5),
        load_row("m2", 1, 1, 0, 0),
    ]
    rows = await potential(
        post, {"model_name": "m2", "sequence_hashes": [1, 2, 3, 5], "new_isl_tokens": 7}
    )
    assert rows == [potential_row(1, 0, 35, 6, 2), potential_row(1, 1, 7, 4, 0)]

    expect(await post("/prefill_complete", req_body("m2", "r1")), 200, OK)
    assert (await loads(client, model_name="m2"))[0] == load_row("m2", 1, 0, 16, 5)
    expect(await post("/free", req_body("m2", "r1")), 200, OK)
    assert (await loads(client, model_name="m2"))[0] == load_row("m2", 1, 0, 16, 4)
    expect(await post("/free", req_body("m2", "r2")), 200, OK)
    assert await loads(client, model_name="m2") == [
        load_row("m2", 1, 0, 0, 0),
        load_row("m2", 1, 1, 0, 0),
    ]


async def test_http_prefill_tokens_never_decay_with_time(
    client: httpx.AsyncClient, post: PostJson, clock: FakeClock
) -> None:
    """§7.4: an HTTP add carries no prefill duration, so only lifecycle calls remove tokens."""
    expect(await post("/register", reg(1, "m", 4, 0, 1)), 201, OK)
    expect(await post("/add", add_body("m", "r1", 1, 0, [1, 2], 100)), 201, OK)
    clock.advance(250)
    assert await loads(client) == [load_row("m", 1, 0, 100, 2)]
    rows = await potential(post, {"model_name": "m", "sequence_hashes": [], "new_isl_tokens": 1})
    assert rows == [potential_row(1, 0, 101, 2, 1)]


async def test_h10_prefix_semantics_with_non_lineage_data(
    client: httpx.AsyncClient, post: PostJson
) -> None:
    expect(await post("/register", reg(1, "t", 4, 0, 1)), 201, OK)
    expect(await post("/add", add_body("t", "a", 1, 0, [1, 2, 3])), 201, OK)
    expect(await post("/add", add_body("t", "b", 1, 0, [1, 4, 5])), 201, OK)
    assert await loads(client) == [load_row("t", 1, 0, 0, 5)]
    assert await decode_blocks(post, "t", [1, 4, 3]) == 6
    assert await decode_blocks(post, "t", [4, 5]) == 7
    assert await decode_blocks(post, "t", [2]) == 6
    assert await decode_blocks(post, "t", [1, 2, 3, 4, 5]) == 7


async def test_h11_signed_hashes(client: httpx.AsyncClient, post: PostJson) -> None:
    expect(await post("/register", reg(1, "m", 4, 0, 1)), 201, OK)
    expect(await post("/add", add_body("m", "s", 1, 0, [-1, 9223372036854775807])), 201, OK)
    assert await loads(client) == [load_row("m", 1, 0, 0, 2)]
    # -1 is the u64 18446744073709551615: it is the first block, and matches itself
    assert await decode_blocks(post, "m", [-1, 9223372036854775807]) == 2
    assert await decode_blocks(post, "m", [-1]) == 2
    assert await decode_blocks(post, "m", [9223372036854775807]) == 3
    assert await decode_blocks(post, "m", [1]) == 3

    def bad(**fields: Any) -> dict[str, Any]:
        body = add_body("m", "x", 1, 0, [1])
        body.update(fields)
        return {k: v for k, v in body.items() if v is not _MISSING}

    msg = expect_error_prefix(
        await post("/add", bad(sequence_hashes=[18446744073709551615])), 422, JSON_SHAPE
    )
    assert "expected i64" in msg
    msg = expect_error_prefix(
        await post("/add", bad(sequence_hashes=[9223372036854775808])), 422, JSON_SHAPE
    )
    assert "expected i64" in msg
    expect_error_prefix(await post("/add", bad(sequence_hashes=[1.5])), 422, JSON_SHAPE)
    expect_error_prefix(await post("/add", bad(sequence_hashes=["1"])), 422, JSON_SHAPE)
    msg = expect_error_prefix(await post("/add", bad(sequence_hashes=None)), 422, JSON_SHAPE)
    assert "expected an array of signed 64-bit sequence hashes" in msg
    expect_error(
        await post("/add", bad(sequence_hashes=_MISSING)),
        422,
        JSON_SHAPE + "missing field `sequence_hashes`",
    )
    expect_error_prefix(await post("/add", bad(new_isl_tokens=-1)), 422, JSON_SHAPE)
    expect_error(
        await post("/add", bad(dp_rank=_MISSING)), 422, JSON_SHAPE + "missing field `dp_rank`"
    )
    # none of the rejected adds took effect
    assert await loads(client) == [load_row("m", 1, 0, 0, 2)]


_MISSING: Any = object()


async def test_h12_h13_unregister_busy_worker_and_tracker_drop(
    client: httpx.AsyncClient, post: PostJson
) -> None:
    # H12
    expect(await post("/register", reg(1, "m3", 4, 0, 1)), 201, OK)
    expect(await post("/register", reg(2, "m3", 4, 0, 1)), 201, OK)
    expect(await post("/add", add_body("m3", "a", 1, 0, [1, 2], 8)), 201, OK)
    expect(await post("/add", add_body("m3", "b", 2, 0, [1, 2, 3], 12)), 201, OK)
    expect(await post("/unregister", {"worker_id": 1, "model_name": "m3"}), 200, OK)
    assert await loads(client, model_name="m3") == [load_row("m3", 2, 0, 12, 3)]
    expect_error(await post("/prefill_complete", req_body("m3", "a")), 404, "Request a not found")
    expect(await post("/free", req_body("m3", "a")), 200, OK)
    expect(await post("/add", add_body("m3", "a", 2, 0, [1, 2], 8)), 201, OK)
    assert await loads(client, model_name="m3") == [load_row("m3", 2, 0, 20, 3)]
    expect(await post("/register", reg(1, "m3", 4, 0, 1)), 201, OK)
    assert await loads(client, model_name="m3") == [
        load_row("m3", 1, 0, 0, 0),
        load_row("m3", 2, 0, 20, 3),
    ]

    # H13
    expect(await post("/unregister", {"worker_id": 1, "model_name": "m3"}), 200, OK)
    expect(await post("/unregister", {"worker_id": 2, "model_name": "m3"}), 200, OK)
    assert await workers(client, model_name="m3") == []
    assert await loads(client, model_name="m3") == []
    expect_error(
        await post("/free", req_body("m3", "a")),
        404,
        "no slot tracker for model=m3 routing_group=default",
    )
    expect_error(
        await post("/unregister", {"worker_id": 2, "model_name": "m3"}),
        404,
        "worker 2 not found for model=m3 routing_group=default",
    )
    expect(await post("/register", reg(2, "m3", 16, 0, 1)), 201, OK)
    assert await workers(client) == [worker_row(2, "m3", 16, 0, 1)]
    # the re-created tracker starts empty: request "a" is gone for good
    assert await loads(client) == [load_row("m3", 2, 0, 0, 0)]
    expect_error(await post("/prefill_complete", req_body("m3", "a")), 404, "Request a not found")


async def test_h14_routing_groups(client: httpx.AsyncClient, post: PostJson) -> None:
    expect(await post("/register", reg(1, "h", 16, 0, 1)), 201, OK)
    expect(await post("/register", reg(1, "h", 16, 0, 1, group="a")), 201, OK)
    expect(await post("/register", reg(1, "h", 32, 0, 1, group="b")), 201, OK)
    assert await workers(client) == [
        worker_row(1, "h", 16, 0, 1, "a"),
        worker_row(1, "h", 32, 0, 1, "b"),
        worker_row(1, "h", 16, 0, 1, "default"),
    ]

    expect(await post("/add", add_body("h", "same", 1, 0, [1], 4)), 201, OK)
    expect(await post("/add", add_body("h", "same", 1, 0, [1, 2], 6, group="a")), 201, OK)
    assert await loads(client) == [
        load_row("h", 1, 0, 6, 2, "a"),
        load_row("h", 1, 0, 0, 0, "b"),
        load_row("h", 1, 0, 4, 1, "default"),
    ]
    assert await loads(client, routing_group="a") == [load_row("h", 1, 0, 6, 2, "a")]
    expect(await post("/free", req_body("h", "same", group="a")), 200, OK)
    assert await loads(client, model_name="h") == [
        load_row("h", 1, 0, 0, 0, "a"),
        load_row("h", 1, 0, 0, 0, "b"),
        load_row("h", 1, 0, 4, 1, "default"),
    ]

    no_tracker = "no slot tracker for model=h routing_group=zzz"
    expect_error(await post("/add", add_body("h", "z", 1, 0, [1], group="zzz")), 404, no_tracker)
    expect_error(
        await post("/prefill_complete", req_body("h", "same", group="zzz")), 404, no_tracker
    )
    expect_error(await post("/free", req_body("h", "same", group="zzz")), 404, no_tracker)
    expect_error(
        await post(
            "/potential_loads",
            {"model_name": "h", "routing_group": "zzz", "sequence_hashes": [1]},
        ),
        404,
        no_tracker,
    )
    expect_error(
        await post("/unregister", {"worker_id": 1, "model_name": "h", "routing_group": "zzz"}),
        404,
        "worker 1 not found for model=h routing_group=zzz",
    )


async def test_h15_json_errors(client: httpx.AsyncClient, post: PostJson) -> None:
    good = reg(3, "m", 4, 0, 1)

    async def raw(content: bytes, content_type: str | None = "application/json"):
        headers = {"content-type": content_type} if content_type else {}
        return await client.post("/register", content=content, headers=headers)

    expect_error_prefix(await raw(b"{"), 400, JSON_PARSE)
    expect_error_prefix(await raw(b""), 400, JSON_PARSE)
    expect_error(await raw(b'{"worker_id":3}', None), 415, CONTENT_TYPE)
    expect_error(await raw(b'{"worker_id":3}', "text/plain"), 415, CONTENT_TYPE)

    missing = {k: v for k, v in good.items() if k != "dp_size"}
    expect_error(await post("/register", missing), 422, JSON_SHAPE + "missing field `dp_size`")
    for field, value in [
        ("worker_id", -3),
        ("worker_id", "3"),
        ("routing_group", None),
        ("block_size", 4294967296),
    ]:
        expect_error_prefix(await post("/register", {**good, field: value}), 422, JSON_SHAPE)
    assert await workers(client) == []


async def test_h15_body_limit(client: httpx.AsyncClient, post: PostJson) -> None:
    expect(await post("/register", reg(1, "m", 4, 0, 1)), 201, OK)
    base = b'{"model_name":"m","sequence_hashes":[1,2],"new_isl_tokens":3'

    def body_of(size: int) -> bytes:
        return base + b" " * (size - len(base) - 1) + b"}"

    headers = {"content-type": "application/json"}
    at_limit = body_of(BODY_LIMIT)
    assert len(at_limit) == 2_097_152
    resp = await client.post("/potential_loads", content=at_limit, headers=headers)
    expect(resp, 200, [potential_row(1, 0, 3, 2, 0)])

    over = body_of(BODY_LIMIT + 1)
    assert len(over) == 2_097_153
    resp = await client.post("/potential_loads", content=over, headers=headers)
    expect_error(resp, 413, TOO_LARGE)


async def test_h16_routing_errors(client: httpx.AsyncClient) -> None:
    # (/metrics is served by this service, unlike the reference)
    for method, path in [
        ("GET", "/nonexistent"),
        ("POST", "/nonexistent"),
        ("GET", "/health/"),
        ("GET", "/workers/"),
        ("GET", "/loads/"),
        ("POST", "/register/"),
        ("POST", "/add/"),
        ("GET", "/peers"),
        ("GET", "/dump"),
        ("DELETE", "/nothing/here"),
    ]:
        resp = await client.request(method, path)
        expect_error(resp, 404, "route not found")
    for method, path in [
        ("GET", "/unregister"),
        ("POST", "/health"),
        ("POST", "/workers"),
        ("GET", "/add"),
        ("PUT", "/register"),
        ("DELETE", "/free"),
        ("PATCH", "/loads"),
        ("GET", "/potential_loads"),
        ("GET", "/prefill_complete"),
    ]:
        resp = await client.request(method, path)
        expect_error(resp, 405, "method not allowed")


async def test_head_on_get_routes_is_get_without_body(client: httpx.AsyncClient) -> None:
    """§7.3: HEAD on a GET route behaves like GET without a body."""
    resp = await client.head("/health")
    assert (resp.status_code, resp.content) == (200, b"")
    for path in ["/workers", "/loads", "/workers?model_name=m", "/loads?routing_group=default"]:
        get = await client.get(path)
        head = await client.head(path)
        assert head.status_code == get.status_code == 200
        assert head.content == b""
        assert head.headers["content-type"] == get.headers["content-type"]
    head = await client.head("/nonexistent")
    assert (head.status_code, head.content) == (404, b"")
    head = await client.head("/add")
    assert (head.status_code, head.content) == (405, b"")


async def test_h17_ignored_fields(client: httpx.AsyncClient, post: PostJson) -> None:
    resp = await post("/register", {**reg(1, "m", 4, 0, 1), "tenant_id": "t1", "extra": 5})
    expect(resp, 201, OK)
    assert await workers(client) == [worker_row(1, "m", 4, 0, 1, "default")]
    resp = await post(
        "/add",
        {
            **add_body("m", "r1", 1, 0, [1, 2], 4),
            "tenant_id": "t1",
            "lora_name": "adapter",
            "expected_output_tokens": 100,
            "extra": {"nested": [1, 2]},
        },
    )
    expect(resp, 201, OK)
    assert await loads(client) == [load_row("m", 1, 0, 4, 2)]
    expect(await post("/free", {**req_body("m", "r1"), "extra": None}), 200, OK)
    assert await loads(client) == [load_row("m", 1, 0, 0, 0)]


async def test_h18_filters(client: httpx.AsyncClient, post: PostJson) -> None:
    expect(await post("/register", reg(2, "n", 4, 0, 1)), 201, OK)
    expect(await post("/register", reg(1, "m", 4, 0, 1)), 201, OK)
    expect(await post("/register", reg(1, "m", 8, 0, 1, group="g2")), 201, OK)
    expect(await post("/register", reg(7, "", 4, 5, 1, group="")), 201, OK)
    everything = [
        worker_row(7, "", 4, 5, 1, ""),
        worker_row(1, "m", 4, 0, 1, "default"),
        worker_row(1, "m", 8, 0, 1, "g2"),
        worker_row(2, "n", 4, 0, 1, "default"),
    ]
    assert await workers(client) == everything

    assert (await client.get("/workers?routing_group=g1")).json() == []
    assert (await client.get("/workers?model_name=zzz")).json() == []
    assert (await client.get("/workers?tenant_id=g1")).json() == everything
    assert (await client.get("/workers?model_name=m")).json() == everything[1:3]
    assert (await client.get("/workers?routing_group=g2")).json() == [everything[2]]
    assert (await client.get("/workers?model_name=m&routing_group=default")).json() == [
        everything[1]
    ]
    # a key without a value is the empty string
    assert (await client.get("/workers?model_name")).json() == [everything[0]]
    assert (await client.get("/workers?model_name=&routing_group=")).json() == [everything[0]]

    assert await loads(client, model_name="m") == [
        load_row("m", 1, 0, 0, 0),
        load_row("m", 1, 0, 0, 0, "g2"),
    ]
    assert await loads(client, routing_group="g1") == []
    assert await loads(client, routing_group="") == [load_row("", 7, 5, 0, 0, "")]
    assert len(await loads(client, tenant_id="x")) == 4

    # deliberate difference: the reference answers text/plain, this service JSON
    for path in ["/workers", "/loads"]:
        for name in ["model_name", "routing_group"]:
            resp = await client.get(f"{path}?{name}=m&{name}=n")
            expect_error(resp, 400, f"Failed to deserialize query string: duplicate field `{name}`")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/peers", None),
        ("POST", "/register_peer", {"endpoint": "tcp://127.0.0.1:9999"}),
    ],
)
async def test_h19_no_replica_sync_routes(
    client: httpx.AsyncClient, method: str, path: str, body: dict[str, Any] | None
) -> None:
    """The peer routes of other Dynamo versions (``/register_peer``, ``/peers``) do not exist."""
    resp = await client.request(method, path, json=body)
    expect_error(resp, 404, "route not found")
