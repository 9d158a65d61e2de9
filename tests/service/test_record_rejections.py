"""A peer's lifecycle record is checked field by field before it reaches a tracker
(``kv_slot_tracker.service.record_check``, ``kv_slot_tracker.core.events``): each record below
is bad in one way, is rejected with its reason, counted once, and changes nothing; the edges of
the accepted ranges are applied, a prompt's u64 hashes kept in the service's signed form."""

from __future__ import annotations

import copy
from typing import Any

import msgpack
import msgspec
import pytest

from kv_slot_tracker.service import SlotTrackerService
from tests.calls import register
from tests.fakes import FakeClock
from tests.support.records import format_1

KEY = ("m", "default")
PEER = 7
WALL = 1_700_000_000_000_000_000
U64_MAX = 2**64 - 1


def event(rid: str = "r1", hashes: Any = (11, 12), **fields: Any) -> dict[str, Any]:
    add = {"token_sequence": list(hashes) if type(hashes) is tuple else hashes,
           "track_prefill_tokens": True, "expected_output_tokens": None,
           "prefill_load_hint": None}  # fmt: skip
    ev = {"request_id": rid, "worker": {"worker_id": 1, "dp_rank": 0},
          "data": {"AddRequest": add}, "router_id": PEER, "lora_name": None}  # fmt: skip
    ev.update(fields)
    return ev


def add_fields(**fields: Any) -> dict[str, Any]:
    ev = event()
    ev["data"]["AddRequest"].update(fields)
    return ev


def record(ev: Any = None, **envelope: Any) -> dict[str, Any]:
    rec = {"model_name": KEY[0], "routing_group": KEY[1], "block_size": 4, "origin": PEER,
           "ts": WALL, "event": event() if ev is None else ev}  # fmt: skip
    rec.update(envelope)
    return rec


def service() -> SlotTrackerService:
    s = SlotTrackerService(clock=FakeClock().now, wall_clock=lambda: WALL, instance_id=1)
    register(s, KEY, 1, 4, 0, 2)
    return s


# A u64 one past its bound (2^64) has no msgpack encoding, so no record on the stream carries
# one (``test_a_u64_past_its_bound_cannot_be_carried``); the lower bound is tested instead.
BAD: list[tuple[str, str, dict[str, Any]]] = [
    # the prompt: a list of u64, nothing else
    ("event", "a bool in the hashes", record(event(hashes=[11, True, 13]))),
    ("event", "False in the hashes", record(event(hashes=[False]))),
    ("event", "a negative hash (records carry u64)", record(event(hashes=[11, -1]))),
    ("event", "the signed form of a hash", record(event(hashes=[-(2**63)]))),
    ("event", "a float hash", record(event(hashes=[11, 12.0]))),
    ("event", "a string hash", record(event(hashes=["11"]))),
    ("event", "a None hash", record(event(hashes=[None]))),
    ("event", "a nested list", record(event(hashes=[[11]]))),
    ("event", "hashes not a list (a map)", record(event(hashes={"11": 12}))),
    ("event", "hashes not a list (a string)", record(event(hashes="1112"))),
    ("event", "hashes not a list (a number)", record(event(hashes=11))),
    # the other fields of an add
    ("event", "track_prefill_tokens an int", record(add_fields(track_prefill_tokens=1))),
    ("event", "track_prefill_tokens None", record(add_fields(track_prefill_tokens=None))),
    ("event", "expected_output_tokens a bool", record(add_fields(expected_output_tokens=True))),
    ("event", "expected_output_tokens 2^32", record(add_fields(expected_output_tokens=2**32))),
    ("event", "expected_output_tokens -1", record(add_fields(expected_output_tokens=-1))),
    ("event", "a hint that is a list", record(add_fields(prefill_load_hint=[1]))),
    (
        "event",
        "a duration of 10^9 nanos",
        record(
            add_fields(
                prefill_load_hint={
                    "initial_effective_prefill_tokens": 5,
                    "expected_prefill_duration": {"secs": 0, "nanos": 10**9},
                }
            )
        ),
    ),
    # the event
    ("event", "worker_id a bool", record(event(worker={"worker_id": True, "dp_rank": 0}))),
    ("event", "worker_id -1", record(event(worker={"worker_id": -1, "dp_rank": 0}))),
    ("event", "dp_rank 2^32", record(event(worker={"worker_id": 1, "dp_rank": 2**32}))),
    ("event", "dp_rank None", record(event(worker={"worker_id": 1, "dp_rank": None}))),
    ("event", "worker a list", record(event(worker=[1, 0]))),
    ("event", "router_id a bool", record(event(router_id=False))),
    ("event", "request_id a number", record(event(rid=5))),  # type: ignore[arg-type]
    ("event", "request_id over 1,024", record(event(rid="r" * 1025))),
    ("event", "lora_name a number", record(event(lora_name=3))),
    ("event", "lora_name over 1,024", record(event(lora_name="l" * 1025))),
    ("event", "data an unknown variant", record(event(data="Explode"))),
    (
        "event",
        "data with a second key",
        record(event(data={"AddRequest": event()["data"]["AddRequest"], "Free": None})),
    ),
    ("event", "data an add that is not a map", record(event(data={"AddRequest": [1]}))),
    ("event", "an event batch", record({**event(), "events": []})),
    ("event", "an event that is not a map", record(["r1"])),
    # the envelope
    ("envelope", "an event and a topology change", record(topology={"op": "renew"})),
    ("envelope", "block_size a bool", record(block_size=True)),
    ("envelope", "block_size 2^32", record(block_size=2**32)),
    ("envelope", "model_name a number", record(model_name=1)),
    ("envelope", "routing_group over 1,024", record(routing_group="g" * 1025)),
]


