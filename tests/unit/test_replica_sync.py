"""Replica sync on the tracker side: the apply loop, batched side effects and event emission.

Ports of [seed-MW] (``shared/seeds/000_51f9568cca4a8b78.txt``) ``replica_sync_*`` tests with the
seeds' numbers, plus SPEC §9.4 R13/R14 and the §6.1 emission rules (§9.3 M12-M14 style). The
tracker clock is a ``FakeClock`` that only moves when a test advances it (the seeds' paused clock).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import pytest

from kv_slot_tracker.core.commands import Add
from kv_slot_tracker.core.errors import DuplicateRequest, RequestNotFound, WorkerNotFound
from kv_slot_tracker.core.events import (
    FREE,
    MARK_PREFILL_COMPLETED,
    ActiveSequenceEvent,
    AddRequest,
)
from kv_slot_tracker.core.tracker import (
    ActiveSequencesMultiWorker,
    ReplicaWorkerPolicy,
    SequencePublisher,
)
from kv_slot_tracker.core.types import (
    ActiveLoad,
    PrefillLoadHint,
    WorkerDpRange,
    WorkerWithDpRank,
)
from tests.fakes import FakeClock
from tests.support.recording import RecordingPublisher, modeled_hint, tracking_hint
from tests.support.replica_runtime import (
    PENDING,
    Cancel,
    ReceiveError,
    run_replica_sync,
    start_replica_sync,
    sync_counts,
)
from tests.support.tracker import (
    ModeledPrefillTimeLoad,
    SequenceRequest,
    active_request_counts,
    add_request,
    add_request_if_registered,
    is_membership_empty,
    modeled_remaining_prefill_time_loads_at,
    new_tracker,
    request_ranks,
)

W1 = WorkerWithDpRank(1, 0)
W2 = WorkerWithDpRank(2, 0)

Item = ActiveSequenceEvent | ReceiveError


# -- subscriber fakes (the seeds' VecSubscriber / ChannelSubscriber / CancelOnPollSubscriber) --


class VecSubscriber:
    """Every item is available at once; an exhausted list reads as a closed stream."""

    def __init__(self, items: list[Item]) -> None:
        self._items: deque[Item] = deque(items)

    async def next_event(self) -> Item | None:
        return self._items.popleft() if self._items else None

    def try_next_event(self) -> Item | None:
        return self._items.popleft() if self._items else None


class ChannelSubscriber:
    """An open channel: ``next_event`` waits for a send; ``try_next_event`` is PENDING if empty."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        # set while the loop waits in next_event on an empty channel, cleared by a send
        self.idle = asyncio.Event()

    def send(self, item: Item) -> None:
        self.idle.clear()
        self._queue.put_nowait(item)

    async def next_event(self) -> Item | None:
        if self._queue.empty():
            self.idle.set()
        return await self._queue.get()

    def try_next_event(self) -> object:
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return PENDING


class CancelOnPollSubscriber:
    """Yields one event; polling for another cancels the loop's token and reports PENDING."""

    def __init__(self, event: ActiveSequenceEvent, cancel: Cancel) -> None:
        self._event: ActiveSequenceEvent | None = event
        self._cancel = cancel

    async def next_event(self) -> Item | None:
        event, self._event = self._event, None
        return event

    def try_next_event(self) -> object:
        self._cancel.cancel()
        return PENDING


# -- helpers --------------------------------------------------------------------------------


def replica_add(
    request_id: str,
    worker: WorkerWithDpRank,
    token_sequence: list[int],
    hint: PrefillLoadHint | None = None,
    router_id: int = 99,
) -> ActiveSequenceEvent:
    data = AddRequest(token_sequence, True, None, hint or tracking_hint(12))
    return ActiveSequenceEvent(request_id, worker, data, router_id, None)


def replica_free(
    request_id: str, payload_worker: WorkerWithDpRank, router_id: int = 99
) -> ActiveSequenceEvent:
    return ActiveSequenceEvent(request_id, payload_worker, FREE, router_id, None)


def replica_mark(request_id: str, payload_worker: WorkerWithDpRank) -> ActiveSequenceEvent:
    return ActiveSequenceEvent(request_id, payload_worker, MARK_PREFILL_COMPLETED, 99, None)


