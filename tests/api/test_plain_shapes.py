"""Every body the python client sends to a route with a plain path takes it
(``kv_slot_tracker.http.fast_bodies``), with and without its optional fields, and is answered.

The plain path counts a body's quotes against its fields' weights, which are derived from the
command structs at import: a field added to a struct is counted without an edit, and a field
the count cannot cover fails the import. The bodies here are the bytes the client's own
request builder makes (httpx), so a client that starts sending another shape is caught too.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec
import pytest
from kv_slot_tracker_client import BatchBuilder
from kv_slot_tracker_client._routes import ROUTES

from kv_slot_tracker.http import fast_bodies
from kv_slot_tracker.service import commands as c

HASHES = [11, -22, 33]
TOKENS = list(range(8))
GROUP = "g1"


def sent(call: Any) -> tuple[str, bytes]:
    """The path and body bytes the client sends for ``call``."""
    with httpx.Client(base_url="http://test") as http:
        request = http.build_request(**call.request_args())
    return request.url.path, request.content


# (name, builder of the client's call for a request id): the shapes the client sends
ADDS: dict[str, dict[str, Any]] = {
    "hashes": {"sequence_hashes": HASHES},
    "tokens": {"token_ids": TOKENS},
    "tokens_lora": {"token_ids": TOKENS, "lora_name": "adapter"},
    "prefill": {"sequence_hashes": HASHES, "new_isl_tokens": 48, "expected_prefill_ms": 12.5},
    "prefill_int_ms": {"sequence_hashes": HASHES, "new_isl_tokens": 48, "expected_prefill_ms": 7},
    "tracked": {"sequence_hashes": HASHES, "track_prefill_tokens": True},
    "untracked": {"sequence_hashes": HASHES, "track_prefill_tokens": False},
    "output": {"sequence_hashes": HASHES, "expected_output_tokens": 0},
    "everything": {
        "token_ids": TOKENS,
        "new_isl_tokens": 0,
        "expected_prefill_ms": 0.0,
        "track_prefill_tokens": False,
        "expected_output_tokens": 64,
        "lora_name": "adapter",
        "routing_group": GROUP,
    },
}
POTENTIALS: dict[str, dict[str, Any]] = {
    "hashes": {"sequence_hashes": HASHES},
    "tokens": {"token_ids": TOKENS},
    "lora": {"token_ids": TOKENS, "lora_name": "adapter"},
    "prefill": {"sequence_hashes": HASHES, "new_isl_tokens": 100},
    "group": {"sequence_hashes": HASHES, "routing_group": GROUP},
}


def group_of(options: dict[str, Any]) -> str:
    return options.get("routing_group", "default")


async def register(client: httpx.AsyncClient, group: str) -> None:
    path, body = sent(ROUTES.register(1, "m", block_size=4, dp_size=2, routing_group=group))
    r = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code in (200, 201), r.text


async def answer(client: httpx.AsyncClient, path: str, body: bytes) -> httpx.Response:
    return await client.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("shape", sorted(ADDS))
async def test_each_lifecycle_shape_of_the_client_takes_the_plain_path(
    client: httpx.AsyncClient, shape: str
) -> None:
    options = ADDS[shape]
    group = group_of(options)
    await register(client, group)
    calls = [
        ROUTES.add("m", "r1", 1, 1, **options),
        ROUTES.prefill_complete("m", "r1", routing_group=group),
        ROUTES.free("m", "r1", routing_group=group),
    ]
    for call in calls:
        path, body = sent(call)
        assert fast_bodies.path_of(path, body) == "plain", body
        r = await answer(client, path, body)
        assert r.status_code == (201 if path == "/add" else 200), (body, r.text)
    loads = (await client.get("/loads", params={"routing_group": group})).json()
    assert sum(row["active_requests"] for row in loads) == 0


@pytest.mark.parametrize("shape", sorted(POTENTIALS))
async def test_each_potential_loads_shape_of_the_client_takes_the_plain_path(
    client: httpx.AsyncClient, shape: str
) -> None:
    options = POTENTIALS[shape]
    await register(client, group_of(options))
    path, body = sent(ROUTES.potential_loads("m", **options))
    assert fast_bodies.path_of(path, body) == "plain", body
    r = await answer(client, path, body)
    assert r.status_code == 200, r.text
    assert len(r.json()) == 2  # one row per rank


async def test_a_batch_of_every_shape_the_client_builds_takes_the_plain_path(
    client: httpx.AsyncClient,
) -> None:
    await register(client, "default")
    await register(client, GROUP)
    batch = BatchBuilder()
    for i, (shape, options) in enumerate(sorted(ADDS.items())):
        rid, group = f"b{i}", group_of(options)
        batch.add("m", rid, 1, i % 2, **options)
        batch.prefill_complete("m", rid, routing_group=group)
        batch.output_block("m", rid, routing_group=group)
        batch.output_block("m", rid, 0.5, routing_group=group)
        batch.output_block("m", rid, 1, routing_group=group)
        batch.free("m", rid, routing_group=group)
        assert shape
    path, body = sent(ROUTES.batch(batch))
    assert fast_bodies.path_of(path, body) == "plain", body
    r = await answer(client, path, body)
    assert r.status_code == 200, r.text
    statuses = [row["status"] for row in r.json()["results"]]
    assert statuses == [201, 200, 200, 200, 200, 200] * len(ADDS)


def test_a_default_given_explicitly_counts_once_and_only_as_a_key() -> None:
    """A field given as its default object (0, null, false) is found by its key: given once it
    is plain, given twice or beside another key given twice it is not, in a single body and
    in one operation of a batch."""
    head = b'{"model_name":"m","request_id":"a","worker_id":1,"dp_rank":0,"sequence_hashes":[1]'
    assert fast_bodies.path_of("/add", head + b',"new_isl_tokens":0,"lora_name":null}') == "plain"
    for tail in [
        b',"new_isl_tokens":0,"new_isl_tokens":0}',
        b',"lora_name":null,"dp_rank":0}',  # null's one pair must not cover a repeated key
        b',"track_prefill_tokens":null,"request_id":"b"}',
        b',"new_isl_tokens" :0}',  # a space before the colon: the validating path
    ]:
        assert fast_bodies.path_of("/add", head + tail) == "validating", tail
    op = head.replace(b"{", b'{"op":"add",', 1)
    free = b'{"op":"free","model_name":"m","request_id":"a"}'
    good = op + b',"new_isl_tokens":0}'
    assert fast_bodies.path_of("/batch", b'{"operations":[%s,%s]}' % (good, free)) == "plain"
    twice = op + b',"new_isl_tokens":0,"new_isl_tokens":0}'
    absent = op + b"}"
    body = b'{"operations":[%s,%s]}' % (twice, absent)  # as many keys as one each
    assert fast_bodies.path_of("/batch", body) == "validating"
    braces = op.replace(b'"a"', b'"{a}"') + b',"expected_output_tokens":null}'
    assert fast_bodies.path_of("/batch", b'{"operations":[%s,%s]}' % (braces, free)) == "plain"


def test_a_prompt_form_is_counted_once_and_checked_after_the_count() -> None:
    """One prompt form's key is in the count: an operation with neither form, beside one with
    a key given twice, matches the count and is still refused, as is one with both forms."""
    key = b'"model_name":"m","request_id":"a","worker_id":1,"dp_rank":0'
    bare = b'{"op":"add",%s}' % key
    twice = b'{"op":"add",%s,"sequence_hashes":[1],"dp_rank":0}' % key
    both = b'{"op":"add",%s,"sequence_hashes":[1],"token_ids":[1]}' % key
    free = b'{"op":"free","model_name":"m","request_id":"a"}'
    for ops in ([bare, twice], [both, free], [bare, free]):
        body = b'{"operations":[%s]}' % b",".join(ops)
        assert fast_bodies.path_of("/batch", body) == "validating", body
    assert fast_bodies.path_of("/add", b"{%s}" % key) == "validating"
    assert fast_bodies.path_of("/add", b'{%s,"token_ids":[1],"sequence_hashes":[1]}' % key) == (
        "validating"
    )
    assert fast_bodies.path_of("/add", b'{%s,"token_ids":[1]}' % key) == "plain"


def test_the_weights_are_the_structs_fields() -> None:
    """The derived weights are those once written out by hand, and follow a struct's fields."""
    add = fast_bodies._ADD
    # model_name, request_id (key and string), worker_id, dp_rank, and one prompt form's key
    # (exactly one is given: ``_prompt_form`` refuses a body with neither or both)
    assert add.base == 7
    assert dict((n, w) for n, _, w in add.optional) == {
        "routing_group": 2,
        "lora_name": 2,
        "new_isl_tokens": 1,
        "expected_prefill_ms": 1,
        "track_prefill_tokens": 1,
        "expected_output_tokens": 1,
    }
    assert fast_bodies._FREE.base == 4 and fast_bodies._BATCH[c.Free].base == 6  # and "op": "free"

    class Extended(c.Add, kw_only=True):
        priority: int | None = None
        note: str = "none"

    weights = fast_bodies._Weights(Extended)
    o = Extended(model_name="m", request_id="r", worker_id=1, dp_rank=0, note="x", priority=3)
    assert weights.count(o) == 7 + 2 + 1  # the new string and number fields given
    assert weights.count(Extended(model_name="m", request_id="r", worker_id=1, dp_rank=0)) == 7
    o.lora_name, o.expected_output_tokens = "l", 5  # two of the None-default group given
    assert weights.count(o) == 7 + 2 + 1 + 2 + 1

    class Nested(c.Free, kw_only=True):
        tags: list[str] = msgspec.field(default_factory=list)

    with pytest.raises(TypeError, match="tags"):
        fast_bodies._Weights(Nested)
