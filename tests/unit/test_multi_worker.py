"""``ActiveSequencesMultiWorker``: ports of the seed's non-replica tests and SPEC §9.3 M01-M29.

Seed tests ([seed-MW] ``sequences/multi_worker.rs``) keep their names with a ``test_`` prefix; the
remaining SPEC scenarios are named ``test_mNN_...``. A paused tokio clock becomes a ``FakeClock``.
"""

from __future__ import annotations

import pytest

from kv_slot_tracker.core.errors import (
    DuplicateRequest,
    DuplicateWorker,
    InvalidDpRange,
    InvalidDpSize,
    MissingExpectedDuration,
    RequestNotFound,
    WorkerIdNotRegistered,
    WorkerNotFound,
)
from kv_slot_tracker.core.events import (
    FREE,
    MARK_PREFILL_COMPLETED,
    ActiveSequenceEvent,
    AddRequest,
)
from kv_slot_tracker.core.hashing import signed_hashes
from kv_slot_tracker.core.publisher import ReplicaEffects
from kv_slot_tracker.core.tracker import ActiveSequencesMultiWorker
from kv_slot_tracker.core.types import (
    ActiveLoad,
    LifecycleCounts,
    PrefillLoadHint,
    PrefillTokenDeltas,
    WorkerDpRange,
    WorkerLoadProjection,
    WorkerWithDpRank,
)
from tests.fakes import FakeClock
from tests.support.recording import (
    RecordingPublisher,
    modeled_hint,
    naive_potential_loads,
    seq_hashes_for_tokens,
    tracking_hint,
)
from tests.support.tracker import (
    SequenceRequest,
    active_request_counts,
    add_request,
    add_request_if_registered,
    any_worker_matches_active_tokens,
    assert_completely_drained,
    is_membership_empty,
    modeled_remaining_prefill_time_loads_at,
    new_tracker,
    new_without_expiry,
    potential_blocks_and_tokens,
    request_loras,
    request_ranks,
)

S = 1_000_000_000  # one second in ns


def w(worker_id: int, dp_rank: int = 0) -> WorkerWithDpRank:
    return WorkerWithDpRank(worker_id, dp_rank)


def req(
    request_id: str,
    worker: WorkerWithDpRank,
    token_sequence: list[int] | None,
    hint: PrefillLoadHint | None = None,
    *,
    track: bool | None = None,
    lora: str | None = None,
) -> SequenceRequest:
    """A request; without a hint it is "no prefill" (``track_prefill_tokens=False``)."""
    return SequenceRequest(
        request_id=request_id,
        worker=worker,
        token_sequence=token_sequence,
        track_prefill_tokens=(hint is not None) if track is None else track,
        expected_output_tokens=None,
        prefill_load_hint=hint,
        lora_name=lora,
    )


def make(
    clock: FakeClock,
    workers: dict[int, tuple[int, int]],
    publisher: RecordingPublisher | None = None,
    *,
    block_size: int = 4,
    replica_sync: bool = False,
    router_id: int = 0,
) -> ActiveSequencesMultiWorker:
    return new_tracker(publisher, block_size, workers, replica_sync, router_id, clock=clock.now)


def make_sequences(clock: FakeClock) -> ActiveSequencesMultiWorker:
    return make(clock, {1: (0, 1)})


def make_multi_sequences(clock: FakeClock, block_size: int = 4) -> ActiveSequencesMultiWorker:
    return make(clock, {1: (0, 1), 2: (0, 1)}, block_size=block_size)


def make_recording_sequences(
    clock: FakeClock, workers: dict[int, tuple[int, int]]
) -> tuple[ActiveSequencesMultiWorker, RecordingPublisher]:
    publisher = RecordingPublisher()
    return make(clock, workers, publisher, replica_sync=True), publisher


def modeled_time_loads_by_worker(
    tracker: ActiveSequencesMultiWorker, now: int
) -> dict[WorkerWithDpRank, int | MissingExpectedDuration]:
    return {
        load.worker: load.modeled_remaining_prefill_time_ms
        for load in modeled_remaining_prefill_time_loads_at(tracker, now)
    }


def active_request_count(tracker: ActiveSequencesMultiWorker, worker: WorkerWithDpRank) -> int:
    return active_request_counts(tracker).get(worker, 0)


def assert_matches_naive(
    tracker: ActiveSequencesMultiWorker,
    query: list[int] | None,
    deltas: PrefillTokenDeltas,
    decay_now: int,
) -> tuple[dict[WorkerWithDpRank, int], dict[WorkerWithDpRank, int]]:
    expected = naive_potential_loads(tracker, query, deltas, decay_now)
    blocks, tokens, requests = potential_blocks_and_tokens(tracker, query, deltas, decay_now)
    assert blocks == expected[0]
    assert tokens == expected[1]
    assert requests is None
    return blocks, tokens


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# --------------------------------------------------------------------------------------------
# Seed tests ([seed-MW]), same names
# --------------------------------------------------------------------------------------------