def make_recording_tracker(
    workers: dict[int, tuple[int, int]], clock: FakeClock, router_id: int = 0
) -> tuple[ActiveSequencesMultiWorker, RecordingPublisher]:
    publisher = RecordingPublisher()
    tracker = new_tracker(
        publisher, 4, workers, replica_sync=True, router_id=router_id, clock=clock.now
    )
    return tracker, publisher


def make_noop_tracker(
    workers: dict[int, tuple[int, int]],
    clock: FakeClock,
    policy: ReplicaWorkerPolicy = ReplicaWorkerPolicy.LAZY_REGISTER,
) -> ActiveSequencesMultiWorker:
    return new_tracker(
        None,
        4,
        workers,
        replica_sync=True,
        router_id=0,
        clock=clock.now,
        replica_worker_policy=policy,
    )


async def replica(tracker: ActiveSequencesMultiWorker, *items: Item) -> None:
    """Run the apply loop over events that are all available now, until the stream closes."""
    await asyncio.wait_for(run_replica_sync(tracker, VecSubscriber(list(items)), Cancel()), 5.0)


def modeled_time_by_worker(
    tracker: ActiveSequencesMultiWorker, now: int
) -> dict[WorkerWithDpRank, object]:
    loads: list[ModeledPrefillTimeLoad] = modeled_remaining_prefill_time_loads_at(tracker, now)
    return {load.worker: load.modeled_remaining_prefill_time_ms for load in loads}


# -- seed tests -----------------------------------------------------------------------------


async def test_replica_sync_coalesces_latest_load_wake_and_cleanup() -> None:
    tracker, publisher = make_recording_tracker({1: (0, 1)}, FakeClock())

    await replica(
        tracker,
        replica_add("req-1", W1, [1, 2, 3]),
        replica_add("req-2", W1, [4, 5, 6]),
        replica_mark("req-2", W1),
        replica_free("req-1", W1),
    )

    batches = publisher.load_batches
    assert len(batches) == 1
    assert len(batches[0]) == 1
    load = batches[0][0]
    assert (load.worker_id, load.dp_rank) == (1, 0)
    assert load.active_decode_blocks == 3
    assert load.active_prefill_tokens == 0
    assert load.kv_used_blocks is None
    assert publisher.single_loads == []
    assert sync_counts(tracker).wakes == 1
    assert sync_counts(tracker).cleanups == 1
    assert tracker.worker_for("req-2") == W1
    assert tracker.worker_for("req-1") is None
    assert active_request_counts(tracker).get(W1) == 1
    assert publisher.events == []  # applying a peer's events never re-publishes them


async def test_replica_sync_mark_only_batch_does_not_publish_load() -> None:
    tracker, publisher = make_recording_tracker({1: (0, 1)}, FakeClock())
    await replica(tracker, replica_add("req-1", W1, [1, 2, 3]))
    assert len(publisher.load_batches) == 1  # the add's batch, before clearing

    publisher.clear()
    wake_count_before = sync_counts(tracker).wakes
    await replica(tracker, replica_mark("req-1", W1), replica_mark("req-1", W1))

    assert publisher.load_batches == []
    assert publisher.single_loads == []
    assert publisher.observations == []
    assert sync_counts(tracker).wakes == wake_count_before + 1


async def test_replica_sync_free_uses_canonical_worker_for_collapsed_load() -> None:
    tracker, publisher = make_recording_tracker({1: (0, 1), 2: (0, 1)}, FakeClock())

    await replica(
        tracker,
        replica_add("req-1", W1, [1, 2, 3]),
        replica_free("req-1", W2),  # the payload names the wrong worker
    )

    batches = publisher.load_batches
    assert len(batches) == 1
    assert len(batches[0]) == 1
    assert (batches[0][0].worker_id, batches[0][0].dp_rank) == (1, 0)
    assert batches[0][0].active_decode_blocks == 0
    assert tracker.active_blocks().get(W1) == 0
    assert tracker.active_blocks().get(W2) == 0
    assert tracker.worker_for("req-1") is None


async def test_replica_sync_batch_cap_splits_deferred_side_effects() -> None:
    # The loop's 1 ms cap reads tracker.clock; the frozen FakeClock leaves only the 256-event cap.
    tracker, publisher = make_recording_tracker({1: (0, 1)}, FakeClock())

    await replica(tracker, *(replica_add(f"req-{i}", W1, [i]) for i in range(300)))

    batches = publisher.load_batches
    assert len(batches) == 2
    assert all(len(batch) == 1 for batch in batches)
    # first flush after exactly 256 applied adds (one block each), second after the other 44
    assert [batch[0].active_decode_blocks for batch in batches] == [256, 300]
    assert sync_counts(tracker).cleanups == 2
    assert sync_counts(tracker).wakes == 0


