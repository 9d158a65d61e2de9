"""The routes and fields this service adds on top of the reference slot tracker API.

Modeled prefill (``expected_prefill_ms``), ``track_prefill_tokens``, ``expected_output_tokens``,
LoRA names, prompts given as ``token_ids``, ``/upsert``, ``/reconcile``, ``/output_block``,
``/project_loads``, ``/lora_counts``, ``/batch``, ``/ready``, ``/replication`` and the periodic
expiry sweep. Numbers come from SPEC §2-§4 (worked examples E2/E4, §2.9, M16, M18, Appendix A) and
are asserted exactly; time only moves when the test advances the ``FakeClock``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_slot_tracker.core.hashing import sequence_hashes_for_tokens
from tests.api.conftest import PostJson, post_json
from tests.fakes import FakeClock
from tests.support.tracker import slots

OK = {"status": "ok"}
SHAPE = "Failed to deserialize the JSON body into the target type: "
NO_TRACKER = "no slot tracker for model={} routing_group={}"

# SPEC Appendix A: tokens 1..8, block size 4.
SEQ_1_8 = [14643705804678351452, 4945711292740353085]
SEQ_1_8_LORA = [11381080598872079209, 17518568667535815909]  # LoRA "adapter-a"
TOKENS_1_8 = list(range(1, 9))


def signed(h: int) -> int:
    """The API's signed 64-bit form of an unsigned sequence hash."""
    return h - 2**64 if h >= 2**63 else h


def reg(worker_id: int, model: str = "m", block_size: int = 4, dp_start: int = 0, dp_size: int = 1):
    return {
        "worker_id": worker_id,
        "model_name": model,
        "block_size": block_size,
        "dp_start": dp_start,
        "dp_size": dp_size,
    }


def add(rid: str, worker_id: int = 1, dp_rank: int = 0, model: str = "m", **fields: Any):
    body: dict[str, Any] = {
        "model_name": model,
        "request_id": rid,
        "worker_id": worker_id,
        "dp_rank": dp_rank,
    }
    if "token_ids" not in fields:
        body["sequence_hashes"] = fields.pop("sequence_hashes", [])
    body.update(fields)
    return body


def req(rid: str, model: str = "m", **fields: Any) -> dict[str, Any]:
    return {"model_name": model, "request_id": rid, **fields}


async def ok(post: PostJson, path: str, body: Any, status: int = 200) -> Any:
    r = await post(path, body)
    assert r.status_code == status, (path, body, r.status_code, r.text)
    return r.json()


async def loads(client: httpx.AsyncClient, model: str = "m") -> dict[tuple[int, int], dict]:
    r = await client.get("/loads", params={"model_name": model})
    assert r.status_code == 200, r.text
    return {(row["worker_id"], row["dp_rank"]): row for row in r.json()}


async def load(client: httpx.AsyncClient, worker_id: int = 1, dp_rank: int = 0, model: str = "m"):
    return (await loads(client, model))[(worker_id, dp_rank)]


async def lora_counts(client: httpx.AsyncClient, model: str = "m", group: str | None = None):
    params = (
        {"model_name": model} if group is None else {"model_name": model, "routing_group": group}
    )
    return await client.get("/lora_counts", params=params)


def counts(row: dict[str, Any]) -> tuple[int, int, int]:
    """(active requests, active decode blocks, active prefill tokens) of a ``/loads`` row."""
    return row["active_requests"], row["active_decode_blocks"], row["active_prefill_tokens"]


def by_rank(rows: list[dict]) -> dict[tuple[int, int], dict]:
    return {(row["worker_id"], row["dp_rank"]): row for row in rows}


# -- modeled prefill: expected_prefill_ms --------------------------------------------------------


async def test_modeled_prefill_decays_linearly_from_the_add_instant(
    post: PostJson, client: httpx.AsyncClient, clock: FakeClock
) -> None:
    await ok(post, "/register", reg(1, dp_size=2), 201)
    body = add("r1", sequence_hashes=[1, 2], new_isl_tokens=100, expected_prefill_ms=10_000)
    await ok(post, "/add", body, 201)

    row = await load(client)
    assert row["active_prefill_tokens"] == 100
    assert row["modeled_remaining_prefill_ms"] == 10_000
    assert row["active_decode_blocks"] == 2
    assert row["active_requests"] == 1

    clock.advance(5)
    row = await load(client)
    assert (row["active_prefill_tokens"], row["modeled_remaining_prefill_ms"]) == (50, 5000)
    # the idle rank: no backlog, zero modeled time
    idle = await load(client, dp_rank=1)
    assert (idle["active_prefill_tokens"], idle["modeled_remaining_prefill_ms"]) == (0, 0)

    clock.advance(2.5)  # +7.5 s: floor of completed tokens -> 100 - 75
    row = await load(client)
    assert (row["active_prefill_tokens"], row["modeled_remaining_prefill_ms"]) == (25, 2500)

    clock.advance(7.5)  # +15 s: done and clipped at zero
    row = await load(client)
    assert (row["active_prefill_tokens"], row["modeled_remaining_prefill_ms"]) == (0, 0)
    assert row["active_decode_blocks"] == 2  # blocks never decay


async def test_unmodeled_prefill_makes_modeled_time_null_and_only_the_anchor_decays(
    post: PostJson, client: httpx.AsyncClient, clock: FakeClock
) -> None:
    await ok(post, "/register", reg(1), 201)
    await ok(post, "/add", add("r1", new_isl_tokens=100, expected_prefill_ms=10_000), 201)
    await ok(post, "/add", add("r2", new_isl_tokens=60), 201)  # no duration: unmodeled
    row = await load(client)
    assert row["modeled_remaining_prefill_ms"] is None
    assert row["active_prefill_tokens"] == 160

    clock.advance(5)  # anchor-only path: 60 + ceil(100 * (1 - 5/10))
    row = await load(client)
    assert (row["active_prefill_tokens"], row["modeled_remaining_prefill_ms"]) == (110, None)

    await ok(post, "/free", req("r2"))  # all modeled again
    row = await load(client)
    assert (row["active_prefill_tokens"], row["modeled_remaining_prefill_ms"]) == (50, 5000)