def test_worker_topology_observes_registered_and_removed_workers(clock: FakeClock) -> None:
    sequences, state = make_recording_sequences(clock, {1: (0, 2)})
    assert state.registered == [w(1, 0), w(1, 1)]

    state.clear()
    sequences.register_worker(WorkerDpRange(2, 0, 1))
    assert state.registered == [w(2, 0)]

    state.clear()
    sequences.unregister_worker(1)
    assert state.removed == [w(1, 0), w(1, 1)]
    sequences.assert_consistent()


def test_add_request_can_skip_prefill_token_tracking(clock: FakeClock) -> None:
    sequences = make_sequences(clock)
    worker = w(1, 0)
    decay_now = clock.now()

    add_request(sequences, req("req-1", worker, [1, 2, 3], None, track=False), decay_now)

    assert sequences.active_tokens(decay_now).get(worker) == 0
    assert active_request_count(sequences, worker) == 1
    sequences.assert_consistent()


def test_modeled_remaining_prefill_time_loads_follow_multi_worker_projection(
    clock: FakeClock,
) -> None:
    sequences = make_multi_sequences(clock)
    worker_a, worker_b = w(1, 0), w(2, 0)
    start = clock.now()

    add_request(sequences, req("a-oldest", worker_a, [1, 2, 3], modeled_hint(100, 10)), start)
    add_request(sequences, req("a-later", worker_a, [4, 5, 6], modeled_hint(60, 4)), start + S)
    add_request(sequences, req("b-unmodeled", worker_b, [7, 8, 9], tracking_hint(12)), start)

    query = start + 3 * S
    loads = modeled_time_loads_by_worker(sequences, query)
    assert loads[worker_a] == 11_000
    assert loads[worker_b] == MissingExpectedDuration()
    assert isinstance(loads[worker_b], MissingExpectedDuration)

    sequences.mark_prefill_completed("a-oldest", query)
    assert active_request_count(sequences, worker_a) == 2

    loads = modeled_time_loads_by_worker(sequences, query + 2 * S)
    assert loads[worker_a] == 2_000
    assert isinstance(loads[worker_b], MissingExpectedDuration)
    sequences.assert_consistent()


def test_free_nonanchor_modeled_prefill_applies_anchor_credit(clock: FakeClock) -> None:
    sequences = make_sequences(clock)
    worker = w(1, 0)
    start = clock.now()

    add_request(sequences, req("oldest", worker, [1, 2, 3], modeled_hint(100, 10)), start)
    add_request(sequences, req("later", worker, [4, 5, 6], modeled_hint(40, 4)), start)

    completion_time = start + 5 * S
    assert sequences.active_tokens(completion_time).get(worker) == 90
    assert modeled_time_loads_by_worker(sequences, completion_time).get(worker) == 9_000

    sequences.free("later", completion_time)
    assert active_request_count(sequences, worker) == 1

    assert sequences.active_tokens(completion_time).get(worker) == 90
    assert modeled_time_loads_by_worker(sequences, completion_time).get(worker) == 9_000
    sequences.assert_consistent()


def test_block_membership_index_matches_naive_loads_with_output_blocks_and_prefill_updates(
    clock: FakeClock,
) -> None:
    sequences = make_multi_sequences(clock)
    worker_a, worker_b = w(1, 0), w(2, 0)
    decay_now = clock.now()

    add_request(sequences, req("req-a", worker_a, [1, 2, 3], tracking_hint(12)), decay_now)
    sequences.add_output_block("req-a", 0.5)
    sequences.mark_prefill_completed("req-a", decay_now)
    add_request(sequences, req("req-b", worker_b, [1, 2, 4], tracking_hint(12)), decay_now)

    prompt = [1, 2, 3, 5]
    deltas = PrefillTokenDeltas.new(16, {worker_a: 8, worker_b: 12})
    assert_matches_naive(sequences, prompt, deltas, decay_now)

    projections = sequences.project_worker_loads(prompt, decay_now)
    assert projections.get(worker_a) == WorkerLoadProjection(
        active_prefill_tokens=0, active_decode_blocks=2, additional_active_blocks=1
    )
    assert projections.get(worker_b) == WorkerLoadProjection(
        active_prefill_tokens=12, active_decode_blocks=3, additional_active_blocks=2
    )
    sequences.assert_consistent()


def test_potential_blocks_use_prefix_membership_not_set_membership(clock: FakeClock) -> None:
    sequences = make_sequences(clock)
    worker = w(1, 0)
    decay_now = clock.now()

    add_request(sequences, req("req-a", worker, [1, 2, 4, 5], None, track=False), decay_now)

    potential_blocks, _, _ = potential_blocks_and_tokens(
        sequences, [1, 2, 3, 5], PrefillTokenDeltas.none(), decay_now
    )
    assert potential_blocks.get(worker) == 6
    sequences.assert_consistent()


