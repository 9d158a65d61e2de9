"""Bad input: every malformed or out-of-range request gets a clear 4xx ``{"error": ...}`` JSON
answer and changes nothing.

Each test starts from the same state (two workers, one active request with prefill tokens),
sends bad requests, and compares ``/workers`` and ``/loads`` before and after.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.api.conftest import PostJson, post_json

JSON_PARSE = "Failed to parse the request body as JSON: "
JSON_SHAPE = "Failed to deserialize the JSON body into the target type: "
CONTENT_TYPE = "Expected request with `Content-Type: application/json`"
TOO_LARGE = "Failed to buffer the request body: length limit exceeded"
BODY_LIMIT = 2_097_152
MAX_HASHES = 8

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1

OK = {"status": "ok"}


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"max_hashes_per_request": MAX_HASHES}


# -- the starting state ------------------------------------------------------------------------

REGISTER = {"worker_id": 1, "model_name": "m", "block_size": 4, "dp_start": 0, "dp_size": 2}
REGISTER_OTHER = {"worker_id": 2, "model_name": "m", "block_size": 4, "dp_start": 0, "dp_size": 1}
ADD_R1 = {
    "model_name": "m",
    "request_id": "r1",
    "worker_id": 1,
    "dp_rank": 0,
    "sequence_hashes": [1, 2, 3],
    "new_isl_tokens": 12,
}

# A valid body per route; every bad body below is one of these with one thing wrong. Each valid
# body would change the state (or, for /potential_loads, answer 200).
VALID: dict[str, dict[str, Any]] = {
    "/register": {"worker_id": 5, "model_name": "m", "block_size": 4, "dp_start": 0, "dp_size": 1},
    "/unregister": {"worker_id": 2, "model_name": "m"},
    "/add": {
        "model_name": "m",
        "request_id": "r2",
        "worker_id": 1,
        "dp_rank": 1,
        "sequence_hashes": [4, 5],
        "new_isl_tokens": 3,
    },
    "/prefill_complete": {"model_name": "m", "request_id": "r1"},
    "/free": {"model_name": "m", "request_id": "r1"},
    "/potential_loads": {"model_name": "m", "sequence_hashes": [1, 2], "new_isl_tokens": 1},
}
SUCCESS = {
    "/register": 201,
    "/unregister": 200,
    "/add": 201,
    "/prefill_complete": 200,
    "/free": 200,
    "/potential_loads": 200,
}
U64_FIELDS = {"/register": ["worker_id"], "/unregister": ["worker_id"], "/add": ["worker_id"]}
U32_FIELDS = {"/register": ["block_size", "dp_start", "dp_size"], "/add": ["dp_rank"]}
USIZE_FIELDS = {"/add": ["new_isl_tokens"], "/potential_loads": ["new_isl_tokens"]}
STR_FIELDS = {
    "/register": ["model_name", "routing_group"],
    "/unregister": ["model_name", "routing_group"],
    "/add": ["model_name", "routing_group", "request_id"],
    "/prefill_complete": ["model_name", "routing_group", "request_id"],
    "/free": ["model_name", "routing_group", "request_id"],
    "/potential_loads": ["model_name", "routing_group"],
}
HASH_FIELDS = {"/add": ["sequence_hashes"], "/potential_loads": ["sequence_hashes"]}
REQUIRED = {
    "/register": ["worker_id", "model_name", "block_size", "dp_start", "dp_size"],
    "/unregister": ["worker_id", "model_name"],
    "/add": ["model_name", "request_id", "worker_id", "dp_rank", "sequence_hashes"],
    "/prefill_complete": ["model_name", "request_id"],
    "/free": ["model_name", "request_id"],
    "/potential_loads": ["model_name", "sequence_hashes"],
}

NOT_AN_INT = [None, "1", "0x1", 1.5, 1.0, 0.0, -0.5, 1e3, True, False, [1], {"v": 1}, ""]
NOT_A_STR = [None, 5, 0, 1.5, True, False, ["m"], {"m": 1}]
NOT_HASHES = [
    None,
    1,
    "1,2",
    "[1,2]",
    {"0": 1},
    True,
    [1.5],
    [1.0],
    ["1"],
    [None],
    [True],
    [[1]],
    [{"h": 1}],
    [1, 2, "3"],
    [I64_MAX + 1],
    [I64_MIN - 1],
    [U64_MAX],
    [2**64],
    [10**30],
    [-(10**30)],
]


def _cases() -> list[tuple[str, str, Any]]:
    """(route, description, bad body) for every field of every route."""
    cases: list[tuple[str, str, Any]] = []

    def with_field(route: str, field: str, value: Any) -> dict[str, Any]:
        return {**VALID[route], field: value}

    for route, fields in U64_FIELDS.items():
        for f in fields:
            for v in [*NOT_AN_INT, -1, I64_MIN, U64_MAX + 1, 2**65, 10**30]:
                cases.append((route, f"{f}={v!r}", with_field(route, f, v)))
    for route, fields in U32_FIELDS.items():
        for f in fields:
            for v in [*NOT_AN_INT, -1, U32_MAX + 1, U64_MAX, 10**30]:
                cases.append((route, f"{f}={v!r}", with_field(route, f, v)))
    for route, fields in USIZE_FIELDS.items():
        for f in fields:
            for v in [*NOT_AN_INT, -1, U64_MAX + 1, 10**30]:
                cases.append((route, f"{f}={v!r}", with_field(route, f, v)))
    for route, fields in STR_FIELDS.items():
        for f in fields:
            for v in NOT_A_STR:
                cases.append((route, f"{f}={v!r}", with_field(route, f, v)))
    for route, fields in HASH_FIELDS.items():
        for f in fields:
            for v in NOT_HASHES:
                cases.append((route, f"{f}={v!r}", with_field(route, f, v)))
    for route, fields in REQUIRED.items():
        for f in fields:
            body = {k: v for k, v in VALID[route].items() if k != f}
            cases.append((route, f"missing {f}", body))
    for route in VALID:
        for whole in [[], list(VALID[route].values()), None, 5, "m", True, [VALID[route]]]:
            cases.append((route, f"body={json.dumps(whole)[:30]}", whole))
    return cases


CASES = _cases()


async def state(client: httpx.AsyncClient) -> tuple[Any, Any]:
    """Everything observable: the topology and every rank's load."""
    workers = await client.get("/workers")
    loads = await client.get("/loads")
    assert workers.status_code == loads.status_code == 200
    return workers.json(), loads.json()