async def test_replica_sync_flushes_sparse_event_without_waiting_for_another() -> None:
    tracker, publisher = make_recording_tracker({1: (0, 1)}, FakeClock())
    subscriber = ChannelSubscriber()
    cancel = Cancel()
    task = start_replica_sync(tracker, subscriber, cancel)

    subscriber.send(replica_add("req-1", W1, [1, 2, 3]))

    # the loop took the event and now waits for another, which never comes: by then it has
    # flushed the one it applied
    await asyncio.wait_for(subscriber.idle.wait(), 10)  # a bound against a hang, not a figure
    assert publisher.load_batches == [[ActiveLoad(1, 0, 3, 12, None)]]

    cancel.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    assert task in done, "the loop should stop once cancelled"


async def test_replica_sync_receive_error_flushes_applied_prefix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tests.support.replica_runtime")
    tracker, publisher = make_recording_tracker({1: (0, 1)}, FakeClock())

    await replica(
        tracker,
        replica_add("req-1", W1, [1, 2, 3]),
        ReceiveError("synthetic receive error"),
    )

    batches = publisher.load_batches
    assert len(batches) == 1
    assert len(batches[0]) == 1
    assert tracker.worker_for("req-1") == W1
    assert any(
        "Error receiving active sequence event: synthetic receive error" in r.getMessage()
        for r in caplog.records
    )


async def test_replica_sync_cancellation_flushes_applied_prefix() -> None:
    tracker, publisher = make_recording_tracker({1: (0, 1)}, FakeClock())
    cancel = Cancel()
    subscriber = CancelOnPollSubscriber(replica_add("req-1", W1, [1, 2, 3]), cancel)

    await asyncio.wait_for(run_replica_sync(tracker, subscriber, cancel), 5.0)

    assert cancel.is_cancelled()
    batches = publisher.load_batches
    assert len(batches) == 1
    assert len(batches[0]) == 1
    assert tracker.worker_for("req-1") == W1


async def test_replica_sync_add_and_free_keep_block_membership_consistent() -> None:
    tracker = make_noop_tracker({1: (0, 1)}, FakeClock())

    await replica(tracker, replica_add("req-1", W1, [1, 2, 3]), replica_free("req-1", W1))

    assert request_ranks(tracker) == {}
    assert is_membership_empty(tracker)
    assert tracker.active_blocks().get(W1) == 0
    assert active_request_counts(tracker).get(W1, 0) == 0
    tracker.assert_consistent()


async def test_replica_prefill_completion_reaches_the_potential_loads() -> None:
    """A peer's prefill completion changes the rank's potential prefill tokens at once, also
    after a query has read the rank (the load columns are kept between queries)."""
    clock = FakeClock()
    tracker = make_noop_tracker({1: (0, 1)}, clock)

    await replica(tracker, replica_add("req-1", W1, [1, 2, 3]))
    assert tracker.potential_loads([1, 2], 5, clock.now()) == [(1, 0, 12 + 5, 3 + 2 - 2, 1)]
    tracker.assert_consistent()

    await replica(tracker, replica_mark("req-1", W1))
    tracker.assert_consistent()
    assert tracker.potential_loads([1, 2], 5, clock.now()) == [(1, 0, 5, 3, 1)]


async def test_replica_sync_modeled_remaining_prefill_time_uses_receive_time_and_clears() -> None:
    clock = FakeClock()
    tracker = make_noop_tracker({1: (0, 1)}, clock)

    await replica(tracker, replica_add("req-1", W1, [1, 2, 3], modeled_hint(12, 10)))
    assert modeled_time_by_worker(tracker, clock.now()).get(W1) == 10_000

    await replica(tracker, replica_mark("req-1", W1))
    assert modeled_time_by_worker(tracker, clock.now()).get(W1) == 0

    await replica(tracker, replica_add("req-2", W1, [4, 5, 6], modeled_hint(12, 6)))
    assert modeled_time_by_worker(tracker, clock.now()).get(W1) == 6_000

    await replica(tracker, replica_free("req-2", W1))
    assert modeled_time_by_worker(tracker, clock.now()).get(W1) == 0