def test_lora_specific_sequence_hashes_do_not_cross_match(clock: FakeClock) -> None:
    sequences = make_multi_sequences(clock)
    worker_a, worker_b = w(1, 0), w(2, 0)
    decay_now = clock.now()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    base_prompt = seq_hashes_for_tokens(tokens, None)
    lora_prompt = seq_hashes_for_tokens(tokens, "adapter-a")

    assert base_prompt != lora_prompt

    add_request(sequences, req("base", worker_a, list(base_prompt), None, track=False), decay_now)
    add_request(
        sequences,
        req("lora", worker_b, lora_prompt, None, track=False, lora="adapter-a"),
        decay_now,
    )

    actual_blocks, _ = assert_matches_naive(
        sequences, base_prompt, PrefillTokenDeltas.none(), decay_now
    )

    active_blocks = sequences.active_blocks()
    assert actual_blocks.get(worker_b) == active_blocks[worker_b] + len(base_prompt)
    sequences.assert_consistent()


def test_unit_block_size_repeated_tokens_preserve_membership_and_trim(clock: FakeClock) -> None:
    sequences = make_multi_sequences(clock, block_size=1)
    worker_a, worker_b = w(1, 0), w(2, 0)
    decay_now = clock.now()
    prompt_a = seq_hashes_for_tokens([7, 7, 7], None, block_size=1)
    prompt_b = seq_hashes_for_tokens([7, 7, 8], None, block_size=1)

    add_request(sequences, req("req-a", worker_a, list(prompt_a), None, track=False), decay_now)
    add_request(sequences, req("req-b", worker_b, list(prompt_b), None, track=False), decay_now)

    blocks, _ = assert_matches_naive(sequences, prompt_b, PrefillTokenDeltas.none(), decay_now)
    assert blocks.get(worker_a) == 4
    assert blocks.get(worker_b) == 3

    sequences.free("req-b", decay_now)

    blocks, _ = assert_matches_naive(sequences, prompt_b, PrefillTokenDeltas.none(), decay_now)
    assert blocks.get(worker_a) == 4
    assert blocks.get(worker_b) == 3

    sequences.free("req-a", decay_now)
    sequences.assert_consistent()
    assert_completely_drained(sequences, decay_now)


def test_force_expiry_clears_block_membership_index(clock: FakeClock) -> None:
    sequences = make_multi_sequences(clock)
    worker = w(1, 0)

    add_request(sequences, req("req-1", worker, [1, 2, 3], tracking_hint(12)), clock.now())

    clock.advance(331)
    sequences.force_expire_requests_across_all_workers()

    assert not request_ranks(sequences)  # request index empty
    assert is_membership_empty(sequences)
    assert sequences.active_blocks().get(worker) == 0
    assert active_request_count(sequences, worker) == 0
    sequences.assert_consistent()


def test_disabled_expiry_requires_explicit_cleanup_for_all_workers(clock: FakeClock) -> None:
    sequences = new_without_expiry(None, 4, {1: (0, 1)}, False, 0, clock=clock.now)
    initial_worker, dynamic_worker = w(1, 0), w(2, 0)
    sequences.register_worker(WorkerDpRange(2, 0, 1))

    for request_id, token_sequence, worker in [
        ("initial", [1, 2], initial_worker),
        ("dynamic", [3], dynamic_worker),
    ]:
        add_request(
            sequences, req(request_id, worker, token_sequence, tracking_hint(4)), clock.now()
        )

    clock.advance(331)
    sequences.force_expire_requests_across_all_workers()

    assert active_request_count(sequences, initial_worker) == 1
    assert active_request_count(sequences, dynamic_worker) == 1
    assert sequences.active_blocks().get(initial_worker) == 2
    assert sequences.active_blocks().get(dynamic_worker) == 1

    now = clock.now()
    sequences.free("initial", now)
    sequences.free("dynamic", now)
    sequences.assert_consistent()
    assert_completely_drained(sequences, now)


def test_expiry_then_immediate_readd_preserves_block_membership(clock: FakeClock) -> None:
    sequences = make_sequences(clock)
    worker = w(1, 0)

    add_request(sequences, req("req-1", worker, [1, 2, 3], tracking_hint(12)), clock.now())

    clock.advance(331)

    add_request(sequences, req("req-2", worker, [1, 2, 3], tracking_hint(12)), clock.now())

    assert not is_membership_empty(sequences)
    assert sequences.active_blocks().get(worker) == 3

    assert_matches_naive(sequences, [1, 2, 3], PrefillTokenDeltas.none(), clock.now())
    sequences.assert_consistent()