@pytest.fixture
async def seeded(client: httpx.AsyncClient) -> AsyncIterator[tuple[Any, Any]]:
    """The starting state; yields it and checks at the end of the test that it is unchanged."""
    for path, body, status in [
        ("/register", REGISTER, 201),
        ("/register", REGISTER_OTHER, 201),
        ("/add", ADD_R1, 201),
    ]:
        resp = await post_json(client, path, body)
        assert resp.status_code == status, resp.text
    before = await state(client)
    assert before[1][0]["active_prefill_tokens"] == 12
    yield before
    assert await state(client) == before


def problem(resp: httpx.Response, status: int, prefix: str = "") -> str | None:
    """What is wrong with ``resp`` as a ``rejected(resp, status, prefix)`` answer, or None."""
    try:
        rejected(resp, status, prefix)
    except AssertionError:
        return f"{resp.status_code} {resp.headers.get('content-type')} {resp.text[:200]}"
    return None


def rejected(resp: httpx.Response, status: int, prefix: str = "") -> str:
    """A 4xx answer with exactly ``{"error": "<non-empty message>"}`` as JSON."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert list(body) == ["error"] and isinstance(body["error"], str), body
    assert body["error"] and body["error"].startswith(prefix), body
    return body["error"]


async def post_raw(
    client: httpx.AsyncClient, path: str, content: bytes, content_type: str | None
) -> httpx.Response:
    headers = {"content-type": content_type} if content_type is not None else {}
    return await client.post(path, content=content, headers=headers)


# -- the valid bodies really are valid ---------------------------------------------------------


@pytest.mark.parametrize("route", list(VALID))
async def test_valid_bodies_succeed(
    client: httpx.AsyncClient, post: PostJson, seeded: Any, route: str
) -> None:
    """The baseline of every bad-body case: the unmodified body succeeds (then is undone)."""
    resp = await post(route, VALID[route])
    assert resp.status_code == SUCCESS[route], resp.text
    undo = {
        "/register": ("/unregister", {"worker_id": 5, "model_name": "m"}),
        "/unregister": ("/register", REGISTER_OTHER),
        "/add": ("/free", {"model_name": "m", "request_id": "r2"}),
        "/prefill_complete": None,
        "/free": ("/add", ADD_R1),
        "/potential_loads": None,
    }[route]
    if route == "/prefill_complete":
        # completing is not undoable: start over with r1 freed and re-added
        assert (await post("/free", VALID["/free"])).status_code == 200
        undo = ("/add", ADD_R1)
    if undo is not None:
        assert (await post(*undo)).status_code in (200, 201)


# -- wrong shapes: 422 -------------------------------------------------------------------------


@pytest.mark.parametrize("route", list(VALID))
async def test_wrong_shape_is_422_and_changes_nothing(
    post: PostJson, seeded: Any, route: str
) -> None:
    """Wrong types, nulls, out-of-range and negative unsigned integers, floats, booleans and
    strings for integers, arrays or scalars instead of the object, missing fields."""
    cases = [(what, body) for r, what, body in CASES if r == route]
    assert len(cases) > 20
    failures = {}
    for what, body in cases:
        wrong = problem(await post(route, body), 422, JSON_SHAPE)
        if wrong:
            failures[what] = wrong
    assert failures == {}


async def test_null_for_a_defaulted_field_is_422(post: PostJson, seeded: Any) -> None:
    for route in VALID:
        msg = rejected(await post(route, {**VALID[route], "routing_group": None}), 422, JSON_SHAPE)
        assert "routing_group" in msg
    for route in ["/add", "/potential_loads"]:
        msg = rejected(await post(route, {**VALID[route], "new_isl_tokens": None}), 422, JSON_SHAPE)
        assert "new_isl_tokens" in msg


async def test_missing_field_names_the_field(post: PostJson, seeded: Any) -> None:
    for route, fields in REQUIRED.items():
        for f in fields:
            body = {k: v for k, v in VALID[route].items() if k != f}
            resp = await post(route, body)
            assert rejected(resp, 422, JSON_SHAPE) == f"{JSON_SHAPE}missing field `{f}`"


# -- integer bounds, exactly at and beyond -----------------------------------------------------


async def test_u64_worker_id_bounds(client: httpx.AsyncClient, post: PostJson) -> None:
    body = {**VALID["/register"], "worker_id": U64_MAX}
    assert (await post("/register", body)).status_code == 201
    before = await state(client)
    rejected(await post("/register", {**body, "worker_id": U64_MAX + 1}), 422, JSON_SHAPE)
    rejected(await post("/register", {**body, "worker_id": -1}), 422, JSON_SHAPE)
    rejected(
        await post("/unregister", {"worker_id": U64_MAX + 1, "model_name": "m"}), 422, JSON_SHAPE
    )
    assert await state(client) == before
    assert before[0] == [{**body, "routing_group": "default"}]
    add = {**VALID["/add"], "worker_id": U64_MAX, "dp_rank": 0}
    assert (await post("/add", add)).status_code == 201
    assert (await post("/unregister", {"worker_id": U64_MAX, "model_name": "m"})).status_code == 200
    assert await state(client) == ([], [])


async def test_u32_bounds(client: httpx.AsyncClient, post: PostJson) -> None:
    # block_size at u32::MAX is legal; dp_start + dp_size may reach u32::MAX but not pass it
    body = {**VALID["/register"], "block_size": U32_MAX, "dp_start": U32_MAX - 1, "dp_size": 1}
    assert (await post("/register", body)).status_code == 201
    before = await state(client)
    for field in ["block_size", "dp_start", "dp_size"]:
        rejected(await post("/register", {**body, field: U32_MAX + 1}), 422, JSON_SHAPE)
    resp = await post("/register", {**body, "worker_id": 6, "dp_start": U32_MAX})
    assert rejected(resp, 400) == f"dp range overflows u32: start={U32_MAX} size=1"
    add = {**VALID["/add"], "worker_id": 5}
    resp = await post("/add", {**add, "dp_rank": U32_MAX})
    assert rejected(resp, 404) == (
        f"Worker WorkerWithDpRank {{ worker_id: 5, dp_rank: {U32_MAX} }} not found"
    )
    rejected(await post("/add", {**add, "dp_rank": U32_MAX + 1}), 422, JSON_SHAPE)
    assert await state(client) == before
    assert (await post("/add", {**add, "dp_rank": U32_MAX - 1})).status_code == 201


async def test_i64_hash_bounds(client: httpx.AsyncClient, post: PostJson, seeded: Any) -> None:
    for hashes in [[I64_MAX + 1], [I64_MIN - 1], [1, 2, I64_MAX + 1], [U64_MAX]]:
        msg = rejected(
            await post("/add", {**VALID["/add"], "sequence_hashes": hashes}), 422, JSON_SHAPE
        )
        assert "sequence_hashes" in msg
    body = {**VALID["/add"], "sequence_hashes": [I64_MIN, I64_MAX, -1, 0]}
    assert (await post("/add", body)).status_code == 201
    rows = (await client.get("/loads?model_name=m")).json()
    assert [r["active_decode_blocks"] for r in rows] == [3, 4, 0]
    resp = await post(
        "/potential_loads", {"model_name": "m", "sequence_hashes": [I64_MIN, I64_MAX]}
    )
    blocks = {(r["worker_id"], r["dp_rank"]): r["potential_decode_blocks"] for r in resp.json()}
    assert blocks == {(1, 0): 5, (1, 1): 4, (2, 0): 2}
    assert (await post("/free", {"model_name": "m", "request_id": "r2"})).status_code == 200


async def test_usize_new_isl_tokens_bounds(post: PostJson, seeded: Any) -> None:
    for route in ["/add", "/potential_loads"]:
        for value in [U64_MAX + 1, -1]:
            resp = await post(route, {**VALID[route], "new_isl_tokens": value})
            assert "new_isl_tokens" in rejected(resp, 422, JSON_SHAPE)


# -- prefill token sum overflow (deliberate difference: the reference wraps and panics) ---------


async def test_prefill_token_sum_overflow_is_422_and_changes_nothing(
    client: httpx.AsyncClient, post: PostJson
) -> None:
    assert (await post("/register", REGISTER)).status_code == 201
    big = {**VALID["/add"], "request_id": "big", "dp_rank": 0, "new_isl_tokens": U64_MAX}
    assert (await post("/add", big)).status_code == 201
    before = await state(client)
    assert before[1][0]["active_prefill_tokens"] == U64_MAX

    one = {**big, "request_id": "one", "new_isl_tokens": 1, "sequence_hashes": [9]}
    rejected(await post("/add", one), 422)
    rejected(await post("/add", one), 422)  # not applied: not a 409 either
    assert await state(client) == before
    assert (await client.get("/health")).status_code == 200

    # the same request fits on another rank, and without prefill tokens on this one
    assert (await post("/add", {**one, "dp_rank": 1})).status_code == 201
    assert (await post("/free", {"model_name": "m", "request_id": "one"})).status_code == 200
    zero = {**one, "new_isl_tokens": 0}
    assert (await post("/add", zero)).status_code == 201
    assert (await post("/free", {"model_name": "m", "request_id": "one"})).status_code == 200
    assert await state(client) == before

    # a potential load saturates instead of wrapping
    resp = await post(
        "/potential_loads", {"model_name": "m", "sequence_hashes": [], "new_isl_tokens": 1}
    )
    assert resp.status_code == 200
    tokens = {r["dp_rank"]: r["potential_prefill_tokens"] for r in resp.json()}
    assert tokens == {0: U64_MAX, 1: 1}

    # the big request can still be freed; the rank is usable again
    assert (await post("/free", {"model_name": "m", "request_id": "big"})).status_code == 200
    assert (await post("/add", one)).status_code == 201
    loads = (await client.get("/loads")).json()
    assert [r["active_prefill_tokens"] for r in loads] == [1, 0]


# -- too many hashes ---------------------------------------------------------------------------


async def test_more_hashes_than_the_limit_is_422(
    client: httpx.AsyncClient, post: PostJson, seeded: Any
) -> None:
    too_many = list(range(1, MAX_HASHES + 2))
    for route in ["/add", "/potential_loads"]:
        resp = await post(route, {**VALID[route], "sequence_hashes": too_many})
        assert rejected(resp, 422) == (
            f"too many block hashes: {MAX_HASHES + 1} > max_hashes_per_request ({MAX_HASHES})"
        )
    huge = list(range(100_000))
    rejected(await post("/add", {**VALID["/add"], "sequence_hashes": huge}), 422)


async def test_exactly_the_hash_limit_is_accepted(
    client: httpx.AsyncClient, post: PostJson
) -> None:
    assert (await post("/register", REGISTER)).status_code == 201
    hashes = list(range(1, MAX_HASHES + 1))
    resp = await post("/potential_loads", {"model_name": "m", "sequence_hashes": hashes})
    assert resp.status_code == 200
    assert (await post("/add", {**VALID["/add"], "sequence_hashes": hashes})).status_code == 201
    assert (await client.get("/loads")).json()[1]["active_decode_blocks"] == MAX_HASHES


# -- size limits -------------------------------------------------------------------------------


async def test_body_over_the_limit_is_413(client: httpx.AsyncClient, seeded: Any) -> None:
    huge_id = "x" * (BODY_LIMIT + 1)
    for route in VALID:
        body = json.dumps({**VALID[route], "request_id": huge_id, "model_name": "m"}).encode()
        resp = await post_raw(client, route, body, "application/json")
        assert rejected(resp, 413) == TOO_LARGE
    hashes = json.dumps({**VALID["/add"], "sequence_hashes": [I64_MAX] * 120_000}).encode()
    assert len(hashes) > BODY_LIMIT
    assert rejected(await post_raw(client, "/add", hashes, "application/json"), 413) == TOO_LARGE


async def test_chunked_body_over_the_limit_is_413(client: httpx.AsyncClient, seeded: Any) -> None:
    """No content-length: the limit is enforced while reading."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model_name":"m","request_id":"r9","worker_id":1,"dp_rank":1,'
        for _ in range(40):
            yield b" " * 65_536
        yield b'"sequence_hashes":[]}'

    resp = await client.post("/add", content=chunks(), headers={"content-type": "application/json"})
    assert rejected(resp, 413) == TOO_LARGE