async def test_freeing_a_later_modeled_prefill_credits_the_anchor(
    post: PostJson, client: httpx.AsyncClient, clock: FakeClock
) -> None:
    """SPEC §3.7 E2: p(100, 10 s) and p(40, 4 s) added together; free the later one at +5 s."""
    await ok(post, "/register", reg(1), 201)
    await ok(post, "/add", add("oldest", new_isl_tokens=100, expected_prefill_ms=10_000), 201)
    await ok(post, "/add", add("later", new_isl_tokens=40, expected_prefill_ms=4_000), 201)
    clock.advance(5)
    row = await load(client)
    assert (row["active_prefill_tokens"], row["modeled_remaining_prefill_ms"]) == (90, 9000)
    await ok(post, "/free", req("later"))
    row = await load(client)
    assert (row["active_prefill_tokens"], row["modeled_remaining_prefill_ms"]) == (90, 9000)
    assert row["active_requests"] == 1


async def test_prefill_complete_of_the_anchor_re_anchors_the_next_prefill_now(
    post: PostJson, client: httpx.AsyncClient, clock: FakeClock
) -> None:
    """SPEC §3.7 E4 through HTTP: 11,000 ms, then 2,000 ms after re-anchoring."""
    await ok(post, "/register", reg(1), 201)
    await ok(post, "/add", add("a-oldest", new_isl_tokens=100, expected_prefill_ms=10_000), 201)
    clock.advance(1)
    await ok(post, "/add", add("a-later", new_isl_tokens=60, expected_prefill_ms=4_000), 201)
    clock.advance(2)  # +3 s
    row = await load(client)
    assert (row["active_prefill_tokens"], row["modeled_remaining_prefill_ms"]) == (130, 11_000)
    await ok(post, "/prefill_complete", req("a-oldest"))
    clock.advance(2)  # +5 s: a-later anchored at +3 s
    row = await load(client)
    assert (row["active_prefill_tokens"], row["modeled_remaining_prefill_ms"]) == (30, 2000)
    assert row["active_requests"] == 2


async def test_fractional_and_zero_prefill_durations(
    post: PostJson, client: httpx.AsyncClient, clock: FakeClock
) -> None:
    await ok(post, "/register", reg(1, dp_size=2), 201)
    # 2.5 ms: modeled time counts whole milliseconds per prefill
    await ok(post, "/add", add("r1", new_isl_tokens=10, expected_prefill_ms=2.5), 201)
    row = await load(client)
    assert (row["active_prefill_tokens"], row["modeled_remaining_prefill_ms"]) == (10, 2)
    clock.advance_ns(1_250_000)  # half of 2.5 ms
    row = await load(client)
    assert row["active_prefill_tokens"] == 5
    # a zero duration completes its own tokens at once and no more
    await ok(post, "/add", add("r2", dp_rank=1, new_isl_tokens=7, expected_prefill_ms=0), 201)
    row = await load(client, dp_rank=1)
    assert (row["active_prefill_tokens"], row["modeled_remaining_prefill_ms"]) == (0, 0)
    assert row["active_requests"] == 1