def test_worker_removal_then_readd_starts_with_empty_registry_state(clock: FakeClock) -> None:
    sequences = make_sequences(clock)
    worker = w(1, 0)
    decay_now = clock.now()

    add_request(sequences, req("req-1", worker, [1, 2, 3], None, track=False), decay_now)

    assert active_request_count(sequences, worker) == 1
    sequences.reconcile_workers([])
    assert is_membership_empty(sequences)
    assert sequences.active_blocks() == {}
    assert worker not in active_request_counts(sequences)
    assert not request_ranks(sequences)

    sequences.reconcile_workers([WorkerDpRange(1, 0, 1)])
    assert sequences.active_blocks().get(worker) == 0
    assert active_request_count(sequences, worker) == 0
    assert is_membership_empty(sequences)
    sequences.assert_consistent()


def test_strict_add_after_worker_removal_cannot_recreate_worker(clock: FakeClock) -> None:
    # The seed races the add against the removal with two barriers; the core is synchronous, so
    # the interleaving that matters (removal first, then the strict add) is run in order.
    sequences = make_sequences(clock)
    worker = w(1, 0)

    sequences.reconcile_workers([])
    with pytest.raises(WorkerNotFound) as err:
        add_request_if_registered(
            sequences, req("req-1", worker, [1, 2, 3], None, track=False), clock.now()
        )

    assert err.value.worker == worker
    assert sequences.num_ranks() == 0
    assert not request_ranks(sequences)
    assert is_membership_empty(sequences)
    sequences.assert_consistent()


def test_free_is_idempotent_after_request_is_removed(clock: FakeClock) -> None:
    sequences = make_sequences(clock)
    worker = w(1, 0)
    request_id = "req-1"
    decay_now = clock.now()

    add_request(sequences, req(request_id, worker, [1, 2, 3], None, track=False), decay_now)

    sequences.free(request_id, decay_now)
    sequences.free(request_id, decay_now)

    sequences.assert_consistent()
    assert_completely_drained(sequences, decay_now)


def test_free_cleans_stale_request_mapping_when_worker_slot_is_missing(clock: FakeClock) -> None:
    sequences = make_sequences(clock)
    worker = w(1, 0)
    request_id = "stale-request"

    # Like the seed: map the id in the request index, then swap in an empty worker table
    # without applying the topology change (so the mapping is left stale).
    sequences.reconcile_workers([])
    sequences.index_request(request_id, worker, "adapter")
    assert sequences.worker_for(request_id) == worker and sequences.num_ranks() == 0

    sequences.free(request_id, clock.now())

    assert not request_ranks(sequences)
    assert not request_loras(sequences)
    assert sequences.get_active_lora_counts() == {}


def test_explicit_decay_time_drives_multi_worker_load_queries_consistently(
    clock: FakeClock,
) -> None:
    sequences = make_sequences(clock)
    worker = w(1, 0)
    start = clock.now()

    add_request(
        sequences,
        req("req-1", worker, [1, 2, 3], PrefillLoadHint(100, 10 * S)),
        start,
    )

    decay_now = start + 5 * S
    assert sequences.active_tokens(decay_now).get(worker) == 50

    _, potential_tokens, _ = potential_blocks_and_tokens(
        sequences, None, PrefillTokenDeltas.none(), decay_now
    )
    assert potential_tokens.get(worker) == 50

    assert any_worker_matches_active_tokens(
        sequences, decay_now, lambda candidate, tokens: candidate == worker and tokens == 50
    )


# --------------------------------------------------------------------------------------------
# SPEC §9.3 scenarios not fully covered by the seed ports above
# (M01 = topology observations, M15 = prefix-not-set, M21-M24 and M26-M28 are seed ports)
# --------------------------------------------------------------------------------------------


def test_m02_range_validation_and_strictness(clock: FakeClock) -> None:
    sequences = make(clock, {})

    with pytest.raises(InvalidDpSize) as err:
        sequences.register_worker(WorkerDpRange(1, 0, 0))
    assert str(err.value) == "dp_size must be greater than 0 for worker 1"

    with pytest.raises(InvalidDpRange) as err:
        sequences.register_worker(WorkerDpRange(1, 4294967295, 1))
    assert str(err.value) == "dp range overflows u32 for worker 1: start=4294967295 size=1"
    assert sequences.num_ranks() == 0
    assert not sequences.has_registered_workers()

    change = sequences.register_worker(WorkerDpRange(1, 2, 2))
    assert set(change.added) == {w(1, 2), w(1, 3)}
    assert change.removed == []

    with pytest.raises(DuplicateWorker) as err:
        sequences.register_worker(WorkerDpRange(1, 2, 2))
    assert str(err.value) == "worker 1 is already registered"

    change = sequences.unregister_worker(1)
    assert set(change.removed) == {w(1, 2), w(1, 3)}
    assert len(change.removed) == 2
    assert not sequences.has_registered_workers()

    with pytest.raises(WorkerIdNotRegistered) as err:
        sequences.unregister_worker(1)
    assert str(err.value) == "worker 1 is not registered"

    change = sequences.register_worker(WorkerDpRange(2, 4294967294, 1))
    assert change.added == [w(2, 4294967294)]
    assert sequences.active_blocks() == {w(2, 4294967294): 0}
    sequences.assert_consistent()