async def test_chunked_body_within_the_limit_is_read(client: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"worker_id":1,"model_name":"m",'
        yield b" " * 1000
        yield b'"block_size":4,"dp_start":0,"dp_size":1}'

    resp = await client.post(
        "/register", content=chunks(), headers={"content-type": "application/json"}
    )
    assert (resp.status_code, resp.json()) == (201, {"status": "ok"})
    workers, loads = await state(client)  # registered as the body said, all of it read
    assert [(w["worker_id"], w["model_name"], w["block_size"]) for w in workers] == [(1, "m", 4)]
    assert [(row["worker_id"], row["dp_rank"]) for row in loads] == [(1, 0)]


async def test_a_declared_length_over_the_limit_is_413_before_reading(
    client: httpx.AsyncClient, seeded: Any
) -> None:
    resp = await client.post(
        "/free",
        content=json.dumps(VALID["/free"]).encode(),
        headers={"content-type": "application/json", "content-length": str(BODY_LIMIT + 1)},
    )
    assert rejected(resp, 413) == TOO_LARGE


async def test_huge_strings_within_the_body_limit_are_422_not_lookups(
    client: httpx.AsyncClient, post: PostJson, seeded: Any
) -> None:
    """A name or id longer than its limit (``kv_slot_tracker.core.limits``) is refused before any lookup."""
    name = "n" * (BODY_LIMIT - 200)
    resp = await post("/free", {"model_name": name, "request_id": "r1"})
    assert (
        rejected(resp, 422) == JSON_SHAPE + "model_name: String should have at most 1024 characters"
    )
    resp = await post("/prefill_complete", {"model_name": "m", "request_id": name})
    assert (
        rejected(resp, 422) == JSON_SHAPE + "request_id: String should have at most 1024 characters"
    )


# -- malformed JSON: 400 -----------------------------------------------------------------------

MALFORMED = [
    b"",
    b" ",
    b"\n\t ",
    b"{",
    b"}",
    b"[",
    b'{"model_name":"m"',
    b'{"model_name":"m",}',
    b'{"model_name":"m" "request_id":"r1"}',
    b"{model_name: 'm'}",
    b"{'model_name': 'm'}",
    b'{"model_name":"m","request_id":"r1","worker_id":01}',
    b'{"model_name":"m","request_id":"r1\n"}',
    b'{"model_name":"m","request_id":"\\x41"}',
    b'{"model_name":"m","request_id":"\\ud800"}',
    b'{"model_name":"m","request_id":"\xff\xfe"}',
    b'\xef\xbb\xbf{"model_name":"m","request_id":"r1"}',
    b"\x00",
    b"nul",
    b"tru",
    b"undefined",
    b"-",
    b'"unterminated',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 20_000 + b"1" + b"}" * 20_000,
    b'{"model_name":"m","request_id":"r1","extra":' + b"[" * 5_000 + b"]" * 5_000 + b"}",
]


async def test_bytes_after_a_complete_json_value_are_ignored_like_the_reference(
    client: httpx.AsyncClient,
) -> None:
    """The reference decodes the first JSON value and ignores what follows it."""
    reg = b'{"worker_id":1,"model_name":"tr","block_size":4,"dp_start":0,"dp_size":1}'
    for tail in (b" trailing", b"{}", b"]", b","):
        resp = await post_raw(client, "/unregister", reg + tail, "application/json")
        assert resp.status_code == 404, (tail, resp.text)
    resp = await post_raw(client, "/register", reg + b" x", "application/json")
    assert (resp.status_code, resp.json()) == (201, {"status": "ok"})
    resp = await post_raw(
        client, "/register", b'{"model_name":"tr","worker_id":2} x', "application/json"
    )
    assert resp.status_code == 422
    assert resp.json()["error"].endswith("missing field `block_size`")


@pytest.mark.parametrize("route", list(VALID))
async def test_malformed_json_is_400_and_changes_nothing(
    client: httpx.AsyncClient, seeded: Any, route: str
) -> None:
    """Syntax errors, empty bodies, bad encodings and deep nesting."""
    failures = {}
    for content in MALFORMED:
        resp = await post_raw(client, route, content, "application/json")
        wrong = problem(resp, 400, JSON_PARSE)
        if wrong:
            failures[repr(content[:40])] = wrong
    assert failures == {}


async def test_non_finite_numbers_are_rejected(client: httpx.AsyncClient, seeded: Any) -> None:
    """``NaN`` and ``Infinity`` are not JSON; in an integer field they are never accepted."""
    failures = {}
    for literal in [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400"]:
        for field in [b"worker_id", b"dp_rank", b"new_isl_tokens"]:
            body = (
                b'{"model_name":"m","request_id":"r2","worker_id":1,"dp_rank":1,'
                b'"sequence_hashes":[],"' + field + b'":' + literal + b"}"
            )
            resp = await post_raw(client, "/add", body, "application/json")
            wrong = problem(resp, 400) and problem(resp, 422)
            if wrong:
                failures[(literal, field)] = wrong
        body = b'{"model_name":"m","sequence_hashes":[' + literal + b"]}"
        resp = await post_raw(client, "/potential_loads", body, "application/json")
        wrong = problem(resp, 400) and problem(resp, 422)
        if wrong:
            failures[(literal, b"sequence_hashes")] = wrong
    assert failures == {}


# -- content types -----------------------------------------------------------------------------


NOT_JSON_TYPES = [
    None,
    "",
    "text/plain",
    "text/json",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/jsonx",
    "application/json-patch",
    "application/xml",
    "application/vnd.x+xml",
    "json",
    "application/json, text/plain",
]


@pytest.mark.parametrize("route", list(VALID))
async def test_non_json_content_type_is_415_and_changes_nothing(
    client: httpx.AsyncClient, seeded: Any, route: str
) -> None:
    body = json.dumps(VALID[route]).encode()
    failures = {}
    for content_type in NOT_JSON_TYPES:
        resp = await post_raw(client, route, body, content_type)
        wrong = problem(resp, 415)
        if wrong or resp.json()["error"] != CONTENT_TYPE:
            failures[content_type] = wrong or resp.text
    assert failures == {}


async def test_content_type_is_checked_before_the_body(
    client: httpx.AsyncClient, seeded: Any
) -> None:
    for content in [b"", b"{", b"x" * (BODY_LIMIT + 1)]:
        resp = await post_raw(client, "/free", content, "text/plain")
        assert rejected(resp, 415) == CONTENT_TYPE


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "application/json; charset=utf-8",
        "application/json;charset=UTF-8",
        "Application/JSON",
        "application/vnd.x+json",
        "application/problem+json",
        "application/vnd.api+json; charset=utf-8",
    ],
)
async def test_json_content_types_are_accepted(
    client: httpx.AsyncClient, content_type: str
) -> None:
    body = json.dumps(REGISTER).encode()
    resp = await post_raw(client, "/register", body, content_type)
    assert (resp.status_code, resp.json()) == (201, OK)
    workers = (await client.get("/workers")).json()
    assert workers == [{**REGISTER, "routing_group": "default"}]