async def test_replica_sync_nonanchor_free_applies_receive_time_anchor_credit() -> None:
    clock = FakeClock()
    tracker = make_noop_tracker({1: (0, 1)}, clock)

    await replica(
        tracker,
        replica_add("oldest", W1, [1, 2, 3], modeled_hint(100, 10)),
        replica_add("later", W1, [4, 5, 6], modeled_hint(40, 4)),
    )

    clock.advance(5)
    completion_time = clock.now()
    assert modeled_time_by_worker(tracker, completion_time).get(W1) == 9_000

    await replica(tracker, replica_free("later", W1))  # applied at the receive time (+5 s)

    assert modeled_time_by_worker(tracker, completion_time).get(W1) == 9_000


async def test_replica_sync_add_lazily_registers_missing_worker() -> None:
    tracker = make_noop_tracker({}, FakeClock())

    await replica(tracker, replica_add("req-1", W1, [1, 2, 3]))

    assert tracker.num_ranks() == 1
    assert tracker.worker_for("req-1") == W1
    assert not is_membership_empty(tracker)
    assert tracker.active_blocks().get(W1) == 3
    assert tracker.worker_ranges() == []  # a lazily created slot is not a registration
    assert not tracker.has_registered_workers()


async def test_replica_sync_require_registered_drops_missing_worker() -> None:
    tracker = make_noop_tracker({}, FakeClock(), ReplicaWorkerPolicy.REQUIRE_REGISTERED)

    await replica(tracker, replica_add("req-1", W1, [1, 2, 3]))

    assert tracker.num_ranks() == 0
    assert tracker.worker_for("req-1") is None
    assert is_membership_empty(tracker)


async def test_replica_sync_require_registered_drops_event_after_worker_removal() -> None:
    tracker = make_noop_tracker({1: (0, 1)}, FakeClock(), ReplicaWorkerPolicy.REQUIRE_REGISTERED)
    tracker.reconcile_workers([])

    await replica(tracker, replica_add("req-1", W1, [1, 2, 3]))

    assert tracker.num_ranks() == 0
    assert tracker.worker_for("req-1") is None
    assert is_membership_empty(tracker)


# -- SPEC §9.4 R13 / R14 ----------------------------------------------------------------------


async def test_replica_sync_ignores_own_echo() -> None:
    # R13: an event carrying this tracker's own router id is not applied at all.
    tracker, publisher = make_recording_tracker({1: (0, 1)}, FakeClock(), router_id=5)

    await replica(tracker, replica_add("r", W1, [1, 2, 3], router_id=5))

    assert tracker.worker_for("r") is None
    assert tracker.active_blocks() == {W1: 0}
    assert publisher.load_batches == []
    assert sync_counts(tracker).cleanups == 0
    assert sync_counts(tracker).wakes == 0

    # the same event from a peer is applied (so the echo check is what made the difference)
    await replica(tracker, replica_add("r", W1, [1, 2, 3], router_id=6))
    assert tracker.worker_for("r") == W1
    assert tracker.active_blocks() == {W1: 3}


async def test_replica_sync_add_with_already_mapped_id_overwrites_mapping() -> None:
    # R14 (seed semantics; the 1.6.1 anchor ignores the second add, SPEC §10 D2).
    tracker = make_noop_tracker({1: (0, 1), 2: (0, 1)}, FakeClock())

    await replica(tracker, replica_add("r", W1, [1]), replica_add("r", W2, [2]))
    assert tracker.worker_for("r") == W2
    assert tracker.active_blocks() == {W1: 1, W2: 1}

    await replica(tracker, replica_free("r", W1))  # payload names w(1,0): the canonical w(2,0) wins
    assert tracker.worker_for("r") is None
    assert tracker.active_blocks() == {W1: 1, W2: 0}
    assert active_request_counts(tracker) == {W1: 1, W2: 0}  # the w(1,0) copy lingers


# -- SPEC §6.1 emission rules (§9.3 M12-M14) ----------------------------------------------------


def make_emitting_tracker(
    clock: FakeClock, replica_sync: bool = True
) -> tuple[ActiveSequencesMultiWorker, RecordingPublisher]:
    publisher = RecordingPublisher()
    tracker = new_tracker(
        publisher, 4, {1: (0, 1)}, replica_sync=replica_sync, router_id=7, clock=clock.now
    )
    return tracker, publisher