def test_m03_expansion_and_sorting(clock: FakeClock) -> None:
    sequences = make(clock, {7: (2, 3), 9: (0, 1)})
    assert sequences.active_blocks() == {w(7, 2): 0, w(7, 3): 0, w(7, 4): 0, w(9, 0): 0}
    assert sequences.worker_ranges() == [WorkerDpRange(7, 2, 3), WorkerDpRange(9, 0, 1)]
    sequences.assert_consistent()


def test_m04_upsert_keeps_unrelated_lazy_slots(clock: FakeClock) -> None:
    rec = RecordingPublisher()
    sequences = make(clock, {1: (0, 1)}, rec)
    assert rec.registered == [w(1, 0)]
    rec.clear()

    add_request(sequences, req("x", w(2, 0), [5]), clock.now())
    assert rec.registered == [w(2, 0)]

    rec.clear()
    change = sequences.upsert_worker(WorkerDpRange(1, 0, 2))
    assert rec.registered == [w(1, 1)]
    assert rec.removed == []
    assert change.added == [w(1, 1)]
    assert change.removed == []
    assert set(sequences.active_blocks()) == {w(1, 0), w(1, 1), w(2, 0)}
    assert sequences.active_blocks()[w(2, 0)] == 1
    assert sequences.worker_ranges() == [WorkerDpRange(1, 0, 2)]

    rec.clear()
    change = sequences.upsert_worker(WorkerDpRange(1, 0, 2))
    assert change.is_empty()
    assert rec.registered == []
    assert rec.removed == []
    sequences.assert_consistent()


def test_m05_upsert_removes_same_id_lazy_slot_outside_range(clock: FakeClock) -> None:
    rec = RecordingPublisher()
    sequences = make(clock, {}, rec)

    add_request(sequences, req("y", w(1, 5), [7]), clock.now())
    assert rec.registered == [w(1, 5)]
    assert not sequences.has_registered_workers()
    assert sequences.worker_ranges() == []

    rec.clear()
    change = sequences.upsert_worker(WorkerDpRange(1, 0, 2))
    assert rec.removed == [w(1, 5)]
    assert rec.registered == [w(1, 0), w(1, 1)]
    assert change.removed == [w(1, 5)]
    assert change.added == [w(1, 0), w(1, 1)]
    assert sequences.active_blocks() == {w(1, 0): 0, w(1, 1): 0}
    assert is_membership_empty(sequences)

    rec.clear()
    sequences.free("y", clock.now())  # no-op
    assert rec.single_loads == []
    with pytest.raises(RequestNotFound) as err:
        sequences.mark_prefill_completed("y", clock.now())
    assert str(err.value) == "Request y not found"
    sequences.assert_consistent()


def test_m06_register_retains_lazy_slot_inside_range(clock: FakeClock) -> None:
    rec = RecordingPublisher()
    sequences = make(clock, {}, rec)

    add_request(sequences, req("z", w(3, 0), [1, 2]), clock.now())
    assert rec.registered == [w(3, 0)]

    rec.clear()
    change = sequences.register_worker(WorkerDpRange(3, 0, 1))
    assert change.is_empty()
    assert rec.registered == []
    assert rec.removed == []
    assert sequences.active_blocks()[w(3, 0)] == 2
    sequences.mark_prefill_completed("z", clock.now())
    assert sequences.worker_ranges() == [WorkerDpRange(3, 0, 1)]
    sequences.assert_consistent()


def test_m07_unregister_of_a_lazy_only_id(clock: FakeClock) -> None:
    sequences = make(clock, {})
    add_request(sequences, req("v", w(4, 0), [1]), clock.now())

    with pytest.raises(WorkerIdNotRegistered) as err:
        sequences.unregister_worker(4)
    assert str(err.value) == "worker 4 is not registered"
    assert sequences.active_blocks() == {w(4, 0): 1}
    assert sequences.worker_for("v") == w(4, 0)
    sequences.assert_consistent()


def _m08_setup(clock: FakeClock) -> tuple[ActiveSequencesMultiWorker, RecordingPublisher]:
    rec = RecordingPublisher()
    sequences = make(clock, {1: (0, 1), 2: (0, 1)}, rec)
    add_request(sequences, req("l", w(9, 0), [3]), clock.now())
    add_request(sequences, req("r1", w(1, 0), [1, 2, 3]), clock.now())

    rec.clear()
    change = sequences.reconcile_workers([WorkerDpRange(1, 0, 1), WorkerDpRange(3, 0, 1)])
    assert rec.registered == [w(3, 0)]
    assert set(rec.removed) == {w(2, 0), w(9, 0)}
    assert len(rec.removed) == 2
    assert change.added == [w(3, 0)]
    assert set(change.removed) == {w(2, 0), w(9, 0)}
    return sequences, rec