# -- errors of the service itself change nothing -----------------------------------------------


async def test_rejected_lifecycle_calls_change_nothing(post: PostJson, seeded: Any) -> None:
    checks: list[tuple[str, dict[str, Any], int]] = [
        ("/register", {**VALID["/register"], "block_size": 0}, 400),
        ("/register", {**VALID["/register"], "dp_size": 0}, 400),
        ("/register", {**VALID["/register"], "dp_start": U32_MAX}, 400),
        ("/register", {**VALID["/register"], "block_size": 8}, 409),
        ("/register", REGISTER, 409),
        ("/unregister", {"worker_id": 9, "model_name": "m"}, 404),
        ("/unregister", {"worker_id": 1, "model_name": "m", "routing_group": "g"}, 404),
        ("/add", {**VALID["/add"], "model_name": "x"}, 404),
        ("/add", {**VALID["/add"], "dp_rank": 2}, 404),
        ("/add", {**VALID["/add"], "worker_id": 3}, 404),
        ("/add", {**VALID["/add"], "request_id": "r1"}, 409),
        ("/prefill_complete", {"model_name": "m", "request_id": "nope"}, 404),
        ("/prefill_complete", {"model_name": "x", "request_id": "r1"}, 404),
        ("/free", {"model_name": "m", "routing_group": "g", "request_id": "r1"}, 404),
        ("/potential_loads", {"model_name": "x", "sequence_hashes": []}, 404),
    ]
    for route, body, status in checks:
        rejected(await post(route, body), status)