def test_add_and_free_enqueue_events_and_second_free_is_silent() -> None:
    # M12
    clock = FakeClock()
    tracker, publisher = make_emitting_tracker(clock)
    t = clock.now()

    add_request(
        tracker, SequenceRequest("r", W1, [1, 2, 3], prefill_load_hint=tracking_hint(12)), t
    )
    assert publisher.observations == [(W1, 3, 12)]
    assert publisher.single_loads == [ActiveLoad(1, 0, 3, 12, None)]
    assert publisher.events == [
        ActiveSequenceEvent("r", W1, AddRequest([1, 2, 3], True, None, PrefillLoadHint(12)), 7)
    ]

    tracker.free("r", t)
    assert publisher.single_loads[1:] == [ActiveLoad(1, 0, 0, 0, None)]
    assert publisher.events[1:] == [ActiveSequenceEvent("r", W1, FREE, 7, None)]

    tracker.free("r", t)
    assert len(publisher.single_loads) == 2
    assert len(publisher.events) == 2
    assert publisher.load_batches == []


def test_mark_emits_on_every_repeat_but_not_after_free() -> None:
    # M13
    clock = FakeClock()
    tracker, publisher = make_emitting_tracker(clock)
    t = clock.now()
    add_request(
        tracker, SequenceRequest("r", W1, [1, 2, 3], prefill_load_hint=tracking_hint(12)), t
    )
    publisher.clear()

    tracker.mark_prefill_completed("r", t)
    tracker.mark_prefill_completed("r", t)
    assert [e.data for e in publisher.events] == [MARK_PREFILL_COMPLETED, MARK_PREFILL_COMPLETED]
    assert all(
        e.request_id == "r" and e.worker == W1 and e.router_id == 7 for e in publisher.events
    )
    assert publisher.single_loads == [ActiveLoad(1, 0, 3, 0, None)] * 2

    tracker.free("r", t)
    publisher.clear()
    with pytest.raises(RequestNotFound, match="^Request r not found$"):
        tracker.mark_prefill_completed("r", t)
    assert publisher.events == []
    assert publisher.single_loads == []


def test_output_blocks_are_never_replicated() -> None:
    # M14
    clock = FakeClock()
    tracker, publisher = make_emitting_tracker(clock)
    with pytest.raises(RequestNotFound):
        tracker.add_output_block("nope", None)
    assert publisher.events == [] and publisher.single_loads == []

    add_request(tracker, SequenceRequest("r", W1, [1, 2], track_prefill_tokens=False), clock.now())
    publisher.clear()

    tracker.add_output_block("r", 0.5)
    assert len(publisher.single_loads) == 1
    assert publisher.single_loads[0].active_decode_blocks == 2  # 3 blocks x 0.5 = 1.5 -> 2
    assert publisher.events == []


def test_failed_operations_and_disabled_sync_emit_nothing() -> None:
    clock = FakeClock()
    tracker, publisher = make_emitting_tracker(clock)
    t = clock.now()
    add_request(tracker, SequenceRequest("r", W1, [1]), t)
    publisher.clear()

    with pytest.raises(DuplicateRequest):
        add_request(tracker, SequenceRequest("r", W1, [2]), t)
    with pytest.raises(WorkerNotFound):
        add_request_if_registered(tracker, SequenceRequest("s", WorkerWithDpRank(1, 1), [3]), t)
    tracker.free("unknown", t)
    assert publisher.events == []
    assert publisher.single_loads == []

    tracker.unregister_worker(1)  # topology changes tell no peer about the dropped request
    assert publisher.events == []

    off, off_publisher = make_emitting_tracker(clock, replica_sync=False)
    add_request(off, SequenceRequest("r", W1, [1]), t)
    off.mark_prefill_completed("r", t)
    off.free("r", t)
    assert off_publisher.events == []
    assert len(off_publisher.single_loads) == 3  # loads are still published


