"""Replica records applied by the service: a record the core refuses is skipped, and the records
behind it in the same batch are still applied (the reader has already advanced past them)."""

from __future__ import annotations

from kv_slot_tracker.service import SlotTrackerService
from tests.calls import register
from tests.fakes import FakeClock
from tests.support.records import format_1

KEY = ("m", "default")
PEER = 7
WALL = 1_700_000_000_000_000_000


def envelope(**body) -> dict:
    return {"model_name": KEY[0], "routing_group": KEY[1], "block_size": 4, "origin": PEER,
            "ts": WALL, **body}  # fmt: skip


def add_record(rid: str, hashes: list[int]) -> dict:
    return envelope(
        event={
            "request_id": rid,
            "worker": {"worker_id": 1, "dp_rank": 0},
            "data": {"AddRequest": {"token_sequence": hashes, "track_prefill_tokens": False,
                                    "expected_output_tokens": None, "prefill_load_hint": None}},
            "router_id": PEER,
            "lora_name": None,
        }
    )  # fmt: skip


def service() -> SlotTrackerService:
    clock = FakeClock()
    s = SlotTrackerService(clock=clock.now, wall_clock=lambda: WALL, instance_id=1)
    register(s, KEY, 1, 4, 0, 1)
    return s


def test_a_refused_topology_record_does_not_stop_the_batch() -> None:
    s = service()
    records = [
        envelope(topology={"op": "upsert", "worker_id": 2, "dp_start": 0, "dp_size": 0}),
        envelope(topology={"op": "upsert", "worker_id": 3, "dp_start": 2**32 - 1, "dp_size": 2}),
        envelope(topology={"op": "reconcile", "workers": [[4, 0, 1], [4, 1, 1]]}),
        add_record("r1", [11, 12, 13]),
        envelope(topology={"op": "upsert", "worker_id": 5, "dp_start": 0, "dp_size": 2}),
    ]
    applied = s.apply_remote(format_1(records))
    assert applied == 2
    assert s.replica.dropped == 3
    assert s.tracker(KEY).active_blocks() == {(1, 0): 3, (5, 0): 0, (5, 1): 0}
    assert [r["worker_id"] for r in s.workers(None, None)] == [1, 5]
    s.tracker(KEY).assert_consistent()


def test_a_refused_first_range_leaves_no_empty_tracker() -> None:
    s = service()
    other = {"model_name": "other", "routing_group": "default", "block_size": 4, "origin": PEER,
             "ts": WALL, "topology": {"op": "upsert", "worker_id": 1, "dp_start": 0,
                                      "dp_size": 0}}  # fmt: skip
    assert s.apply_remote(format_1([other])) == 0
    assert list(s.trackers) == [KEY]


def test_malformed_records_are_counted_and_skipped() -> None:
    s = service()
    records = [{"origin": PEER}, envelope(event={"request_id": 5}), add_record("r2", [1])]
    assert s.apply_remote(format_1(records)) == 1
    assert s.replica.dropped == 2
    assert s.tracker(KEY).has_request("r2")


def test_a_record_that_would_create_a_tracker_beyond_the_limit_is_rejected() -> None:
    clock = FakeClock()
    s = SlotTrackerService(clock=clock.now, wall_clock=lambda: WALL, instance_id=1, max_trackers=1)
    register(s, KEY, 1, 4, 0, 1)
    other = {"model_name": "other", "routing_group": "default", "block_size": 4, "origin": PEER,
             "ts": WALL, "topology": {"op": "upsert", "worker_id": 1, "dp_start": 0,
                                      "dp_size": 1}}  # fmt: skip
    assert s.apply_remote(format_1([other, add_record("r1", [1])])) == 1
    assert s.replica.rejected["conflict"] == 1
    assert list(s.trackers) == [KEY]
