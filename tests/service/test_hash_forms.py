"""Hashes are kept signed inside the service and travel unsigned in records and snapshots,
exactly as before they were kept signed: an instance of the previous version on the same
stream, and snapshots it stored, keep working (``kv_slot_tracker.core.hashing``).

The vectors are SPEC Appendix A's: tokens 1..8, block size 4, no LoRA.
"""

from __future__ import annotations

from typing import Any

import msgpack

from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service import commands as c
from tests.calls import AddCall, register
from tests.fakes import FakeClock
from tests.support.records import Records, format_1, format_2

KEY = ("m", "default")
PEER = 7
WALL = 1_700_000_000_000_000_000
TOKENS_1_8 = [1, 2, 3, 4, 5, 6, 7, 8]
SEQ_U64 = [14643705804678351452, 4945711292740353085]  # Appendix A, as the reference hashes
SEQ_I64 = [-3803038269031200164, 4945711292740353085]  # the same, as the API sends them


def service(replicator: Records | None = None) -> SlotTrackerService:
    s = SlotTrackerService(
        clock=FakeClock().now, wall_clock=lambda: WALL, instance_id=1, replicator=replicator
    )
    register(s, KEY, 1, 4, 0, 2)
    return s


def previous_add_record(rid: str, dp_rank: int, origin: int) -> dict[str, Any]:
    """The add record the previous version wrote for a prompt of ``SEQ_I64`` (it made the
    hashes unsigned at the HTTP edge, and the record carried them so)."""
    return {
        "model_name": "m",
        "routing_group": "default",
        "block_size": 4,
        "origin": origin,
        "ts": WALL,
        "event": {
            "request_id": rid,
            "worker": {"worker_id": 1, "dp_rank": dp_rank},
            "data": {
                "AddRequest": {
                    "token_sequence": SEQ_U64,
                    "track_prefill_tokens": False,
                    "expected_output_tokens": None,
                    "prefill_load_hint": None,
                }
            },
            "router_id": origin,
            "lora_name": None,
        },
    }


def test_records_written_are_the_previous_format_with_the_kind_tag() -> None:
    sink = Records()
    s = service(sink)
    del sink.payloads[:], sink.times[:]  # the registration's record
    s.add(AddCall(*KEY, "by-hashes", 1, 0, sequence_hashes=SEQ_I64))
    s.add(AddCall(*KEY, "by-tokens", 1, 1, token_ids=TOKENS_1_8))
    s.add(AddCall(*KEY, "small", 1, 0, sequence_hashes=[1, 2]))
    s.free(c.Free(model_name="m", request_id="by-hashes"))
    expected_small = previous_add_record("small", 0, 1)
    expected_small["event"]["data"]["AddRequest"]["token_sequence"] = [1, 2]
    free = {**previous_add_record("by-hashes", 0, 1), "event": None}
    free["event"] = {
        "request_id": "by-hashes",
        "worker": {"worker_id": 1, "dp_rank": 0},
        "data": "Free",
        "router_id": 1,
        "lora_name": None,
    }
    assert sink.payloads == [
        format_2(previous_add_record("by-hashes", 0, 1)),
        format_2(previous_add_record("by-tokens", 1, 1)),
        format_2(expected_small),
        format_2(free),
    ]
    assert sink.times == [WALL] * 4
    add = msgpack.unpackb(sink.payloads[0])["event"]["data"]["AddRequest"]
    assert add["token_sequence"] == [14643705804678351452, 4945711292740353085]


def test_previous_records_apply_to_the_same_blocks() -> None:
    """A peer of the previous version adds the prompt (unsigned in its record); a local add of
    the same prompt, signed, shares its blocks and its overlap."""
    s = service()
    assert s.apply_remote(format_1([previous_add_record("peer", 0, PEER)])) == 1
    t = s.tracker(KEY)
    assert t.overlaps(SEQ_I64) == {(1, 0): 2}
    s.add(AddCall(*KEY, "local", 1, 0, sequence_hashes=SEQ_I64))
    s.add(AddCall(*KEY, "tokens", 1, 0, token_ids=TOKENS_1_8))
    assert t.active_blocks() == {(1, 0): 2, (1, 1): 0}  # one prompt's blocks, held three times
    t.assert_consistent()


def previous_snapshot() -> list[dict[str, Any]]:
    """An ``export_state`` of the previous version: one request of ``SEQ_U64`` on rank 0."""
    return [
        {
            "model_name": "m",
            "routing_group": "default",
            "tracker": {
                "format": 1,
                "block_size": 4,
                "ranges": [[1, 0, 2]],
                "slots": [
                    {
                        "worker": [1, 0],
                        "requests": [["old", SEQ_U64, WALL - 5, None, True, None]],
                        "prefills": [],
                        "anchor_since": None,
                    },
                    {"worker": [1, 1], "requests": [], "prefills": [], "anchor_since": None},
                ],
                "index_only": [],
            },
        }
    ]


def test_a_previous_snapshot_restores_and_takes_previous_records() -> None:
    s = service()
    s.restore_state(previous_snapshot())
    t = s.tracker(KEY)
    assert t.active_blocks() == {(1, 0): 2, (1, 1): 0}
    assert t.overlaps(SEQ_I64) == {(1, 0): 2}  # the signed prompt finds the restored blocks
    assert s.apply_remote(format_1([previous_add_record("peer", 1, PEER)])) == 1
    assert t.overlaps(SEQ_I64) == {(1, 0): 2, (1, 1): 2}
    s.free(c.Free(model_name="m", request_id="old"))
    s.add(AddCall(*KEY, "again", 1, 0, sequence_hashes=SEQ_I64))
    assert t.active_blocks() == {(1, 0): 2, (1, 1): 2}
    t.assert_consistent()
    # and what this version stores is the previous format again
    exported = s.export_state()
    slots = exported[0]["tracker"]["slots"]
    assert [r[:2] for slot in slots for r in slot["requests"]] == [
        ["again", SEQ_U64],
        ["peer", SEQ_U64],
    ]
