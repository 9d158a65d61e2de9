"""State export/import (``kv_slot_tracker.core.snapshot``): a restored tracker answers exactly like the original.

Pure tests, no Redis: trackers on a fake clock, random traffic, then every query compared.
"""

from __future__ import annotations

import random

import msgpack
import pytest

from kv_slot_tracker.core.events import ActiveSequenceEvent, AddRequest
from kv_slot_tracker.core.snapshot import export_tracker, wall_mapping
from kv_slot_tracker.core.tracker import ActiveSequencesMultiWorker, ReplicaEffects
from kv_slot_tracker.core.types import (
    PrefillLoadHint,
    WorkerDpRange,
    WorkerWithDpRank,
)
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service.record_check import RejectedRecord
from tests.calls import AddCall, import_tracker, potential_loads, register
from tests.fakes import NS_PER_SECOND, FakeClock
from tests.support.tracker import (
    SequenceRequest,
    active_request_counts,
    add_request,
    modeled_remaining_prefill_time_loads_at,
    new_tracker,
    potential_blocks_and_tokens,
    request_ranks,
    slots,
)

WALL_OFFSET = 1_700_000_000 * NS_PER_SECOND


def build_tracker(seed: int, clock: FakeClock) -> ActiveSequencesMultiWorker:
    rng = random.Random(seed)
    t = new_tracker(None, 4, {1: (0, 2), 2: (0, 1), 3: (1, 2)}, clock=clock.now)
    live: list[str] = []
    for i in range(400):
        clock.advance(rng.uniform(0, 0.2))
        op = rng.random()
        if op < 0.6 or not live:
            worker = rng.choice(t.workers())
            prefix = rng.choice([[], [1], [1, 2], [1, 2, 3], [9, 8]])
            prompt = prefix + [rng.randrange(10, 40) for _ in range(rng.randrange(0, 5))]
            duration = rng.choice([None, rng.randrange(0, 5_000) * 1_000_000])
            tokens = rng.choice([0, rng.randrange(1, 500)])
            hint = PrefillLoadHint(tokens, duration) if tokens else None
            rid = f"r{i}"
            add_request(
                t,
                SequenceRequest(
                    rid,
                    worker,
                    prompt or None,
                    rng.random() < 0.9,
                    rng.choice([None, 16, 128]),
                    hint,
                    rng.choice([None, None, "lora-a", "lora-b"]),
                ),
                clock.now(),
            )
            live.append(rid)
        elif op < 0.75:
            rid = rng.choice(live)
            t.mark_prefill_completed(rid, clock.now())
        else:
            rid = live.pop(rng.randrange(len(live)))
            t.free(rid, clock.now())
    return t


def assert_same_answers(
    a: ActiveSequencesMultiWorker, b: ActiveSequencesMultiWorker, clock: FakeClock
) -> None:
    assert a.worker_ranges() == b.worker_ranges()
    assert a.workers() == b.workers()
    assert a.active_blocks() == b.active_blocks()
    assert active_request_counts(a) == active_request_counts(b)
    assert request_ranks(a) == request_ranks(b)
    assert a.get_active_lora_counts() == b.get_active_lora_counts()
    for w in a.workers():
        ra, rb = slots(a)[w].requests, slots(b)[w].requests
        assert list(ra) == list(rb)
        for rid in ra:
            assert ra[rid].prompt_blocks == rb[rid].prompt_blocks
            assert ra[rid].started_at == rb[rid].started_at
            assert ra[rid].expected_output_tokens == rb[rid].expected_output_tokens
    now = clock.now()
    for dt in (0, 1, 250, 1_000, 3_000, 10_000, 60_000):
        at = now + dt * 1_000_000
        assert a.active_tokens(at) == b.active_tokens(at)
        ma = [
            (m.worker, str(m.modeled_remaining_prefill_time_ms))
            for m in modeled_remaining_prefill_time_loads_at(a, at)
        ]
        mb = [
            (m.worker, str(m.modeled_remaining_prefill_time_ms))
            for m in modeled_remaining_prefill_time_loads_at(b, at)
        ]
        assert sorted(ma) == sorted(mb)
    for query in ([1], [1, 2], [1, 2, 3], [1, 2, 3, 11], [9, 8, 20], [5], []):
        assert a.overlaps(query) == b.overlaps(query)
        assert potential_blocks_and_tokens(a, query, None, now, True) == (
            potential_blocks_and_tokens(b, query, None, now, True)
        )


@pytest.mark.parametrize("seed", range(8))
def test_restored_tracker_answers_identically(seed: int) -> None:
    clock = FakeClock()
    original = build_tracker(seed, clock)
    to_wall, from_wall = wall_mapping(clock.now(), clock.now() + WALL_OFFSET)
    data = export_tracker(original, to_wall)
    data = msgpack.unpackb(msgpack.packb(data), raw=False)  # survives the wire
    restored = import_tracker(data, from_wall, clock=clock.now)
    restored.assert_consistent()
    original.assert_consistent()
    assert_same_answers(original, restored, clock)

    # and both keep evolving the same way
    for t in (original, restored):
        rid = min(request_ranks(t))
        t.free(rid, clock.now())
        add_request(t,
            SequenceRequest("late", WorkerWithDpRank(1, 0), [1, 2, 77], True, None,
                            PrefillLoadHint(50, 2_000_000_000)),
            clock.now(),
        )  # fmt: skip
    clock.advance(0.7)
    assert_same_answers(original, restored, clock)


