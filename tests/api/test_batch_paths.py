"""``/batch``, ``/add``, ``/free``, ``/prefill_complete`` and ``/potential_loads`` have two
paths: plain bodies are decoded straight into the service's commands (msgspec, for the lifecycle
routes) or checked on orjson's decoded values (``/potential_loads``; ``kv_slot_tracker.http.fast_bodies``),
anything else goes through the pydantic models, which alone write error messages. Both must give the same answers and leave the same state, for
any body: these tests run every body through each path on its own fresh service and compare."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_slot_tracker.http import fast_bodies
from kv_slot_tracker.http import schemas as s
from kv_slot_tracker.http.body import parse_json
from kv_slot_tracker.http.errors import EXPECTED, error_result
from kv_slot_tracker.http.operations import (
    OK,
    Operations,
    add_command,
    free_command,
    prefill_command,
    prompt_command,
)
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service import commands as c
from tests.support.tracker import slots

REGISTER = [
    {"model_name": "m", "worker_id": w, "block_size": 2, "dp_start": 0, "dp_size": 2}
    for w in (1, 2)
]


def fresh() -> Operations:
    ops = Operations(SlotTrackerService(clock=lambda: 10**12), 1_000)  # a stopped clock
    for body in REGISTER:
        assert ops.register(json.dumps(body).encode())[0] == 201
    return ops


def state(ops: Operations) -> tuple[Any, Any]:
    service = ops.service
    return service.loads(None, None), service.lora_counts(("m", "default"))


def both(raw: bytes) -> tuple[tuple[int, bytes], tuple[int, bytes], Operations, Operations]:
    plain, validating = fresh(), fresh()
    try:
        got = plain.batch(raw)
    except Exception as e:  # noqa: BLE001 - an error must be the same error on both paths
        got = (type(e).__name__, str(e).encode())  # type: ignore[assignment]
    try:
        want = validating.run_batch(validating.validated_batch(raw))
    except Exception as e:  # noqa: BLE001
        want = (type(e).__name__, str(e).encode())  # type: ignore[assignment]
    return got, want, plain, validating


def assert_same(raw: bytes) -> None:
    got, want, plain, validating = both(raw)
    assert got == want, raw
    assert state(plain) == state(validating), raw


ODD_VALUES = st.sampled_from(
    [None, True, False, 0, 1, -1, 2, 1.0, 0.5, 1.5, 2**32 - 1, 2**32, 2**63 - 1, 2**63,
     -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 10**12, 10**12 + 1, "", "x", "1", [], [1],
     [1, True], [1, 1.0], [-1, 2**63 - 1], [2**32], [[1]], {}, {"a": 1}]
)  # fmt: skip
FIELDS = {
    "model_name": st.sampled_from(["m", "other"]),
    "routing_group": st.sampled_from(["default", "g"]),
    "request_id": st.sampled_from(["a", "b", "c"]),
    "worker_id": st.sampled_from([1, 2, 3]),
    "dp_rank": st.sampled_from([0, 1, 2]),
    "sequence_hashes": st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
    "token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=5),
    "new_isl_tokens": st.integers(0, 100),
    "expected_prefill_ms": st.one_of(st.integers(0, 10), st.floats(0, 10)),
    "track_prefill_tokens": st.booleans(),
    "expected_output_tokens": st.integers(0, 5),
    "lora_name": st.sampled_from(["l1", "l2"]),
    "decay_fraction": st.floats(0, 1),
    "unknown": st.integers(),
}


REQUIRED = {
    "add": ("model_name", "request_id", "worker_id", "dp_rank"),
    "free": ("model_name", "request_id"),
    "prefill_complete": ("model_name", "request_id"),
    "output_block": ("model_name", "request_id"),
}
OPTIONAL = {
    "add": ("routing_group", "new_isl_tokens", "expected_prefill_ms", "track_prefill_tokens",
            "expected_output_tokens", "lora_name"),
    "free": ("routing_group",),
    "prefill_complete": ("routing_group",),
    "output_block": ("routing_group", "decay_fraction"),
}  # fmt: skip


@st.composite
def clean_operation(draw: st.DrawFn) -> dict[str, Any]:
    """An operation of exactly its schema (a few may still fail in the service: 404, 409)."""
    name = draw(st.sampled_from(["add", "add", "free", "prefill_complete", "output_block"]))
    op: dict[str, Any] = {"op": name}
    for field in REQUIRED[name]:
        op[field] = draw(FIELDS[field])
    for field in OPTIONAL[name]:
        if draw(st.booleans()):
            op[field] = draw(FIELDS[field])
    if name == "add":
        prompt = draw(st.sampled_from(["sequence_hashes", "token_ids"]))
        op[prompt] = draw(FIELDS[prompt])
    return op


@st.composite
def dirty_operation(draw: st.DrawFn) -> dict[str, Any]:
    """Any mix of fields, missing, odd-typed or unknown ones included."""
    op: dict[str, Any] = {
        "op": draw(st.sampled_from(["add", "add", "free", "prefill_complete", "output_block", "x"]))
    }
    for name, values in FIELDS.items():
        how = draw(st.sampled_from(["valid", "valid", "valid", "absent", "absent", "odd"]))
        if how == "valid":
            op[name] = draw(values)
        elif how == "odd":
            op[name] = draw(ODD_VALUES)
    return op


def operation() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(clean_operation(), clean_operation(), clean_operation(), dirty_operation())


@settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.lists(operation(), max_size=8))
def test_any_batch_answers_the_same_on_both_paths(ops: list[dict[str, Any]]) -> None:
    assert_same(json.dumps({"operations": ops}).encode())


def test_plain_batches_take_the_plain_path_and_answer_the_same() -> None:
    raw = json.dumps(
        {
            "operations": [
                {"op": "add", "model_name": "m", "request_id": "a", "worker_id": 1,
                 "dp_rank": 1, "sequence_hashes": [1, -2, 3], "new_isl_tokens": 8,
                 "expected_prefill_ms": 2.5, "track_prefill_tokens": True, "lora_name": "l"},
                {"op": "add", "model_name": "m", "request_id": "b", "worker_id": 2,
                 "dp_rank": 0, "token_ids": [1, 2, 3, 4], "expected_output_tokens": 3},
                {"op": "add", "model_name": "m", "request_id": "a", "worker_id": 2,
                 "dp_rank": 0, "sequence_hashes": []},
                {"op": "output_block", "model_name": "m", "request_id": "b", "decay_fraction": 1},
                {"op": "prefill_complete", "model_name": "m", "request_id": "a"},
                {"op": "prefill_complete", "model_name": "m", "request_id": "zz"},
                {"op": "free", "model_name": "m", "routing_group": "default", "request_id": "a"},
                {"op": "free", "model_name": "nope", "request_id": "a"},
            ]
        }
    ).encode()  # fmt: skip
    assert fast_bodies.batch_operations(raw) is not None
    got, want, plain, validating = both(raw)
    assert got == want
    assert json.loads(got[1])["results"] == [
        {"status": 201},
        {"status": 201},
        {
            "status": 409,
            "error": "Request a already exists (assigned to worker "
            "WorkerWithDpRank { worker_id: 1, dp_rank: 1 })",
        },
        {"status": 200},
        {"status": 200},
        {"status": 404, "error": "Request zz not found"},
        {"status": 200},
        {"status": 404, "error": "no slot tracker for model=nope routing_group=default"},
    ]
    assert state(plain) == state(validating)


def test_bodies_that_are_not_plain_take_the_validating_path() -> None:
    for raw in [
        b'{"operations":[{"op":"add","model_name":"m","request_id":"a","worker_id":NaN,'
        b'"dp_rank":0,"sequence_hashes":[1]}]}',
        b'{"operations":[{"op":"add","model_name":"m","request_id":"a","worker_id":1,'
        b'"dp_rank":0,"sequence_hashes":[1],"expected_prefill_ms":Infinity}]}',
        b'{"operations":[],"extra":1}',
        b'{"operations":[{"op":"free","model_name":"m","request_id":"a","x":1}]}',
        b'{"operations":[{"op":"add","model_name":"m","request_id":"a","worker_id":1,'
        b'"dp_rank":0,"sequence_hashes":null,"token_ids":[1]}]}',
        b'{"operations":[{"op":"add","model_name":"m","request_id":"a","worker_id":1,'
        b'"dp_rank":0,"sequence_hashes":[1,true]}]}',
        b'{"operations":[{"op":"add","model_name":"m","request_id":"a","worker_id":1.0,'
        b'"dp_rank":0,"sequence_hashes":[1]}]}',
        b'{"operations":[{"op":"add","model_name":"m","request_id":"a","worker_id":1,'
        b'"dp_rank":0,"sequence_hashes":[9223372036854775808]}]}',
        b'{"operations":[]} trailing',
        b"[]",
    ]:
        assert fast_bodies.batch_operations(raw) is None, raw
        assert_same(raw)


def test_a_string_that_spells_a_literal_stays_plain() -> None:
    raw = b'{"operations":[{"op":"free","model_name":"m","request_id":"NaN"}]}'
    assert fast_bodies.batch_operations(raw) is not None
    assert_same(raw)


def test_duplicate_keys_answer_the_same() -> None:
    for raw in [
        b'{"operations":[{"op":"free","model_name":"x","model_name":"m","request_id":"a"}]}',
        b'{"operations":[{"op":"free","model_name":"m","request_id":"a"}],"operations":[]}',
        b'{"operations":[{"op":"add","model_name":"m","request_id":"a","worker_id":1,'
        b'"dp_rank":0,"sequence_hashes":[1],"sequence_hashes":[2,3]}]}',
        b'{"operations":[{"op":"add","op":"free","model_name":"m","request_id":"a"}]}',
    ]:
        assert_same(raw)


DUP = b'"Failed to deserialize the JSON body into the target type: duplicate field `%s`"'


def test_a_key_given_twice_in_an_operation_is_refused_like_a_single_call() -> None:
    """A top-level key given twice is a 422 (``duplicate field``); inside a batch operation
    the same key given twice fails that operation with the same text, on both paths, and the
    other operations still apply."""
    add = (b'{"op":"add","model_name":"m","request_id":"a","worker_id":1,"dp_rank":0,'
           b'"sequence_hashes":[1,2]}')  # fmt: skip
    for raw, field in [
        (b'{"operations":[%s,{"op":"free","model_name":"m","request_id":"a","request_id":"b"}]}'
         % add, b"request_id"),
        (b'{"operations":[%s,{"op":"free","model_name":"x","model_name":"m","request_id":"a"}]}'
         % add, b"model_name"),
        (b'{"operations":[%s,{"op":"free","routing_group":"default","model_name":"m",'
         b'"routing_group":"default","request_id":"a"}]}' % add, b"routing_group"),
        (b'{"operations":[%s,{"op":"add","model_name":"m","request_id":"b","worker_id":1,'
         b'"dp_rank":0,"sequence_hashes":[1],"sequence_hashes":[2,3]}]}' % add,
         b"sequence_hashes"),
        (b'{"operations":[%s,{"op":"free","model_name":"m","request_id":"a","op":"free"}]}'
         % add, b"op"),
    ]:  # fmt: skip
        got, want, plain, _ = both(raw)
        assert (
            got
            == want
            == (200, b'{"results":[{"status":201},{"status":422,"error":' + DUP % field + b"}]}")
        ), raw
        assert sum(r["active_requests"] for r in plain.service.loads(None, None)) == 1, raw
    # the top-level rule, for comparison
    try:
        fresh().free(b'{"model_name":"m","request_id":"a","request_id":"b"}')
    except EXPECTED as e:
        assert error_result(e) == (422, b'{"error":' + DUP % b"request_id" + b"}")
    else:
        raise AssertionError("a key given twice was taken")


SINGLE = {
    "add": (s.AddBody, add_command, "add", 201),
    "free": (s.RequestBody, free_command, "free", 200),
    "prefill_complete": (s.RequestBody, prefill_command, "prefill_complete", 200),
}


def validating_call(ops: Operations, name: str, raw: bytes) -> tuple[int, bytes]:
    model, build, method, status = SINGLE[name]
    try:
        getattr(ops.service, method)(build(parse_json(raw, model)))
    except EXPECTED as e:
        return error_result(e)
    return status, OK


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(operation(), max_size=6), st.sampled_from(["", " ", "\n", "x", ",", "}"]))
def test_any_single_call_answers_the_same_on_both_paths(
    calls: list[dict[str, Any]], tail: str
) -> None:
    plain, validating = fresh(), fresh()
    for i, body in enumerate(calls):
        name = body.pop("op")
        if name not in SINGLE:
            continue
        raw = json.dumps(body).encode() + (tail.encode() if i % 2 else b"")
        assert plain.get(name)(raw) == validating_call(validating, name, raw), raw
    assert state(plain) == state(validating)


def test_single_calls_with_duplicate_or_escaped_fields_take_the_validating_path() -> None:
    ops = fresh()
    for name, raw in [
        ("free", b'{"model_name":"m","request_id":"a","request_id":"b"}'),
        ("free", b'{"model_name":"m","request_id":"a","model_name":"m"}'),
        ("free", b'{"model_name":"m","request_\\u0069d":"a"}'),
        ("free", b'{"model_name":"m","request_id":"a\\"b"}'),
        ("add", b'{"model_name":"m","request_id":"a","worker_id":1,"dp_rank":0,'
                b'"sequence_hashes":[1],"worker_id":2}'),
        ("add", b'{"model_name":"m","request_id":"a","worker_id":1,"dp_rank":0,'
                b'"sequence_hashes":[1],"new_isl_tokens":NaN}'),
    ]:  # fmt: skip
        assert ops.get(name)(raw) == validating_call(fresh(), name, raw), raw
    dup = b'{"model_name":"m","request_id":"a","request_id":"b"}'
    assert ops.get("free")(dup) == (422, b'{"error":"Failed to deserialize the JSON body into '
                                    b'the target type: duplicate field `request_id`"}')  # fmt: skip


def validating_potential(ops: Operations, raw: bytes) -> tuple[int, bytes]:
    try:
        b = parse_json(raw, s.PotentialLoadsBody)
        cols = ops.service.potential_loads(prompt_command(c.PotentialLoads, b))
        rows = [
            (w.worker_id, w.dp_rank, p, d, r)
            for w, p, d, r in zip(cols.ranks, cols.prefill, cols.decode, cols.requests, strict=True)
        ]
    except EXPECTED as e:
        return error_result(e)
    keys = ("worker_id", "dp_rank", "potential_prefill_tokens", "potential_decode_blocks",
            "active_requests")  # fmt: skip
    return 200, json.dumps([dict(zip(keys, r, strict=True)) for r in rows]).replace(
        " ", ""
    ).encode()


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.lists(clean_operation(), max_size=4), operation(), st.booleans())
def test_any_potential_loads_answers_the_same_on_both_paths(
    setup: list[dict[str, Any]], query: dict[str, Any], odd_key: bool
) -> None:
    ops = fresh()
    assert ops.batch(json.dumps({"operations": setup}).encode())[0] == 200
    query.pop("op")
    keep = {"model_name", "routing_group", "sequence_hashes", "token_ids", "lora_name",
            "new_isl_tokens"} | ({"worker_id"} if odd_key else set())  # fmt: skip
    raw = json.dumps({k: v for k, v in query.items() if k in keep}).encode()
    assert ops.get("potential_loads")(raw) == validating_potential(ops, raw), raw


def test_a_key_given_twice_is_found_however_it_is_written() -> None:
    """Quotes are counted against the decoded body (``fast_bodies.add_body``, ``free_body``): a
    repeated key leaves the plain path whatever its value and spacing, and strings that hold
    colons, brackets or braces do not."""
    ops = fresh()
    start = b'{"model_name":"m","request_id":"a"'
    for tail in [
        b',"request_id":"b"}',
        b',"request_id" :"b"}',  # a space before the colon
        b',\n"request_id"\t:\r"b"}',
        b',"model_name":7}',  # a value of another type
        b',"model_name":["x"]}',
        b',"request_id":null}',
        b',"routing_group":"g","routing_group":"g"}',
    ]:
        raw = start + tail
        assert fast_bodies.free_body(raw) is None, raw
        assert ops.get("free")(raw) == validating_call(fresh(), "free", raw), raw
    for raw in [
        b'{"model_name":":m","request_id":"a:"}',
        b'{"model_name" : "m" , "request_id" : ":"}',
        b'{"model_name":"{a:1}","request_id":"]["}',
        b'{"request_id":"x","routing_group":"g:","model_name":"true, false"}',
    ]:
        assert fast_bodies.free_body(raw) is not None, raw
        assert ops.get("free")(raw) == validating_call(fresh(), "free", raw), raw
    add = (b'{"model_name":"m","request_id":"a","worker_id":1,"dp_rank":0,'
           b'"sequence_hashes":[1,2],"lora_name":"x","sequence_hashes":[3]}')  # fmt: skip
    assert fast_bodies.add_body(add) is None
    assert ops.get("add")(add) == validating_call(fresh(), "add", add)


def test_booleans_and_keys_given_twice_leave_the_plain_path_however_long_the_prompt() -> None:
    """A boolean among a long prompt's numbers, or a key given twice after them, leaves the
    plain path (``fast_bodies.add_body``, ``potential_loads_body``); a boolean where one belongs does
    not. Either way both paths answer the same."""
    add = b'{"model_name":"m","request_id":"a","worker_id":1,"dp_rank":0,"sequence_hashes":%s%s}'
    many = b",".join(b"%d" % (10**17 + i) for i in range(64))
    cases = {  # body: whether it is plain
        add % (b"[%s]" % many, b""): True,
        add % (b"[%s,true,3]" % many, b""): False,
        add % (b"[1, false,%s]" % many, b""): False,
        add % (b"[%s]" % many, b',"track_prefill_tokens":true'): True,
        add % (b"[%s]" % many, b',"track_prefill_tokens":false,"lora_name":"[x]"'): True,
        add % (b"[%s]" % many, b',"request_id":"b"'): False,  # a key given twice
        add % (b"[1,2]", b',"request_id":"b"'): False,
        add % (b"[1,true]", b""): False,
        add % (b"[%s]" % many, b',"lora_name":"t\\"f"'): False,  # an escape
        add % (b"[%s]" % many, b',"routing_group":"default"'): True,  # a new string
        add % (b"[%s]" % many, b',"new_isl_tokens":0'): True,  # its default, given
        add % (b"[%s]" % many, b',"new_isl_tokens":0,"new_isl_tokens":0'): False,
        add % (b"[%s]" % many, b',"lora_name":null,"dp_rank":0'): False,
    }
    for raw, plain in cases.items():
        assert (fast_bodies.add_body(raw) is not None) is plain, raw
        assert fresh().get("add")(raw) == validating_call(fresh(), "add", raw), raw
    for raw in [
        b'{"model_name":"m","sequence_hashes":[1,true]}',
        b'{"model_name":"m","sequence_hashes":[%s],"model_name":"n"}' % many,
    ]:
        assert fast_bodies.potential_loads_body(raw) is None, raw
        assert fresh().get("potential_loads")(raw) == validating_potential(fresh(), raw)
        assert fresh().get("potential_loads")(raw)[0] == 422
    raw = b'{"model_name":"m","sequence_hashes":[%s],"new_isl_tokens":3}' % many
    assert fast_bodies.potential_loads_body(raw) is not None


def test_negative_hashes_are_kept_as_given_on_both_paths() -> None:
    """Every path hands the hashes through as given (``kv_slot_tracker.core.hashing``: signed
    inside the service), whether the body has a ``-`` in a hash, elsewhere, or none; a query
    with the same hashes overlaps the whole prompt."""
    for negative, rid in ((False, "a"), (False, "a-1"), (True, "a"), (True, "a-1")):
        hashes = [-1, 5] if negative else [7, 5]
        add = {"model_name": "m", "request_id": rid, "worker_id": 1, "dp_rank": 0,
               "sequence_hashes": hashes}  # fmt: skip
        single, batched, validated = fresh(), fresh(), fresh()
        assert single.get("add")(json.dumps(add).encode())[0] == 201
        batch = {"operations": [{"op": "add", **add}]}
        assert batched.batch(json.dumps(batch).encode())[1] == b'{"results":[{"status":201}]}'
        spaced = json.dumps(add, indent=1).encode().replace(b"{", b'{"lora_name" :null,', 1)
        assert fast_bodies.add_body(spaced) is None  # the validating path
        assert validated.get("add")(spaced)[0] == 201
        for ops in (single, batched, validated):
            t = ops.service.registry.get(("m", "default"))
            assert slots(t)[t.worker_for(rid)].requests[rid].prompt_blocks == hashes
            query = json.dumps({"model_name": "m", "sequence_hashes": hashes}).encode()
            assert t.overlaps(hashes) == {t.worker_for(rid): 2}
            assert ops.get("potential_loads")(query)[0] == 200