async def test_wrong_routes_and_methods_change_nothing(
    client: httpx.AsyncClient, seeded: Any
) -> None:
    body = json.dumps(VALID["/free"]).encode()
    headers = {"content-type": "application/json"}
    for method, path, status in [
        ("GET", "/free", 405),
        ("PUT", "/free", 405),
        ("DELETE", "/free", 405),
        ("PATCH", "/add", 405),
        ("POST", "/free/", 404),
        ("POST", "/FREE", 404),
        ("POST", "//free", 404),
    ]:
        resp = await client.request(method, path, content=body, headers=headers)
        rejected(resp, status)


async def test_bad_query_strings(client: httpx.AsyncClient, seeded: Any) -> None:
    for path in ["/workers", "/loads"]:
        for query in [
            "model_name=m&model_name=m",
            "routing_group=default&routing_group=x",
            "model_name=m&routing_group=a&model_name=n",
        ]:
            resp = await client.get(f"{path}?{query}")
            assert rejected(resp, 400).startswith(
                "Failed to deserialize query string: duplicate field `"
            )
        # unknown keys and odd encodings are just filters that match or not
        assert (await client.get(f"{path}?model_name=%6D")).json() != []
        assert (await client.get(f"{path}?model_name=%FF")).json() == []
        assert (await client.get(f"{path}?x=1&x=2")).status_code == 200


