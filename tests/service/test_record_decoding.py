"""Every bound a record declares, tested at its edge: the value at the bound decodes, the value
one past it is rejected with the reason of the part at fault, counted once, and changes nothing.
The same for records of either stream format (``kv_slot_tracker.service.records``), whose parts
are the same structs.

A u64 has no value past its upper bound on the wire (msgpack stops at 2^64 - 1:
``test_record_rejections.test_a_u64_past_its_bound_cannot_be_carried``); its lower bound is
tested instead, and its upper bound accepted.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import msgpack
import pytest

from kv_slot_tracker.core.bounds import U32_MAX, U64_MAX
from kv_slot_tracker.core.limits import MAX_ID_LENGTH, MAX_NAME_LENGTH, MAX_TEXT_LENGTH
from kv_slot_tracker.core.selection import RouterConfig
from kv_slot_tracker.replication.records import Delivered
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service import records as r
from kv_slot_tracker.service.record_check import RejectedRecord
from kv_slot_tracker.service.selection.service import SelectionService
from tests.calls import register
from tests.fakes import FakeClock

WALL = 1_700_000_000_000_000_000
PEER = 7
MAX_HASHES = 8


def event_record() -> dict[str, Any]:
    add = {"token_sequence": [1, 2], "track_prefill_tokens": True, "expected_output_tokens": 3,
           "prefill_load_hint": {"initial_effective_prefill_tokens": 4,
                                 "expected_prefill_duration": {"secs": 1, "nanos": 5}}}  # fmt: skip
    return {"k": "event", "model_name": "m", "routing_group": "default", "block_size": 4,
            "event": {"request_id": "r1", "worker": {"worker_id": 1, "dp_rank": 0},
                      "data": {"AddRequest": add}, "router_id": PEER, "lora_name": "l"}}  # fmt: skip


def topology_record() -> dict[str, Any]:
    return {"k": "topology", "model_name": "m", "routing_group": "default", "block_size": 4,
            "topology": {"op": "upsert", "worker_id": 2, "dp_start": 0, "dp_size": 1}}  # fmt: skip


def early_record() -> dict[str, Any]:
    return {"k": "early", "model_name": "m", "routing_group": "default", "block_size": 4,
            "early": {"op": "free", "request_id": "gone"}}  # fmt: skip


def spec() -> dict[str, Any]:
    return {"worker_id": 9, "model_name": "m", "routing_group": "default",
            "endpoint": "http://w9", "kv_events_endpoint": None, "kv_events_endpoints": None,
            "replay_endpoint": None, "block_size": 4, "data_parallel_start_rank": None,
            "data_parallel_size": None, "max_num_batched_tokens": None, "total_kv_blocks": None,
            "stable_routing_id": None, "is_eagle": None, "taints": ["t"],
            "topology_domains": None, "kv_transfer_domain": None,
            "kv_transfer_enforcement": None, "kv_transfer_preferred_weight": None}  # fmt: skip


def put_worker() -> dict[str, Any]:
    return {"k": "selection", "selection": {"op": "put_worker", "spec": spec()}}


def book() -> dict[str, Any]:
    return {"k": "selection", "selection": {"op": "book", "id": "b1", "m": "m", "g": "default",
                                            "w": [1, 0], "bh": [1, 2], "ch": None, "cp": False}}  # fmt: skip


def pending() -> dict[str, Any]:
    entry = {"m": "m", "g": "default", "w": [1, 0], "sh": [1], "bh": None, "isl": 4, "ept": 4,
             "track": True, "eot": None, "lora": None, "tok": False}  # fmt: skip
    return {"k": "selection", "selection": {"op": "pending", "id": "p1", "entry": entry}}


def remove_worker() -> dict[str, Any]:
    return {"k": "selection", "selection": {"op": "remove_worker", "worker_id": 1}}


E = ("event",)
ADD = ("event", "data", "AddRequest")
HINT = (*ADD, "prefill_load_hint")
SPEC = ("selection", "spec")

# (reason, record, path, value at the bound, value one past it)
EDGES: list[tuple[str, Any, tuple[Any, ...], Any, Any]] = [
    ("envelope", event_record, ("block_size",), U32_MAX, U32_MAX + 1),
    ("envelope", event_record, ("model_name",), "m" * MAX_NAME_LENGTH, "m" * (MAX_NAME_LENGTH + 1)),
    ("envelope", event_record, ("routing_group",), "g" * MAX_NAME_LENGTH, "g" * (MAX_NAME_LENGTH + 1)),
    ("event", event_record, (*E, "request_id"), "r" * MAX_ID_LENGTH, "r" * (MAX_ID_LENGTH + 1)),
    ("event", event_record, (*E, "lora_name"), "l" * MAX_NAME_LENGTH, "l" * (MAX_NAME_LENGTH + 1)),
    ("event", event_record, (*E, "worker", "worker_id"), 0, -1),
    ("event", event_record, (*E, "worker", "worker_id"), U64_MAX, None),
    ("event", event_record, (*E, "worker", "dp_rank"), U32_MAX, U32_MAX + 1),
    ("event", event_record, (*E, "worker", "dp_rank"), 0, -1),
    ("event", event_record, (*E, "router_id"), 0, -1),
    ("event", event_record, (*E, "router_id"), U64_MAX, None),
    ("event", event_record, (*ADD, "token_sequence"), [0, U64_MAX], [0, -1]),
    ("event", event_record, (*ADD, "token_sequence"), [1] * MAX_HASHES, [1] * (MAX_HASHES + 1)),
    ("event", event_record, (*ADD, "expected_output_tokens"), U32_MAX, U32_MAX + 1),
    ("event", event_record, (*ADD, "expected_output_tokens"), 0, -1),
    ("event", event_record, (*HINT, "initial_effective_prefill_tokens"), 0, -1),
    ("event", event_record, (*HINT, "expected_prefill_duration", "nanos"), 10**9 - 1, 10**9),
    ("event", event_record, (*HINT, "expected_prefill_duration", "nanos"), 0, -1),
    ("event", event_record, (*HINT, "expected_prefill_duration", "secs"), U64_MAX, -1),
    ("topology", topology_record, ("topology", "worker_id"), U64_MAX, -1),
    ("topology", topology_record, ("topology", "dp_start"), 0, -1),
    ("early", early_record, ("early", "request_id"), "x" * MAX_ID_LENGTH, "x" * (MAX_ID_LENGTH + 1)),
    ("selection", put_worker, (*SPEC, "worker_id"), U64_MAX, -1),
    ("selection", put_worker, (*SPEC, "block_size"), U32_MAX, U32_MAX + 1),
    ("selection", put_worker, (*SPEC, "data_parallel_size"), U32_MAX, U32_MAX + 1),
    ("selection", put_worker, (*SPEC, "model_name"), "m" * MAX_NAME_LENGTH, "m" * (MAX_NAME_LENGTH + 1)),
    ("selection", put_worker, (*SPEC, "endpoint"), "e" * MAX_TEXT_LENGTH, "e" * (MAX_TEXT_LENGTH + 1)),
    ("selection", put_worker, (*SPEC, "taints"), ["t" * MAX_TEXT_LENGTH], ["t" * (MAX_TEXT_LENGTH + 1)]),
    ("selection", put_worker, (*SPEC, "max_num_batched_tokens"), U64_MAX, -1),
    ("selection", book, ("selection", "id"), "b" * MAX_ID_LENGTH, "b" * (MAX_ID_LENGTH + 1)),
    ("selection", book, ("selection", "w"), [U64_MAX, U32_MAX], [1, U32_MAX + 1]),
    ("selection", book, ("selection", "bh"), [U64_MAX] * MAX_HASHES, [1] * (MAX_HASHES + 1)),
    ("selection", book, ("selection", "bh"), [0], [-1]),
    ("selection", pending, ("selection", "entry", "isl"), U64_MAX, -1),
    ("selection", pending, ("selection", "entry", "sh"), [1] * MAX_HASHES, [1] * (MAX_HASHES + 1)),
    ("selection", remove_worker, ("selection", "worker_id"), U64_MAX, -1),
]  # fmt: skip


def with_value(make: Any, path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    rec = copy.deepcopy(make())
    node = rec
    for name in path[:-1]:
        node = node[name]
    node[path[-1]] = value
    return rec


def entry(rec: dict[str, Any], fmt: int) -> Delivered:
    """The record as the reader hands it over, in stream format ``fmt``."""
    if fmt == 2:
        return Delivered(PEER, 1, 1, WALL, msgpack.packb(rec))
    old = {k: v for k, v in rec.items() if k != "k"} | {"origin": PEER, "ts": WALL}
    return Delivered(PEER, 1, 1, WALL, msgpack.packb(old), 1)


def service() -> SlotTrackerService:
    clock = FakeClock()
    s = SlotTrackerService(clock=clock.now, wall_clock=lambda: WALL, instance_id=1)
    s.replica.max_hashes = MAX_HASHES
    s.replica.use_early_calls(100, 10**12, 1 << 20)
    sel = SelectionService(s.registry, config=RouterConfig(use_kv_events=False), clock=clock.now,
                           rng=random.Random(1))  # fmt: skip
    s.replica.bind_selection(sel.replica)
    register(s, ("m", "default"), 1, 4, 0, 2)
    return s


def state(s: SlotTrackerService) -> Any:
    return s.export_state(), s.export_early(), s.export_selection()


@pytest.mark.parametrize("fmt", [2, 1])
@pytest.mark.parametrize(
    ("reason", "make", "path", "at", "past"),
    EDGES,
    ids=[f"{'.'.join(map(str, p[-2:]))}={a!r:.20}" for _, _, p, a, _ in EDGES],
)
def test_each_bound_at_its_edge(
    fmt: int, reason: str, make: Any, path: tuple[Any, ...], at: Any, past: Any
) -> None:
    s = service()
    accepted = entry(with_value(make, path, at), fmt)
    s.apply_remote([accepted])
    assert s.replica.dropped == 0, s.replica.rejected
    if past is None:  # a u64's upper bound: nothing past it on the wire
        return
    rejected = entry(with_value(make, path, past), fmt)
    if not (type(past) is list and len(past) > MAX_HASHES):  # a prompt's length: the service's
        with pytest.raises(RejectedRecord) as err:
            r.decode(rejected.record, fmt)
        assert err.value.reason == reason, err.value
    before = state(s)
    assert s.apply_remote([rejected]) == 0
    assert s.replica.rejected == {k: int(k == reason) for k in s.replica.rejected}
    assert state(s) == before


@pytest.mark.parametrize("fmt", [2, 1])
@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"k": "nope"}), b"\x85\xa1k"],
    ids=["empty", "not msgpack", "an array", "an unknown kind", "cut short"],
)
def test_a_record_that_is_not_one_is_rejected_as_envelope(fmt: int, payload: bytes) -> None:
    """The envelope's fields were fine (replication read them), the record's bytes are not."""
    s = service()
    before = state(s)
    assert s.apply_remote([Delivered(PEER, 1, 1, WALL, payload, fmt)]) == 0
    assert s.replica.rejected == {k: int(k == "envelope") for k in s.replica.rejected}
    assert state(s) == before


def test_a_stream_format_this_version_does_not_know_is_rejected() -> None:
    s = service()
    good = msgpack.packb(early_record())
    assert s.apply_remote([Delivered(PEER, 1, 1, WALL, good, 3)]) == 0
    assert s.replica.rejected["envelope"] == 1