def test_m08_reconcile(clock: FakeClock) -> None:
    sequences, rec = _m08_setup(clock)

    assert sequences.active_blocks() == {w(1, 0): 3, w(3, 0): 0}
    rec.clear()
    sequences.free("l", clock.now())  # no-op: its worker was removed
    assert rec.single_loads == []
    assert rec.events == []
    assert sequences.worker_for("l") is None
    assert sequences.worker_ranges() == [WorkerDpRange(1, 0, 1), WorkerDpRange(3, 0, 1)]
    assert sequences.worker_for("r1") == w(1, 0)
    sequences.assert_consistent()


def test_m09_reconcile_validation_is_atomic(clock: FakeClock) -> None:
    sequences, rec = _m08_setup(clock)
    rec.clear()

    def snapshot():
        return (
            sequences.active_blocks(),
            sequences.worker_ranges(),
            dict(request_ranks(sequences)),
            active_request_counts(sequences),
        )

    before = snapshot()
    with pytest.raises(DuplicateWorker) as err:
        sequences.reconcile_workers([WorkerDpRange(1, 0, 1), WorkerDpRange(1, 0, 2)])
    assert str(err.value) == "worker 1 is already registered"
    assert snapshot() == before

    with pytest.raises(InvalidDpSize) as err:
        sequences.reconcile_workers([WorkerDpRange(5, 0, 0)])
    assert str(err.value) == "dp_size must be greater than 0 for worker 5"
    assert snapshot() == before

    assert rec.registered == []
    assert rec.removed == []
    sequences.assert_consistent()


def test_m10_duplicate_request_across_workers(clock: FakeClock) -> None:
    sequences = make(clock, {1: (0, 1), 2: (0, 1)})
    add_request(sequences, req("r1", w(1, 0), [1, 2, 3]), clock.now())

    with pytest.raises(DuplicateRequest) as err:
        add_request(sequences, req("r1", w(2, 0), [1, 2, 3]), clock.now())
    assert str(err.value) == (
        "Request r1 already exists (assigned to worker "
        "WorkerWithDpRank { worker_id: 1, dp_rank: 0 })"
    )
    assert err.value.worker == w(1, 0)
    assert sequences.active_blocks() == {w(1, 0): 3, w(2, 0): 0}
    assert sequences.worker_for("r1") == w(1, 0)
    sequences.assert_consistent()


def test_m11_strict_add_never_creates_slots(clock: FakeClock) -> None:
    sequences = make(clock, {1: (0, 1)})

    with pytest.raises(WorkerNotFound) as err:
        add_request_if_registered(sequences, req("r", w(1, 1), [1, 2, 3]), clock.now())
    assert str(err.value) == "Worker WorkerWithDpRank { worker_id: 1, dp_rank: 1 } not found"
    assert set(sequences.active_blocks()) == {w(1, 0)}
    assert not request_ranks(sequences)

    sequences.reconcile_workers([])
    with pytest.raises(WorkerNotFound) as err:
        add_request_if_registered(sequences, req("r", w(1, 0), [1, 2, 3]), clock.now())
    assert str(err.value) == "Worker WorkerWithDpRank { worker_id: 1, dp_rank: 0 } not found"
    assert sequences.num_ranks() == 0
    assert not request_ranks(sequences)
    assert is_membership_empty(sequences)
    sequences.assert_consistent()


def _m12_setup(clock: FakeClock) -> tuple[ActiveSequencesMultiWorker, RecordingPublisher]:
    rec = RecordingPublisher()
    sequences = make(clock, {1: (0, 1)}, rec, replica_sync=True, router_id=7)
    rec.clear()
    return sequences, rec


def test_m12_publication_and_idempotent_free(clock: FakeClock) -> None:
    sequences, rec = _m12_setup(clock)
    t = clock.now()

    add_request(sequences, req("r", w(1, 0), [1, 2, 3], tracking_hint(12)), t)
    assert rec.observations == [(w(1, 0), 3, 12)]
    assert rec.worker_types == ["test"]
    assert rec.single_loads == [ActiveLoad(1, 0, 3, 12, kv_used_blocks=None)]
    assert len(rec.events) == 1
    ev = rec.events[0]
    assert (ev.request_id, ev.worker, ev.router_id, ev.lora_name) == ("r", w(1, 0), 7, None)
    assert ev.data == AddRequest([1, 2, 3], True, None, tracking_hint(12))

    rec.clear()
    sequences.free("r", t)
    assert rec.observations == [(w(1, 0), 0, 0)]
    assert rec.single_loads == [ActiveLoad(1, 0, 0, 0, None)]
    assert len(rec.events) == 1
    assert rec.events[0].data == FREE
    assert (rec.events[0].request_id, rec.events[0].worker, rec.events[0].router_id) == (
        "r",
        w(1, 0),
        7,
    )

    rec.clear()
    sequences.free("r", t)
    assert rec.single_loads == []
    assert rec.observations == []
    assert rec.events == []
    sequences.assert_consistent()
    assert_completely_drained(sequences, t)