@pytest.mark.parametrize(
    ("reason", "rec"), [(reason, rec) for reason, _, rec in BAD], ids=[i for _, i, _ in BAD]
)
def test_a_bad_record_is_rejected_with_its_reason_and_changes_nothing(
    reason: str, rec: dict[str, Any]
) -> None:
    s = service()
    assert s.apply_remote(format_1([record(event("r0"))])) == 1
    before = s.replica.export_state()
    sent = copy.deepcopy(rec)
    assert s.apply_remote(format_1([rec])) == 0
    assert s.replica.export_state() == before
    assert s.replica.applied == 1
    assert s.replica.rejected == {
        r: int(r == reason) for r in ("envelope", "topology", "event", "early", "selection",
                                      "conflict", "snapshot", "released")
    }  # fmt: skip
    assert rec == sent  # the record itself is left as it came


def test_a_u64_past_its_bound_cannot_be_carried() -> None:
    for value in (2**64, 2**64 + 1, 2**70):
        with pytest.raises(OverflowError):
            msgpack.packb(record(event(hashes=[value])))
        with pytest.raises(OverflowError):
            msgspec.msgpack.encode(value)


def test_the_records_behind_rejected_ones_are_applied() -> None:
    s = service()
    records = [rec for _, _, rec in BAD] + [record(event("r2", hashes=[U64_MAX, 2**63]))]
    assert s.apply_remote(format_1(records)) == 1
    assert s.replica.dropped == len(BAD)
    assert s.replica.rejected["event"] == sum(reason == "event" for reason, _, _ in BAD)
    assert s.tracker(KEY).active_blocks() == {(1, 0): 2, (1, 1): 0}


def prompt_of(s: SlotTrackerService, rid: str) -> list[int]:
    (tracker,) = s.replica.export_state()
    (requests,) = [slot["requests"] for slot in tracker["tracker"]["slots"] if slot["requests"]]
    (req,) = [r for r in requests if r[0] == rid]
    return req[1]


@pytest.mark.parametrize(
    ("hashes", "signed"),
    [
        ([0, 1, 2**63 - 1], [0, 1, 2**63 - 1]),
        ([2**63, U64_MAX], [-(2**63), -1]),
        ([14643705804678351452, 4945711292740353085],
         [-3803038269031200164, 4945711292740353085]),  # SPEC Appendix A
        ([], []),
    ],
)  # fmt: skip
def test_the_edges_of_the_u64_range_are_accepted_and_kept_signed(
    hashes: list[int], signed: list[int]
) -> None:
    s = service()
    assert s.apply_remote(format_1([record(event("r1", hashes=hashes))])) == 1
    assert s.replica.dropped == 0
    tracker = s.tracker(KEY)
    assert tracker.has_request("r1")
    assert tracker.active_blocks() == {(1, 0): len(hashes), (1, 1): 0}
    if hashes:  # kept signed: the API's form of the same prompt overlaps all of it
        assert tracker.overlaps(signed) == {(1, 0): len(hashes)}
        assert tracker.overlaps(hashes) == ({(1, 0): len(hashes)} if hashes == signed else {})
    # a snapshot carries them unsigned again, as the record did
    assert prompt_of(s, "r1") == hashes
    tracker.assert_consistent()


def test_a_prompt_of_none_and_a_hint_at_the_edges_are_accepted() -> None:
    s = service()
    hint = {"initial_effective_prefill_tokens": U64_MAX - 10,
            "expected_prefill_duration": {"secs": U64_MAX // 10**9, "nanos": 10**9 - 1}}  # fmt: skip
    ev = add_fields(token_sequence=None, expected_output_tokens=2**32 - 1, prefill_load_hint=hint)
    ev["worker"] = {"worker_id": U64_MAX, "dp_rank": 0}
    ev["router_id"] = U64_MAX
    register(s, KEY, U64_MAX, 4, 0, 1)
    assert s.apply_remote(format_1([record(ev)])) == 1
    assert s.replica.dropped == 0
    assert s.tracker(KEY).has_request("r1")