async def test_a_duration_without_tokens_tracks_no_prefill(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    await ok(post, "/register", reg(1), 201)
    await ok(post, "/add", add("r1", sequence_hashes=[5], expected_prefill_ms=1000), 201)
    row = await load(client)
    assert (row["active_prefill_tokens"], row["modeled_remaining_prefill_ms"]) == (0, 0)
    assert (row["active_requests"], row["active_decode_blocks"]) == (1, 1)


@pytest.mark.parametrize("value", [-1, -0.5, 1e12 + 1, "10", True])
async def test_out_of_range_prefill_duration_is_422(post: PostJson, value: Any) -> None:
    await ok(post, "/register", reg(1), 201)
    r = await post("/add", add("r1", new_isl_tokens=5, expected_prefill_ms=value))
    assert r.status_code == 422, r.text
    assert r.json()["error"].startswith(SHAPE + "expected_prefill_ms")


# -- track_prefill_tokens, expected_output_tokens --------------------------------------------------


async def test_track_prefill_tokens_false_keeps_the_request_without_prefill_load(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    await ok(post, "/register", reg(1), 201)
    body = add("r1", sequence_hashes=[1, 2], new_isl_tokens=100, track_prefill_tokens=False)
    await ok(post, "/add", body, 201)
    row = await load(client)
    assert (row["active_prefill_tokens"], row["active_requests"]) == (0, 1)
    assert row["active_decode_blocks"] == 2
    await ok(post, "/prefill_complete", req("r1"))
    await ok(post, "/free", req("r1"))
    row = await load(client)
    assert counts(row) == (0, 0, 0)


async def test_track_prefill_tokens_true_and_default(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    await ok(post, "/register", reg(1), 201)
    await ok(post, "/add", add("r1", new_isl_tokens=30, track_prefill_tokens=True), 201)
    assert (await load(client))["active_prefill_tokens"] == 30
    await ok(post, "/add", add("r2", new_isl_tokens=12), 201)  # default: tracked when > 0
    assert (await load(client))["active_prefill_tokens"] == 42
    # tracking without tokens tracks nothing
    await ok(post, "/add", add("r3", new_isl_tokens=0, track_prefill_tokens=True), 201)
    row = await load(client)
    assert (row["active_prefill_tokens"], row["active_requests"]) == (42, 3)
    r = await post("/add", add("r4", track_prefill_tokens="yes"))
    assert r.status_code == 422


async def test_expected_output_tokens_is_stored_and_changes_no_load(
    app, post: PostJson, client: httpx.AsyncClient
) -> None:
    await ok(post, "/register", reg(1), 201)
    await ok(post, "/add", add("r1", sequence_hashes=[1], expected_output_tokens=256), 201)
    await ok(post, "/add", add("r2", sequence_hashes=[2]), 201)
    slot = slots(app.state.service.trackers[("m", "default")])
    requests = next(iter(slot.values())).requests
    assert requests["r1"].expected_output_tokens == 256
    assert requests["r2"].expected_output_tokens is None
    row = await load(client)
    assert (row["active_decode_blocks"], row["active_prefill_tokens"]) == (2, 0)
    for bad in (-1, 2**32, 1.5):
        r = await post("/add", add("r3", expected_output_tokens=bad))
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"].startswith(SHAPE + "expected_output_tokens")


# -- LoRA names and /lora_counts -------------------------------------------------------------------


async def test_lora_counts_follow_adds_frees_and_topology(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    await ok(post, "/register", reg(1, dp_size=2), 201)
    await ok(post, "/add", add("r1", lora_name="a"), 201)
    await ok(post, "/add", add("r2", dp_rank=1, lora_name="a"), 201)
    await ok(post, "/add", add("r3", lora_name="b"), 201)
    await ok(post, "/add", add("r4"), 201)  # no LoRA: not counted
    r = await lora_counts(client)
    assert r.status_code == 200
    assert r.json() == {
        "model_name": "m",
        "routing_group": "default",
        "lora_counts": {"a": 2, "b": 1},
    }

    await ok(post, "/free", req("r1"))
    assert (await lora_counts(client)).json()["lora_counts"] == {"a": 1, "b": 1}
    # rank 1 leaves: its request and LoRA go with it
    await ok(post, "/upsert", reg(1, dp_size=1))
    assert (await lora_counts(client)).json()["lora_counts"] == {"b": 1}
    await ok(post, "/free", req("r3"))
    assert (await lora_counts(client)).json()["lora_counts"] == {}

    await ok(post, "/unregister", {"worker_id": 1, "model_name": "m"})
    r = await lora_counts(client)
    assert r.status_code == 404
    assert r.json() == {"error": NO_TRACKER.format("m", "default")}


async def test_lora_counts_per_routing_group(post: PostJson, client: httpx.AsyncClient) -> None:
    await ok(post, "/register", {**reg(1), "routing_group": "g"}, 201)
    await ok(post, "/add", {**add("r1", lora_name="x"), "routing_group": "g"}, 201)
    r = await lora_counts(client, group="g")
    assert r.json() == {"model_name": "m", "routing_group": "g", "lora_counts": {"x": 1}}
    r = await lora_counts(client)
    assert r.status_code == 404
    assert r.json() == {"error": NO_TRACKER.format("m", "default")}


# -- prompts as token ids --------------------------------------------------------------------------


def test_appendix_a_vectors_match_the_hashing_module() -> None:
    assert sequence_hashes_for_tokens(TOKENS_1_8, 4) == [signed(h) for h in SEQ_1_8]
    assert sequence_hashes_for_tokens(TOKENS_1_8, 4, "adapter-a") == [
        signed(h) for h in SEQ_1_8_LORA
    ]
    assert sequence_hashes_for_tokens(TOKENS_1_8, 4, "") == [signed(h) for h in SEQ_1_8]


async def test_token_ids_are_hashed_with_the_trackers_block_size(
    app, post: PostJson, client: httpx.AsyncClient
) -> None:
    await ok(post, "/register", reg(1, block_size=4), 201)
    await ok(post, "/add", add("r1", token_ids=TOKENS_1_8 + [9, 10, 11]), 201)  # partial block
    tracker = app.state.service.trackers[("m", "default")]
    prompt = slots(tracker)[next(iter(slots(tracker)))].requests["r1"].prompt_blocks
    assert prompt == [signed(h) for h in SEQ_1_8]  # kept in the API's signed form
    assert (await load(client))["active_decode_blocks"] == 2

    # the same prompt given as (signed) sequence hashes overlaps completely
    q = {"model_name": "m", "sequence_hashes": [signed(h) for h in SEQ_1_8]}
    rows = await ok(post, "/potential_loads", q)
    assert rows == [
        {
            "worker_id": 1,
            "dp_rank": 0,
            "potential_prefill_tokens": 0,
            "potential_decode_blocks": 2,
            "active_requests": 1,
        }
    ]

    # another tracker with block size 8 hashes the same tokens into one block
    await ok(post, "/register", reg(1, model="m8", block_size=8), 201)
    await ok(post, "/add", add("r1", model="m8", token_ids=TOKENS_1_8), 201)
    tracker8 = app.state.service.trackers[("m8", "default")]
    prompt8 = slots(tracker8)[next(iter(slots(tracker8)))].requests["r1"].prompt_blocks
    assert prompt8 == sequence_hashes_for_tokens(TOKENS_1_8, 8)
    assert len(prompt8) == 1 and prompt8[0] != signed(SEQ_1_8[0])


async def test_token_ids_with_lora_use_the_lora_seed(
    app, post: PostJson, client: httpx.AsyncClient
) -> None:
    await ok(post, "/register", reg(1), 201)
    await ok(post, "/add", add("r1", token_ids=TOKENS_1_8, lora_name="adapter-a"), 201)
    tracker = app.state.service.trackers[("m", "default")]
    prompt = slots(tracker)[next(iter(slots(tracker)))].requests["r1"].prompt_blocks
    assert prompt == [signed(h) for h in SEQ_1_8_LORA]
    # empty LoRA name = no LoRA
    await ok(post, "/add", add("r2", token_ids=TOKENS_1_8, lora_name=""), 201)
    assert slots(tracker)[next(iter(slots(tracker)))].requests["r2"].prompt_blocks == [
        signed(h) for h in SEQ_1_8
    ]


async def test_fewer_tokens_than_a_block_hash_to_nothing(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    await ok(post, "/register", reg(1), 201)
    await ok(post, "/add", add("r1", token_ids=[1, 2, 3], new_isl_tokens=3), 201)
    row = await load(client)
    assert (row["active_decode_blocks"], row["active_prefill_tokens"]) == (0, 3)


async def test_prompt_must_be_given_exactly_once(post: PostJson) -> None:
    await ok(post, "/register", reg(1), 201)
    both = add("r1", sequence_hashes=[1], token_ids=[1, 2, 3, 4])
    for path, body in [
        ("/add", both),
        ("/potential_loads", {"model_name": "m", "sequence_hashes": [1], "token_ids": [1]}),
        ("/project_loads", {"model_name": "m", "sequence_hashes": [1], "token_ids": [1]}),
    ]:
        r = await post(path, body)
        assert r.status_code == 422, (path, r.text)
        assert r.json() == {
            "error": SHAPE + "give either `sequence_hashes` or `token_ids`, not both"
        }
    neither = {"model_name": "m", "request_id": "r1", "worker_id": 1, "dp_rank": 0}
    for path, body in [
        ("/add", neither),
        ("/potential_loads", {"model_name": "m"}),
        ("/project_loads", {"model_name": "m"}),
    ]:
        r = await post(path, body)
        assert r.status_code == 422, (path, r.text)
        assert r.json() == {"error": SHAPE + "missing field `sequence_hashes`"}


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.0], ["1"], None])
async def test_token_ids_must_be_u32(post: PostJson, bad: Any) -> None:
    await ok(post, "/register", reg(1), 201)
    r = await post("/add", add("r1", token_ids=bad))
    assert r.status_code == 422, r.text
    assert r.json()["error"].startswith(SHAPE + "token_ids")


# -- /potential_loads with token ids and LoRA (SPEC M18) ---------------------------------------


async def test_potential_loads_with_token_ids_and_lora(post: PostJson) -> None:
    await ok(post, "/register", reg(1), 201)
    await ok(post, "/register", reg(2), 201)
    await ok(post, "/add", add("base", token_ids=TOKENS_1_8), 201)
    await ok(
        post, "/add", add("lora", worker_id=2, token_ids=TOKENS_1_8, lora_name="adapter-a"), 201
    )

    q = {"model_name": "m", "token_ids": TOKENS_1_8, "new_isl_tokens": 8}
    rows = by_rank(await ok(post, "/potential_loads", q))
    assert rows[(1, 0)]["potential_decode_blocks"] == 2
    assert rows[(2, 0)]["potential_decode_blocks"] == 4
    assert rows[(1, 0)]["potential_prefill_tokens"] == 8
    assert rows[(2, 0)]["active_requests"] == 1

    rows = by_rank(await ok(post, "/potential_loads", {**q, "lora_name": "adapter-a"}))
    assert rows[(1, 0)]["potential_decode_blocks"] == 4
    assert rows[(2, 0)]["potential_decode_blocks"] == 2

    # the LoRA name only matters for token ids: the same hashes match whatever the name
    hashed = {"model_name": "m", "sequence_hashes": [signed(h) for h in SEQ_1_8_LORA]}
    rows = by_rank(await ok(post, "/potential_loads", {**hashed, "lora_name": "other"}))
    assert rows[(2, 0)]["potential_decode_blocks"] == 2


# -- /upsert --------------------------------------------------------------------------------------


async def test_upsert_creates_then_updates(post: PostJson, client: httpx.AsyncClient) -> None:
    assert await ok(post, "/upsert", reg(1, dp_size=2), 201) == OK
    assert await ok(post, "/upsert", reg(1, dp_size=2), 200) == OK  # identical: unchanged
    assert await ok(post, "/upsert", reg(1, dp_start=1, dp_size=3), 200) == OK
    r = await client.get("/workers")
    assert r.json() == [
        {
            "worker_id": 1,
            "model_name": "m",
            "routing_group": "default",
            "block_size": 4,
            "dp_start": 1,
            "dp_size": 3,
        }
    ]
    assert sorted(await loads(client)) == [(1, 1), (1, 2), (1, 3)]
    # a registered worker can be upserted, and an upserted one cannot be registered again
    r = await post("/register", reg(1))
    assert r.status_code == 409


async def test_upsert_keeps_other_workers_and_kept_ranks_and_drops_left_ranks(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    await ok(post, "/register", reg(1, dp_size=2), 201)
    await ok(post, "/register", reg(2), 201)
    await ok(post, "/add", add("on-1-0", sequence_hashes=[1, 2], new_isl_tokens=8), 201)
    await ok(post, "/add", add("on-1-1", dp_rank=1, sequence_hashes=[3], new_isl_tokens=4), 201)
    await ok(post, "/add", add("on-2-0", worker_id=2, sequence_hashes=[4, 5, 6]), 201)

    await ok(post, "/upsert", reg(1, dp_size=1))  # rank (1,1) leaves
    rows = await loads(client)
    assert sorted(rows) == [(1, 0), (2, 0)]
    assert (rows[(1, 0)]["active_requests"], rows[(1, 0)]["active_decode_blocks"]) == (1, 2)
    assert rows[(1, 0)]["active_prefill_tokens"] == 8
    assert (rows[(2, 0)]["active_requests"], rows[(2, 0)]["active_decode_blocks"]) == (1, 3)

    # the dropped request is gone: completion 404, free a no-op, its id reusable
    r = await post("/prefill_complete", req("on-1-1"))
    assert r.status_code == 404
    assert r.json() == {"error": "Request on-1-1 not found"}
    assert await ok(post, "/free", req("on-1-1")) == OK
    await ok(post, "/add", add("on-1-1", sequence_hashes=[3]), 201)

    # the rank comes back empty
    await ok(post, "/upsert", reg(1, dp_size=2))
    row = (await loads(client))[(1, 1)]
    assert (row["active_requests"], row["active_decode_blocks"]) == (0, 0)


async def test_upsert_block_size_mismatch_and_validation(post: PostJson) -> None:
    await ok(post, "/register", reg(1, block_size=4), 201)
    r = await post("/upsert", reg(2, block_size=8))
    assert r.status_code == 409
    assert r.json() == {
        "error": "block_size mismatch for model=m routing_group=default: existing=4, requested=8"
    }
    for body, message in [
        (reg(2, block_size=0), "block_size must be greater than 0"),
        (reg(2, dp_size=0), "dp_size must be greater than 0"),
        (reg(2, dp_start=4294967295, dp_size=1), "dp range overflows u32: start=4294967295 size=1"),
        (reg(2, dp_size=4097), "dp_size 4097 exceeds the maximum 4096"),
    ]:
        r = await post("/upsert", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json() == {"error": message}
    r = await post("/upsert", {"worker_id": 2, "model_name": "m", "block_size": 4, "dp_start": 0})
    assert r.status_code == 422
    assert r.json() == {"error": SHAPE + "missing field `dp_size`"}


async def test_rank_limit_never_leaves_a_tracker_behind(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    """A registration refused for its size creates nothing (no tracker, no workers)."""
    for path in ("/register", "/upsert"):
        r = await post(path, reg(1, model="big", dp_size=4294967294))
        assert r.status_code == 400
        assert r.json() == {"error": "dp_size 4294967294 exceeds the maximum 4096"}
    assert (await client.get("/workers")).json() == []
    for wid in range(4):
        await ok(post, "/register", reg(wid, model="big", dp_size=4096), 201)
    r = await post("/register", reg(9, model="big"))
    assert r.status_code == 400
    assert r.json() == {
        "error": "too many ranks for model=big routing_group=default: 16385 > 16384"
    }


# -- /reconcile -----------------------------------------------------------------------------------


def recon(workers: list[tuple[int, int, int]], model: str = "m", block_size: int = 4):
    return {
        "model_name": model,
        "block_size": block_size,
        "workers": [{"worker_id": w, "dp_start": s, "dp_size": n} for w, s, n in workers],
    }


def ranks(*pairs: tuple[int, int]) -> list[dict[str, int]]:
    return [{"worker_id": w, "dp_rank": r} for w, r in pairs]


async def test_reconcile_reports_sorted_added_and_removed_ranks(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    body = await ok(post, "/reconcile", recon([(3, 0, 1), (1, 0, 2)]))
    assert body == {"added": ranks((1, 0), (1, 1), (3, 0)), "removed": []}
    await ok(post, "/add", add("keep", dp_rank=1, sequence_hashes=[1, 2, 3], new_isl_tokens=6), 201)
    await ok(post, "/add", add("gone", worker_id=3, sequence_hashes=[9]), 201)

    body = await ok(post, "/reconcile", recon([(2, 4, 2), (1, 1, 2)]))
    assert body == {"added": ranks((1, 2), (2, 4), (2, 5)), "removed": ranks((1, 0), (3, 0))}
    rows = await loads(client)
    assert sorted(rows) == [(1, 1), (1, 2), (2, 4), (2, 5)]
    row = rows[(1, 1)]  # kept with its state
    assert counts(row) == (1, 3, 6)
    assert (await post("/prefill_complete", req("gone"))).status_code == 404
    assert [w["worker_id"] for w in (await client.get("/workers")).json()] == [1, 2]

    # the same topology again changes nothing
    assert await ok(post, "/reconcile", recon([(2, 4, 2), (1, 1, 2)])) == {
        "added": [],
        "removed": [],
    }


async def test_reconcile_to_nothing_drops_the_tracker(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    await ok(post, "/register", reg(1, dp_size=2), 201)
    await ok(post, "/add", add("r1", sequence_hashes=[1]), 201)
    body = await ok(post, "/reconcile", recon([]))
    assert body == {"added": [], "removed": ranks((1, 0), (1, 1))}
    assert (await client.get("/workers")).json() == []
    assert (await client.get("/loads")).json() == []
    no_tracker = {"error": NO_TRACKER.format("m", "default")}
    for path, payload in [
        ("/add", add("r2", sequence_hashes=[1])),
        ("/free", req("r1")),
        ("/prefill_complete", req("r1")),
        ("/output_block", req("r1")),
        ("/potential_loads", {"model_name": "m", "sequence_hashes": [1]}),
        ("/project_loads", {"model_name": "m", "sequence_hashes": [1]}),
    ]:
        r = await post(path, payload)
        assert (r.status_code, r.json()) == (404, no_tracker), path
    # nothing to reconcile away on an absent tracker; a new one may pick another block size
    assert await ok(post, "/reconcile", recon([])) == {"added": [], "removed": []}
    assert await ok(post, "/reconcile", recon([(1, 0, 1)], block_size=16)) == {
        "added": ranks((1, 0)),
        "removed": [],
    }
    assert (await client.get("/workers")).json()[0]["block_size"] == 16


async def test_reconcile_errors_change_nothing(post: PostJson, client: httpx.AsyncClient) -> None:
    await ok(post, "/register", reg(1), 201)
    r = await post("/reconcile", recon([(2, 0, 1), (2, 1, 1)]))
    assert (r.status_code, r.json()) == (400, {"error": "worker 2 is listed more than once"})
    r = await post("/reconcile", recon([(2, 0, 1)], block_size=8))
    assert r.status_code == 409
    assert r.json() == {
        "error": "block_size mismatch for model=m routing_group=default: existing=4, requested=8"
    }
    r = await post("/reconcile", recon([(2, 0, 0)]))
    assert (r.status_code, r.json()) == (400, {"error": "dp_size must be greater than 0"})
    r = await post("/reconcile", recon([(2, 0, 1)], block_size=0))
    assert (r.status_code, r.json()) == (400, {"error": "block_size must be greater than 0"})
    r = await post("/reconcile", recon([(2, 0, 10_000)]))
    assert (r.status_code, r.json()) == (400, {"error": "dp_size 10000 exceeds the maximum 4096"})
    r = await post("/reconcile", recon([(w, 0, 4096) for w in range(2, 7)]))
    assert r.status_code == 400
    assert r.json() == {"error": "too many ranks for model=m routing_group=default: 20480 > 16384"}
    r = await post("/reconcile", {"model_name": "m", "block_size": 4})
    assert (r.status_code, r.json()) == (422, {"error": SHAPE + "missing field `workers`"})
    assert [w["worker_id"] for w in (await client.get("/workers")).json()] == [1]


# -- /output_block --------------------------------------------------------------------------------


async def test_output_block_with_decay_fraction_rounds_half_away_from_zero(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    await ok(post, "/register", reg(1), 201)
    await ok(post, "/add", add("r1", sequence_hashes=[1, 2], new_isl_tokens=8), 201)
    assert (await load(client))["active_decode_blocks"] == 2
    # 3 exclusive blocks x 0.5 = 1.5 -> 2 (Python's round() would give 2 too; 2.5 is the trap)
    assert await ok(post, "/output_block", req("r1", decay_fraction=0.5)) == OK
    assert (await load(client))["active_decode_blocks"] == 2
    # 4 x 0.625 = 2.5 -> 3, not banker's 2
    await ok(post, "/output_block", req("r1", decay_fraction=0.625))
    row = await load(client)
    assert (row["active_decode_blocks"], row["active_prefill_tokens"]) == (3, 8)


async def test_output_blocks_follow_the_worked_example_of_spec_2_9(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    await ok(post, "/register", reg(1), 201)
    await ok(post, "/add", add("r1", sequence_hashes=[1, 2, 3], new_isl_tokens=12), 201)
    assert (await load(client))["active_decode_blocks"] == 3
    await ok(post, "/output_block", req("r1", decay_fraction=0.5))
    assert (await load(client))["active_decode_blocks"] == 2
    await ok(post, "/add", add("r2", sequence_hashes=[1, 2], new_isl_tokens=8), 201)
    assert (await load(client))["active_decode_blocks"] == 2  # fractions are sticky
    await ok(post, "/output_block", req("r1", decay_fraction=0.0))
    assert (await load(client))["active_decode_blocks"] == 1
    await ok(post, "/free", req("r2"))
    await ok(post, "/free", req("r1"))
    row = await load(client)
    assert (row["active_decode_blocks"], row["active_prefill_tokens"]) == (0, 0)


async def test_output_block_without_fraction_adds_a_whole_block(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    await ok(post, "/register", reg(1), 201)
    await ok(post, "/add", add("r1", sequence_hashes=[1, 2]), 201)
    await ok(post, "/output_block", req("r1"))
    await ok(post, "/output_block", req("r1", decay_fraction=None))
    assert (await load(client))["active_decode_blocks"] == 4
    # output blocks never count as prompt overlap
    rows = await ok(post, "/project_loads", {"model_name": "m", "sequence_hashes": [1, 2, 7]})
    assert rows[0]["additional_active_blocks"] == 1
    await ok(post, "/free", req("r1"))
    assert (await load(client))["active_decode_blocks"] == 0


async def test_output_block_errors(post: PostJson) -> None:
    r = await post("/output_block", req("r1"))
    assert (r.status_code, r.json()) == (404, {"error": NO_TRACKER.format("m", "default")})
    await ok(post, "/register", reg(1), 201)
    r = await post("/output_block", req("nope", decay_fraction=0.5))
    assert (r.status_code, r.json()) == (404, {"error": "Request nope not found"})
    await ok(post, "/add", add("r1", sequence_hashes=[1]), 201)
    for bad in (-0.1, 1.5, 2, "0.5", True):
        r = await post("/output_block", req("r1", decay_fraction=bad))
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"].startswith(SHAPE + "decay_fraction")
    await ok(post, "/free", req("r1"))
    r = await post("/output_block", req("r1"))
    assert (r.status_code, r.json()) == (404, {"error": "Request r1 not found"})


# -- /project_loads (SPEC §4.10 M16) ------------------------------------------------------------


async def test_project_loads_m16(post: PostJson) -> None:
    await ok(post, "/register", reg(1), 201)  # a = (1, 0)
    await ok(post, "/register", reg(2), 201)  # b = (2, 0)
    await ok(post, "/add", add("req-a", sequence_hashes=[1, 2, 3], new_isl_tokens=12), 201)
    await ok(post, "/output_block", req("req-a", decay_fraction=0.5))
    await ok(post, "/prefill_complete", req("req-a"))
    body = add("req-b", worker_id=2, sequence_hashes=[1, 2, 4], new_isl_tokens=12)
    await ok(post, "/add", body, 201)

    rows = await ok(post, "/project_loads", {"model_name": "m", "sequence_hashes": [1, 2, 3, 5]})
    assert rows == [
        {
            "worker_id": 1,
            "dp_rank": 0,
            "active_prefill_tokens": 0,
            "active_decode_blocks": 2,
            "additional_active_blocks": 1,
            "potential_decode_blocks": 3,
        },
        {
            "worker_id": 2,
            "dp_rank": 0,
            "active_prefill_tokens": 12,
            "active_decode_blocks": 3,
            "additional_active_blocks": 2,
            "potential_decode_blocks": 5,
        },
    ]
    # /potential_loads agrees (a uniform delta of 16 tokens)
    q = {"model_name": "m", "sequence_hashes": [1, 2, 3, 5], "new_isl_tokens": 16}
    pot = by_rank(await ok(post, "/potential_loads", q))
    got = {w: (r["potential_decode_blocks"], r["potential_prefill_tokens"]) for w, r in pot.items()}
    assert got == {(1, 0): (3, 16), (2, 0): (5, 28)}


async def test_project_loads_decays_modeled_prefill_and_accepts_token_ids(
    post: PostJson, clock: FakeClock
) -> None:
    await ok(post, "/register", reg(1), 201)
    body = add("r1", token_ids=TOKENS_1_8, new_isl_tokens=100, expected_prefill_ms=10_000)
    await ok(post, "/add", body, 201)
    clock.advance(5)
    rows = await ok(post, "/project_loads", {"model_name": "m", "token_ids": TOKENS_1_8[:4]})
    assert rows == [
        {
            "worker_id": 1,
            "dp_rank": 0,
            "active_prefill_tokens": 50,
            "active_decode_blocks": 2,
            "additional_active_blocks": 0,
            "potential_decode_blocks": 2,
        }
    ]
    r = await post("/project_loads", {"model_name": "zz", "sequence_hashes": []})
    assert (r.status_code, r.json()) == (404, {"error": NO_TRACKER.format("zz", "default")})


# -- /batch ---------------------------------------------------------------------------------------


def op(name: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"op": name, **body}


BATCH_SETUP = [("/register", reg(1, dp_size=2)), ("/register", reg(2))]
BATCH_OPS: list[tuple[str, dict[str, Any], int]] = [
    ("add", add("a", sequence_hashes=[1, 2, 3], new_isl_tokens=12), 201),
    ("add", add("b", dp_rank=1, token_ids=TOKENS_1_8, new_isl_tokens=8, lora_name="x"), 201),
    ("add", add("a", worker_id=2, sequence_hashes=[7]), 409),  # duplicate id
    ("add", add("c", worker_id=9, sequence_hashes=[7]), 404),  # unknown rank
    ("add", add("d", model="nomodel", sequence_hashes=[7]), 404),  # unknown tracker
    ("add", add("e", worker_id=2, sequence_hashes=[1, 2], expected_prefill_ms=1000), 201),
    ("add", {"model_name": "m", "request_id": "f", "worker_id": 2}, 422),  # missing dp_rank
    ("prefill_complete", req("a"), 200),
    ("prefill_complete", req("zz"), 404),
    ("output_block", req("a", decay_fraction=0.5), 200),
    ("output_block", req("a", decay_fraction=3), 422),
    ("output_block", req("zz"), 404),
    ("free", req("b"), 200),
    ("free", req("never-added"), 200),
    ("add", add("b", worker_id=2, sequence_hashes=[1]), 201),  # id free again
]


async def state(client: httpx.AsyncClient) -> tuple[Any, Any, Any]:
    return (
        (await client.get("/loads")).json(),
        (await lora_counts(client)).json(),
        (await client.get("/workers")).json(),
    )


async def test_batch_results_are_in_order_and_independent(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    for path, body in BATCH_SETUP:
        await ok(post, path, body, 201)
    body = await ok(post, "/batch", {"operations": [op(n, b) for n, b, _ in BATCH_OPS]})
    results = body["results"]
    assert [r["status"] for r in results] == [status for _, _, status in BATCH_OPS]
    for result, (_, _, status) in zip(results, BATCH_OPS, strict=True):
        if status < 300:
            assert result == {"status": status}
        else:
            assert set(result) == {"status", "error"} and result["error"]
    assert results[2]["error"] == (
        "Request a already exists (assigned to worker WorkerWithDpRank { worker_id: 1, dp_rank: 0 })"
    )
    assert results[3]["error"] == "Worker WorkerWithDpRank { worker_id: 9, dp_rank: 0 } not found"
    assert results[4]["error"] == NO_TRACKER.format("nomodel", "default")
    assert results[6]["error"] == SHAPE + "missing field `dp_rank`"
    assert results[8]["error"] == "Request zz not found"


async def test_batch_state_equals_the_single_calls(make_client, clock: FakeClock) -> None:
    async with make_client() as (_, batched), make_client() as (_, single):
        for path, body in BATCH_SETUP:
            assert (await post_json(batched, path, body)).status_code == 201
            assert (await post_json(single, path, body)).status_code == 201
        one_by_one = []
        for name, body, _ in BATCH_OPS:
            r = await post_json(single, f"/{name}", body)
            one_by_one.append(r.status_code)
        r = await post_json(batched, "/batch", {"operations": [op(n, b) for n, b, _ in BATCH_OPS]})
        assert [x["status"] for x in r.json()["results"]] == one_by_one
        assert await state(batched) == await state(single)
        clock.advance(0.5)  # the modeled prefill decays the same in both
        assert await state(batched) == await state(single)
        row = by_rank((await batched.get("/loads")).json())[(2, 0)]
        assert row["active_prefill_tokens"] == 0 and row["modeled_remaining_prefill_ms"] == 0


async def test_batch_operation_errors(post: PostJson) -> None:
    await ok(post, "/register", reg(1), 201)
    body = await ok(
        post,
        "/batch",
        {
            "operations": [
                {"op": "nope", "model_name": "m", "request_id": "r"},
                {"model_name": "m", "request_id": "r"},
                {"op": "free", "model_name": "m"},
                {"op": "add", **add("r", sequence_hashes=[1], token_ids=[1])},
                {"op": "free", "model_name": "m", "request_id": "r"},
            ]
        },
    )
    assert body["results"] == [
        {
            "status": 422,
            "error": "`op` must be one of add, prefill_complete, free, output_block",
        },
        {
            "status": 422,
            "error": "`op` must be one of add, prefill_complete, free, output_block",
        },
        {"status": 422, "error": SHAPE + "missing field `request_id`"},
        {"status": 422, "error": SHAPE + "give either `sequence_hashes` or `token_ids`, not both"},
        {"status": 200},
    ]
    assert await ok(post, "/batch", {"operations": []}) == {"results": []}
    r = await post("/batch", {})
    assert (r.status_code, r.json()) == (422, {"error": SHAPE + "missing field `operations`"})


# -- /ready, /replication ---------------------------------------------------------------------


async def test_ready_in_embedded_mode(client: httpx.AsyncClient) -> None:
    r = await client.get("/ready")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json()["status"] == "ready"
    assert r.json()["reason"] is None


async def test_replication_status_in_embedded_mode(app, client: httpx.AsyncClient) -> None:
    r = await client.get("/replication")
    assert r.status_code == 200
    body = r.json()
    assert body["mode"] == "embedded"
    assert body["instance_id"] == app.state.service.instance_id
    assert body["instance_id"] > 0


# -- expiry ---------------------------------------------------------------------------------------


def expired_total(text: str, model: str = "m", group: str = "default") -> float | None:
    for family in text_string_to_metric_families(text):
        if family.name == "kv_slot_tracker_requests_expired":
            for sample in family.samples:
                if sample.labels == {"model_name": model, "routing_group": group}:
                    return sample.value
    return None


async def test_sweep_expires_stale_requests_and_counts_them(
    app, post: PostJson, client: httpx.AsyncClient, clock: FakeClock
) -> None:
    await ok(post, "/register", reg(1, dp_size=2), 201)
    await ok(
        post, "/add", add("stale", sequence_hashes=[1, 2], new_isl_tokens=8, lora_name="x"), 201
    )
    assert expired_total((await client.get("/metrics")).text) == 0

    clock.advance(300)  # exactly the expiry: not yet (strictly older only)
    assert app.state.service.expire() == 0
    assert (await load(client))["active_requests"] == 1

    clock.advance(31)  # past the expiry and past the 30 s check interval
    assert app.state.service.expire() == 1
    row = await load(client)
    assert counts(row) == (0, 0, 0)
    assert (await lora_counts(client)).json()["lora_counts"] == {}
    assert expired_total((await client.get("/metrics")).text) == 1
    r = await post("/prefill_complete", req("stale"))
    assert (r.status_code, r.json()) == (404, {"error": "Request stale not found"})
    assert await ok(post, "/free", req("stale")) == OK
    assert app.state.service.expire() == 0  # nothing left
    assert expired_total((await client.get("/metrics")).text) == 1


async def test_expiry_follows_the_configured_duration(make_client, clock: FakeClock) -> None:
    async with make_client(expiry_seconds=5, expiry_check_seconds=1) as (app, client):
        await post_json(client, "/register", reg(1))
        assert (await post_json(client, "/add", add("r1"))).status_code == 201
        clock.advance(4)
        assert app.state.service.expire() == 0
        clock.advance(2)
        assert app.state.service.expire() == 1
        assert (await load(client))["active_requests"] == 0


async def sweeps_after(app: Any, kind: str, runs: int) -> None:
    """Until the sweep ``kind`` (``expiry``, ``leases``) has completed a turn after ``runs``
    (counted by ``app.state.sweeps``); each turns once a (real) second or more often."""
    async with asyncio.timeout(60):  # a bound against a hang, not a figure
        while getattr(app.state.sweeps, kind) <= runs:
            await asyncio.sleep(0.01)


async def test_the_lifespan_sweeper_runs_the_expiry(make_client, clock: FakeClock) -> None:
    settings = {"expiry_seconds": 1, "expiry_check_seconds": 1, "force_expiry_interval_seconds": 1}
    async with make_client(**settings) as (app, client):
        await post_json(client, "/register", reg(1))
        assert (await post_json(client, "/add", add("r1"))).status_code == 201
        await sweeps_after(app, "expiry", app.state.sweeps.expiry)  # a turn with r1 young
        assert (await load(client))["active_requests"] == 1
        clock.advance(10)
        await sweeps_after(app, "expiry", app.state.sweeps.expiry)  # a whole turn after that
        assert (await load(client))["active_requests"] == 0
        assert expired_total((await client.get("/metrics")).text) == 1


async def test_batch_operation_cap_is_its_own_setting(make_client) -> None:
    """``max_batch_operations`` bounds a batch; ``max_hashes_per_request`` does not."""
    async with make_client(max_batch_operations=3, max_hashes_per_request=1_000) as (_, c):
        assert (await post_json(c, "/register", reg(1))).status_code == 201
        ops = [op("add", add(f"r{i}")) for i in range(4)]
        r = await post_json(c, "/batch", {"operations": ops})
        assert r.status_code == 422 and r.json() == {"error": "too many operations in one batch"}
        assert all(row["active_decode_blocks"] == 0 for row in (await c.get("/loads")).json())
        r = await post_json(c, "/batch", {"operations": ops[:3]})
        assert [x["status"] for x in r.json()["results"]] == [201, 201, 201]
    async with make_client(max_batch_operations=5_000, max_hashes_per_request=10) as (_, c):
        assert (await post_json(c, "/register", reg(1))).status_code == 201
        ops = [op("add", add(f"r{i}")) for i in range(2_000)]
        r = await post_json(c, "/batch", {"operations": ops})
        assert r.status_code == 200 and len(r.json()["results"]) == 2_000


async def test_worker_leases_over_http(make_client, clock: FakeClock) -> None:
    """``/heartbeat`` renews; the lease sweep removes a worker whose lease ran out."""
    async with make_client(worker_ttl_seconds=2) as (app, c):
        await ok(lambda p, b: post_json(c, p, b), "/register", reg(1), 201)
        await ok(lambda p, b: post_json(c, p, b), "/register", reg(2), 201)
        r = await post_json(c, "/heartbeat", {"model_name": "m", "worker_id": 9})
        assert r.status_code == 404
        assert r.json() == {"error": "worker 9 not found for model=m routing_group=default"}
        r = await post_json(c, "/heartbeat", {"model_name": "m"})
        assert r.status_code == 422
        clock.advance(1.5)
        r = await post_json(c, "/heartbeat", {"model_name": "m", "worker_id": 1})
        assert (r.status_code, r.json()) == (200, OK)
        clock.advance(0.5)  # worker 2's lease ran out, worker 1's runs until 3.5 s

        async def ids() -> list[int]:
            return [w["worker_id"] for w in (await c.get("/workers")).json()]

        await sweeps_after(app, "leases", app.state.sweeps.leases)  # every 0.2 s of real time
        assert await ids() == [1]
        metrics = (await c.get("/metrics")).text
        assert "kv_slot_tracker_workers_expired_total 1.0" in metrics
        assert "kv_slot_tracker_worker_leases 1.0" in metrics
    # no ttl: heartbeats are accepted and change nothing, and no sweep removes a worker
    async with make_client(force_expiry_interval_seconds=1) as (app, c):
        await ok(lambda p, b: post_json(c, p, b), "/register", reg(1), 201)
        r = await post_json(c, "/heartbeat", {"model_name": "m", "worker_id": 1})
        assert r.status_code == 200
        clock.advance(10**6)
        await sweeps_after(app, "expiry", app.state.sweeps.expiry)
        assert "leases" not in {task.get_name() for task in asyncio.all_tasks()}
        assert app.state.service.expire_leases() == []
        assert app.state.sweeps.leases == 0
        assert [w["worker_id"] for w in (await c.get("/workers")).json()] == [1]