def test_m13_mark_semantics(clock: FakeClock) -> None:
    sequences, rec = _m12_setup(clock)
    t = clock.now()

    add_request(sequences, req("r", w(1, 0), [1, 2, 3], tracking_hint(12)), t)
    rec.clear()
    sequences.mark_prefill_completed("r", t)
    sequences.mark_prefill_completed("r", t)
    assert [e.data for e in rec.events] == [MARK_PREFILL_COMPLETED, MARK_PREFILL_COMPLETED]
    assert all(e.request_id == "r" and e.router_id == 7 for e in rec.events)
    assert rec.single_loads == [ActiveLoad(1, 0, 3, 0, None), ActiveLoad(1, 0, 3, 0, None)]

    sequences.free("r", t)
    rec.clear()
    with pytest.raises(RequestNotFound) as err:
        sequences.mark_prefill_completed("r", t)
    assert str(err.value) == "Request r not found"
    assert rec.events == []
    assert rec.single_loads == []
    sequences.assert_consistent()


def test_m14_output_blocks_are_local(clock: FakeClock) -> None:
    rec = RecordingPublisher()
    sequences = make(clock, {1: (0, 1)}, rec, replica_sync=True)

    with pytest.raises(RequestNotFound) as err:
        sequences.add_output_block("nope", None)
    assert str(err.value) == "Request nope not found"

    add_request(sequences, req("r", w(1, 0), [1, 2]), clock.now())
    rec.clear()
    sequences.add_output_block("r", 0.5)
    assert len(rec.single_loads) == 1
    assert rec.single_loads[0].active_decode_blocks == 2  # 3 blocks x 0.5 = 1.5 -> 2
    assert rec.single_loads[0].kv_used_blocks is None
    assert rec.events == []
    assert sequences.active_blocks() == {w(1, 0): 2}
    sequences.assert_consistent()


def test_m16_index_vs_naive_explicit_numbers(clock: FakeClock) -> None:
    sequences = make_multi_sequences(clock)
    a, b = w(1, 0), w(2, 0)
    t = clock.now()
    add_request(sequences, req("req-a", a, [1, 2, 3], tracking_hint(12)), t)
    sequences.add_output_block("req-a", 0.5)
    sequences.mark_prefill_completed("req-a", t)
    add_request(sequences, req("req-b", b, [1, 2, 4], tracking_hint(12)), t)

    deltas = PrefillTokenDeltas.new(16, {a: 8, b: 12})
    blocks, tokens = assert_matches_naive(sequences, [1, 2, 3, 5], deltas, t)
    assert blocks == {a: 3, b: 5}
    assert tokens == {a: 8, b: 24}
    projections = sequences.project_worker_loads([1, 2, 3, 5], t)
    assert projections == {a: WorkerLoadProjection(0, 2, 1), b: WorkerLoadProjection(12, 3, 2)}
    assert projections[a].potential_decode_blocks() == 3
    assert projections[b].potential_decode_blocks() == 5


def test_m17_unit_block_size_appendix_a_hashes(clock: FakeClock) -> None:
    # the reference's u64 values, kept signed by the service
    prompt_a = signed_hashes([11011797887259449313, 5194970134674063120, 6904579805665688752])
    prompt_b = signed_hashes([11011797887259449313, 5194970134674063120, 12884792542360926810])
    assert seq_hashes_for_tokens([7, 7, 7], block_size=1) == prompt_a
    assert seq_hashes_for_tokens([7, 7, 8], block_size=1) == prompt_b

    sequences = make_multi_sequences(clock, block_size=1)
    a, b = w(1, 0), w(2, 0)
    t = clock.now()
    add_request(sequences, req("A", a, prompt_a), t)
    add_request(sequences, req("B", b, prompt_b), t)
    blocks, _ = assert_matches_naive(sequences, prompt_b, PrefillTokenDeltas.none(), t)
    assert blocks == {a: 4, b: 3}
    sequences.free("B", t)
    blocks, _ = assert_matches_naive(sequences, prompt_b, PrefillTokenDeltas.none(), t)
    assert blocks == {a: 4, b: 3}
    sequences.free("A", t)
    sequences.assert_consistent()
    assert_completely_drained(sequences, t)


