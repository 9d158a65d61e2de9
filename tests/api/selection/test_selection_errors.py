"""SELECTION.md §8: every error row, with its status, its text (the serde wording after the
fixed prefixes is free) and its check order; a refused request changes nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.api.selection.helpers import SEL, A, add_worker, book

PARSE = "Failed to parse the request body as JSON: "
SHAPE = "Failed to deserialize the JSON body into the target type: "

OK_PROMPT = {"block_hashes": [1], "sequence_hashes": [1], "isl_tokens": 4}


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"selection_seed": 2}


async def state(client) -> list[Any]:
    return [(await client.get(f"{SEL}/{path}")).json() for path in ("loads", "workers", "dump")]


async def seeded(client) -> None:
    """Worker A in the default partition holding reservation `s` (prefix [1])."""
    await add_worker(client, A, data_parallel_size=2)
    await book(client, "s", A, [1], isl=4, ept=4)


CASES: list[tuple[str, str, str, Any, int, str]] = [
    # (name, method, path, body (bytes = raw), status, error text or prefix)
    ("not json", "POST", "/select", b"{nope", 400, PARSE),
    ("empty body", "POST", "/select_and_reserve", b"", 400, PARSE),
    ("array body", "POST", "/select", b"[]", 422, SHAPE),
    ("isl as string", "POST", "/select", {"isl_tokens": "4"}, 422, SHAPE),
    ("float hash", "POST", "/select", {"block_hashes": [1.5]}, 422, SHAPE),
    ("hash >= 2^63", "POST", "/select", {"sequence_hashes": [2**63]}, 422, SHAPE),
    ("token >= 2^32", "POST", "/select", {"token_ids": [2**32]}, 422, SHAPE),
    ("negative worker id", "POST", "/workers", {"worker_id": -1}, 422, SHAPE),
    ("numeric selection id", "POST", "/select", {"selection_id": 5}, 422, SHAPE),
    ("null model", "POST", "/workers", {"worker_id": 1, "model_name": None}, 422, SHAPE),
    ("missing worker_id", "POST", "/workers", {"model_name": "m"}, 422, SHAPE + "missing field `worker_id`"),
    ("missing selection_id", "POST", "/reservations", {"worker_id": None}, 422, SHAPE + "missing field `selection_id`"),
    ("bad override", "POST", "/select", {**OK_PROMPT, "router_config_override": {"router_temperature": -1}}, 422, SHAPE),
    ("no block hashes", "POST", "/select", {"sequence_hashes": [1], "isl_tokens": 4}, 400, "block_hashes is required without token_ids"),
    ("no sequence hashes", "POST", "/select", {"block_hashes": [1], "isl_tokens": 4}, 400, "sequence_hashes is required without token_ids"),
    ("no isl", "POST", "/potential_loads", {"block_hashes": [1], "sequence_hashes": [1]}, 400, "isl_tokens is required without token_ids"),
    ("isl 0", "POST", "/select", {**OK_PROMPT, "isl_tokens": 0}, 400, "isl_tokens must be greater than 0"),
    ("length mismatch", "POST", "/select", {**OK_PROMPT, "block_hashes": [1, 2]}, 400, "block_hashes length 2 must match sequence_hashes length 1"),
    ("overlap scores without sequence hashes", "POST", "/overlap_scores", {"block_hashes": [1], "isl_tokens": 4}, 400, "sequence_hashes is required without token_ids"),
    ("unknown model", "POST", "/select", {**OK_PROMPT, "model_name": "zz"}, 503, "no schedulable workers for model=zz routing_group=default"),
    ("unknown group", "POST", "/select_and_reserve", {**OK_PROMPT, "routing_group": "g"}, 503, "no schedulable workers for model=default routing_group=g"),
    ("unknown model, potential loads", "POST", "/potential_loads", {**OK_PROMPT, "model_name": "zz"}, 503, "no schedulable workers for model=zz routing_group=default"),
    ("unknown model before the prompt", "POST", "/select", {"model_name": "zz"}, 503, "no schedulable workers for model=zz routing_group=default"),
    ("no candidate left", "POST", "/select", {**OK_PROMPT, "allowed_worker_ids": []}, 503, "no endpoints available to route work"),
    ("pinned rank missing", "POST", "/select", {**OK_PROMPT, "pinned_worker": {"worker_id": A, "dp_rank": 9}}, 503, "no endpoints available to route work"),
    ("pinned not allowed", "POST", "/select", {**OK_PROMPT, "pinned_worker": {"worker_id": A, "dp_rank": 0}, "allowed_worker_ids": [7]}, 400, "pinned worker 1 is not in allowed worker set"),
    ("explicit: no such worker", "POST", "/reservations", {**OK_PROMPT, "selection_id": "n", "worker_id": 7}, 404, "schedulable worker 7 not found for model=default routing_group=default"),
    ("explicit: unknown model", "POST", "/reservations", {"selection_id": "n", "worker_id": A, "model_name": "zz"}, 503, "no schedulable workers for model=zz routing_group=default"),
    ("explicit: no such rank", "POST", "/reservations", {**OK_PROMPT, "selection_id": "n", "worker_id": A, "dp_rank": 5}, 404, "Worker WorkerWithDpRank { worker_id: 1, dp_rank: 5 } not found"),
    ("explicit: ept > isl", "POST", "/reservations", {**OK_PROMPT, "selection_id": "n", "worker_id": A, "effective_prefill_tokens": 5}, 400, "effective_prefill_tokens (5) must not exceed isl_tokens (4)"),
    ("explicit: missing hashes", "POST", "/reservations", {"selection_id": "n", "worker_id": A, "isl_tokens": 4}, 400, "sequence_hashes is required without token_ids"),
    ("duplicate id, explicit", "POST", "/reservations", {**OK_PROMPT, "selection_id": "s", "worker_id": A}, 409, "selection s is already reserved or being reserved"),
    ("duplicate id before the prompt", "POST", "/select_and_reserve", {"selection_id": "s", "isl_tokens": 0}, 409, "selection s is already reserved or being reserved"),
    ("replay miss", "POST", "/reservations", {"selection_id": "nope"}, 404, "no pending selection nope for model=default routing_group=default (expired, already used, or never selected)"),
    ("lifecycle on unknown id", "POST", "/reservations/nope/prefill_complete", None, 404, "reservation nope not found"),
    ("delete unknown id", "DELETE", "/reservations/nope", None, 404, "reservation nope not found"),
    ("output block unknown id", "POST", "/reservations/nope/output_block", {}, 404, "reservation nope not found"),
    ("bad decay fraction", "POST", "/reservations/s/output_block", {"decay_fraction": 1.5}, 400, "decay_fraction must be between 0.0 and 1.0"),
    ("output block without body", "POST", "/reservations/s/output_block", None, 415, "Expected request with `Content-Type: application/json`"),
    ("patch unknown worker", "PATCH", "/workers/99", {}, 404, "worker 99 not found"),
    ("patch bad id", "PATCH", "/workers/abc", {}, 400, "Invalid URL: Cannot parse `abc` to a `u64`"),
    ("delete id overflow", "DELETE", "/workers/18446744073709551616", None, 400, "Invalid URL: Cannot parse `18446744073709551616` to a `u64`"),
    ("unknown route", "GET", "/nowhere", None, 404, "route not found"),
    ("wrong method", "GET", "/select", None, 405, "method not allowed"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "text"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
async def test_error_rows(
    client, method: str, path: str, body: Any, status: int, text: str
) -> None:
    await seeded(client)
    before = await state(client)
    if body is None:
        content, headers = None, {}
    else:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"content-type": "application/json"}
    r = await client.request(method, SEL + path, content=content, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    if text in (PARSE, SHAPE) or text.startswith(SHAPE + "missing"):
        assert error.startswith(text), error
    else:
        assert error == text
    assert await state(client) == before  # nothing changed


async def test_no_worker_anywhere_answers_the_short_text(client) -> None:
    """While no worker is schedulable anywhere, the reference's 503 names no partition."""
    body = {**OK_PROMPT, "model_name": "zz"}
    for path in ("/select", "/select_and_reserve", "/potential_loads", "/overlap_scores"):
        r = await client.post(SEL + path, json=body)
        assert (r.status_code, r.json()) == (503, {"error": "no schedulable workers are available"})


async def test_a_field_given_twice_is_refused_a_nested_repeat_is_not(client) -> None:
    await seeded(client)
    headers = {"content-type": "application/json"}
    raw = b'{"block_hashes":[1],"sequence_hashes":[1],"isl_tokens":4,"isl_tokens":5}'
    r = await client.post(f"{SEL}/select", content=raw, headers=headers)
    # the reference's text: a flattened field's repeat is found at the end of the object
    assert (r.status_code, r.json()) == (
        422, {"error": SHAPE + "duplicate field `isl_tokens` at line 1 column 72"})  # fmt: skip
    raw = (
        b'{"block_hashes":[1],"sequence_hashes":[1],"isl_tokens":4,'
        b'"router_config_override":{"isl_tokens":1,"block_hashes":2}}'
    )
    r = await client.post(f"{SEL}/select", content=raw, headers=headers)
    assert r.status_code == 200, r.text