def test_restore_keeps_stale_copies_and_lazy_slots() -> None:
    """A replicated add moved an id to another rank (seed semantics): both copies restore."""
    clock = FakeClock()
    t = new_tracker(None, 4, {1: (0, 1)}, clock=clock.now)
    eff = ReplicaEffects()
    for worker, prompt in ((WorkerWithDpRank(1, 0), [1]), (WorkerWithDpRank(7, 0), [2])):
        t.apply_replica_event(
            ActiveSequenceEvent("r", worker, AddRequest(prompt, True, None, None), 99, "lora"), eff
        )
    assert request_ranks(t) == {"r": (7, 0)}
    to_wall, from_wall = wall_mapping(clock.now(), clock.now())
    restored = import_tracker(export_tracker(t, to_wall), from_wall, clock=clock.now)
    assert restored.worker_ranges() == [WorkerDpRange(1, 0, 1)]
    assert restored.workers() == [(1, 0), (7, 0)]  # the lazy slot too
    assert_same_answers(t, restored, clock)
    restored.assert_consistent()


def test_output_blocks_are_not_exported() -> None:
    clock = FakeClock()
    t = new_tracker(None, 4, {1: (0, 1)}, clock=clock.now)
    add_request(t, SequenceRequest("r", WorkerWithDpRank(1, 0), [1, 2]), clock.now())
    t.add_output_block("r")
    assert t.active_blocks()[(1, 0)] == 3
    to_wall, from_wall = wall_mapping(clock.now(), clock.now())
    restored = import_tracker(export_tracker(t, to_wall), from_wall, clock=clock.now)
    assert restored.active_blocks()[(1, 0)] == 2
    restored.assert_consistent()


def test_wall_mapping_moves_instants_between_processes() -> None:
    """Exporter and importer clocks have different origins; wall time carries the instant."""
    clock_a = FakeClock(5 * NS_PER_SECOND)
    t = new_tracker(None, 4, {1: (0, 1)}, clock=clock_a.now)
    add_request(t,
        SequenceRequest("p", WorkerWithDpRank(1, 0), [1], True, None,
                        PrefillLoadHint(100, 10 * NS_PER_SECOND)),
        clock_a.now(),
    )  # fmt: skip
    clock_a.advance(2)
    wall = WALL_OFFSET
    to_wall, _ = wall_mapping(clock_a.now(), wall)
    data = export_tracker(t, to_wall)

    clock_b = FakeClock(900 * NS_PER_SECOND)  # another process, same wall time
    _, from_wall = wall_mapping(clock_b.now(), wall)
    restored = import_tracker(data, from_wall, clock=clock_b.now)
    assert t.active_tokens(clock_a.now()) == restored.active_tokens(clock_b.now()) == {(1, 0): 80}
    assert slots(restored)[(1, 0)].requests["p"].started_at == clock_b.now() - 2 * NS_PER_SECOND
    # a wall time ahead of the importer's is clamped to its now
    _, from_wall_behind = wall_mapping(clock_b.now(), wall - 10 * NS_PER_SECOND)
    assert from_wall_behind(wall) == clock_b.now()


def test_service_state_round_trip() -> None:
    clock, wall = FakeClock(), FakeClock(WALL_OFFSET)
    a = SlotTrackerService(clock=clock.now, wall_clock=wall.now)
    b = SlotTrackerService(clock=clock.now, wall_clock=wall.now)
    for group in ("g1", "g2"):
        register(a, ("m", group), 1, 16, 0, 2)
        register(a, ("m", group), 2, 16, 0, 1)
        for i in range(20):
            a.add(AddCall("m", group, f"{group}-{i}", 1 + i % 2, 0, sequence_hashes=[1, 2, i],
                          new_isl_tokens=100 + i, expected_prefill_ms=1000 + i))  # fmt: skip
            clock.advance(0.05)
            wall.advance(0.05)
    register(b, ("m", "gone"), 5, 16, 0, 1)  # replaced by the restore
    state = msgpack.unpackb(msgpack.packb(a.export_state()), raw=False)
    b.restore_state(state)
    assert b.loads(None, None) == a.loads(None, None)
    assert b.workers(None, None) == a.workers(None, None)
    for group in ("g1", "g2"):
        assert potential_loads(b, ("m", group), [1, 2, 3], None, None, 9) == potential_loads(
            a, ("m", group), [1, 2, 3], None, None, 9
        )
    clock.advance(0.5)
    wall.advance(0.5)
    assert b.loads(None, None) == a.loads(None, None)


def test_service_restore_is_all_or_nothing() -> None:
    clock = FakeClock()
    s = SlotTrackerService(clock=clock.now, wall_clock=clock.now)
    register(s, ("m", "g"), 1, 16, 0, 1)
    with pytest.raises(RejectedRecord):  # checked like a record before anything is replaced
        s.restore_state([{"model_name": "m", "routing_group": "x", "tracker": {"format": 1}}])
    assert s.workers(None, None)[0]["worker_id"] == 1