def test_m18_lora_hashes_do_not_cross_match_appendix_a(clock: FakeClock) -> None:
    base = signed_hashes([14643705804678351452, 4945711292740353085])  # u64, kept signed
    lora = signed_hashes([11381080598872079209, 17518568667535815909])
    assert seq_hashes_for_tokens([1, 2, 3, 4, 5, 6, 7, 8]) == base
    assert seq_hashes_for_tokens([1, 2, 3, 4, 5, 6, 7, 8], "adapter-a") == lora

    sequences = make_multi_sequences(clock)
    a, b = w(1, 0), w(2, 0)
    t = clock.now()
    add_request(sequences, req("base", a, base), t)
    add_request(sequences, req("lora", b, lora, lora="adapter-a"), t)
    blocks, tokens = assert_matches_naive(sequences, base, PrefillTokenDeltas.none(), t)
    assert blocks == {a: 2, b: 4}
    assert tokens == {a: 0, b: 0}


def test_m19_lora_counts(clock: FakeClock) -> None:
    sequences = make(clock, {1: (0, 1)})
    t = clock.now()
    add_request(sequences, req("r1", w(1, 0), [1], lora="a"), t)
    add_request(sequences, req("r2", w(1, 0), [2], lora="a"), t)
    add_request(sequences, req("r3", w(1, 0), [3], lora="b"), t)
    add_request(sequences, req("r4", w(1, 0), [4]), t)
    assert sequences.get_active_lora_counts() == {"a": 2, "b": 1}

    sequences.free("r1", t)
    assert sequences.get_active_lora_counts() == {"a": 1, "b": 1}

    sequences.reconcile_workers([])
    assert sequences.get_active_lora_counts() == {}
    sequences.assert_consistent()


def test_m20_include_active_requests(clock: FakeClock) -> None:
    sequences = make(clock, {1: (0, 1)})
    t = clock.now()
    add_request(sequences, req("r1", w(1, 0), [1, 2]), t)
    add_request(sequences, req("r2", w(1, 0), [3]), t)

    *_, requests = potential_blocks_and_tokens(sequences, None, PrefillTokenDeltas.none(), t)
    assert requests is None
    *_, requests = potential_blocks_and_tokens(
        sequences, None, PrefillTokenDeltas.none(), t, include_active_requests=True
    )
    assert requests == {w(1, 0): 2}


def test_m25_sweep_publication(clock: FakeClock) -> None:
    rec = RecordingPublisher()
    sequences = make(clock, {1: (0, 1), 2: (0, 1)}, rec)
    add_request(sequences, req("r", w(1, 0), [1, 2, 3], tracking_hint(12)), clock.now())
    rec.clear()

    clock.advance(331)
    expired = sequences.force_expire_requests_across_all_workers()

    assert expired == ["r"]
    assert rec.single_loads == [ActiveLoad(1, 0, 0, 0, None)]
    assert rec.observations == [(w(1, 0), 0, 0)]
    assert rec.load_batches == []
    assert not request_ranks(sequences)
    assert is_membership_empty(sequences)
    assert active_request_counts(sequences)[w(1, 0)] == 0
    sequences.assert_consistent()


def test_m29_lazy_creation_on_local_add(clock: FakeClock) -> None:
    rec = RecordingPublisher()
    sequences = make(clock, {}, rec)
    assert rec.registered == []

    add_request(sequences, req("r", w(5, 3), [1]), clock.now())
    assert rec.registered == [w(5, 3)]
    assert sequences.active_blocks() == {w(5, 3): 1}
    assert sequences.worker_ranges() == []
    assert not sequences.has_registered_workers()
    sequences.assert_consistent()


def test_the_tracker_counts_every_add_free_and_swept_expiry(clock: FakeClock) -> None:
    """The per-key counters behind ``kv_slot_tracker_requests_{added,freed,expired}``: local
    and replicated adds and frees alike, expiries only in a sweep."""
    counts = LifecycleCounts()
    t = new_tracker(None, 4, {1: (0, 1)}, router_id=1, clock=clock.now, counts=counts)
    w = WorkerWithDpRank(1, 0)
    now = clock.now()
    add_request(t, SequenceRequest("local", w, [1, 2]), now)
    effects = ReplicaEffects()
    peer_add = AddRequest([3], False, None, None)
    assert t.apply_replica_event(ActiveSequenceEvent("peer", w, peer_add, 2), effects)
    with pytest.raises(DuplicateRequest):
        add_request(t, SequenceRequest("local", w, [9]), now)  # refused: not counted
    assert counts == LifecycleCounts(added=2, freed=0, expired=0)

    assert t.free("local", now) and not t.free("local", now)  # the second is a no-op
    assert t.apply_replica_event(ActiveSequenceEvent("peer", w, FREE, 2), effects)
    assert not t.apply_replica_event(ActiveSequenceEvent("peer", w, FREE, 2), effects)
    assert t.apply_replica_event(ActiveSequenceEvent("own", w, peer_add, 1), effects) is False
    assert counts == LifecycleCounts(added=2, freed=2, expired=0)

    add_request(t, SequenceRequest("old", w, [4]), now)
    clock.advance(301)
    assert t.force_expire_requests_across_all_workers() == ["old"]
    assert counts == LifecycleCounts(added=3, freed=2, expired=1)
    assert t.counts is counts