def test_events_carry_lora_and_strict_add_emits() -> None:
    clock = FakeClock()
    tracker, publisher = make_emitting_tracker(clock)
    t = clock.now()

    add_request_if_registered(
        tracker, SequenceRequest("r", W1, [1, 2], expected_output_tokens=5, lora_name="adapter"), t
    )
    tracker.mark_prefill_completed("r", t)
    tracker.free("r", t)

    assert publisher.events == [
        ActiveSequenceEvent("r", W1, AddRequest([1, 2], True, 5, None), 7, "adapter"),
        ActiveSequenceEvent("r", W1, MARK_PREFILL_COMPLETED, 7, "adapter"),
        ActiveSequenceEvent("r", W1, FREE, 7, "adapter"),
    ]


def test_an_add_command_is_read_as_given_and_replicates_its_resolved_values() -> None:
    """The tracker reads the API's add command itself: ``track_prefill_tokens`` None tracks
    the tokens when there are any, ``expected_prefill_ms`` replicates in nanoseconds, and
    prefill tokens not tracked still replicate as the hint sent (as the seeds' event carries)."""
    clock = FakeClock()
    tracker, publisher = make_emitting_tracker(clock)
    t = clock.now()
    auto = Add(
        model_name="m", request_id="a", worker_id=1, dp_rank=0, new_isl_tokens=12,
        expected_prefill_ms=1.5,
    )  # fmt: skip
    untracked = Add(
        model_name="m", request_id="u", worker_id=1, dp_rank=0, new_isl_tokens=30,
        expected_prefill_ms=2, track_prefill_tokens=False, expected_output_tokens=9,
        lora_name="adapter",
    )  # fmt: skip
    nothing = Add(model_name="m", request_id="n", worker_id=1, dp_rank=0, expected_prefill_ms=4)
    tracker.add_on_rank(auto, [1, 2], t)
    tracker.add_on_rank(untracked, [1, 3], t)
    tracker.add_on_rank(nothing, None, t)

    assert tracker.active_tokens(t) == {W1: 12}  # only the tracked request's tokens
    assert publisher.events == [
        ActiveSequenceEvent(
            "a", W1, AddRequest([1, 2], True, None, PrefillLoadHint(12, 1_500_000)), 7
        ),
        ActiveSequenceEvent(
            "u", W1, AddRequest([1, 3], False, 9, PrefillLoadHint(30, 2_000_000)), 7, "adapter"
        ),
        ActiveSequenceEvent("n", W1, AddRequest(None, False, None, None), 7),
    ]
    with pytest.raises(WorkerNotFound):  # the command's rank must exist
        tracker.add_on_rank(
            Add(model_name="m", request_id="x", worker_id=1, dp_rank=1), [1], clock.now()
        )


class StateCapturingPublisher(SequencePublisher):
    """Captures what the tracker looks like at the moment each event is enqueued."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.tracker: ActiveSequencesMultiWorker | None = None
        self.seen: list[tuple[str, WorkerWithDpRank | None, int, int]] = []

    def enqueue_event(self, event: ActiveSequenceEvent) -> None:
        assert self.tracker is not None
        kind = type(event.data).__name__
        self.seen.append(
            (
                kind,
                self.tracker.worker_for(event.request_id),
                self.tracker.active_blocks()[W1],
                self.tracker.active_tokens(self.clock.now())[W1],
            )
        )


def test_events_are_emitted_after_the_local_mutation() -> None:
    clock = FakeClock()
    publisher = StateCapturingPublisher(clock)
    tracker = new_tracker(
        publisher, 4, {1: (0, 1)}, replica_sync=True, router_id=7, clock=clock.now
    )
    publisher.tracker = tracker
    t = clock.now()

    add_request(
        tracker, SequenceRequest("r", W1, [1, 2, 3], prefill_load_hint=tracking_hint(12)), t
    )
    tracker.mark_prefill_completed("r", t)
    tracker.free("r", t)

    assert publisher.seen == [
        ("AddRequest", W1, 3, 12),
        ("MarkPrefillCompleted", W1, 3, 0),
        ("Free", None, 0, 0),
    ]


def test_add_request_on_missing_worker_is_lazy_and_emits_once() -> None:
    clock = FakeClock()
    tracker, publisher = make_emitting_tracker(clock)
    w = WorkerWithDpRank(5, 3)
    add_request(tracker, SequenceRequest("x", w, [1]), clock.now())
    assert publisher.registered[-1:] == [w]
    assert [e.worker for e in publisher.events] == [w]
    assert tracker.worker_ranges() == [WorkerDpRange(1, 0, 1)]