async def test_head_on_get_routes(client: httpx.AsyncClient, seeded: Any) -> None:
    """HEAD behaves like GET without a body; on POST routes it is a 405 and changes nothing."""
    for path in ["/health", "/workers", "/loads", "/loads?model_name=m"]:
        get = await client.get(path)
        head = await client.head(path)
        assert (head.status_code, head.content) == (get.status_code, b"")
        assert head.headers.get("content-type") == get.headers.get("content-type")
        assert head.headers.get("content-length") == get.headers.get("content-length")
    for path in VALID:
        head = await client.head(path)
        assert (head.status_code, head.content) == (405, b"")
    head = await client.head("/workers?model_name=a&model_name=b")
    assert (head.status_code, head.content) == (400, b"")


# -- answers of the framework: 405 and 500 ---------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PUT", "/selection/workers", "GET, HEAD, POST"),
        ("PUT", "/selection/workers/1", "DELETE, PATCH"),
        ("POST", "/loads", "GET, HEAD"),
        ("GET", "/add", "POST"),
    ],
)
async def test_a_405_allows_every_method_of_the_path(
    client: httpx.AsyncClient, method: str, path: str, allow: str
) -> None:
    r = await client.request(method, path)
    assert (r.status_code, r.json(), r.headers["allow"]) == (
        405,
        {"error": "method not allowed"},
        allow,
    )


async def test_an_unexpected_error_is_a_json_500(app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(app.state.service, "workers", broken)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.get("/workers")  # the FastAPI path
        assert (r.status_code, r.json()) == (500, {"error": "internal error"})
        assert r.headers["content-type"] == "application/json"
