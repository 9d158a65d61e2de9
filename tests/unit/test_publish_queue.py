"""Publish queue, singleton publisher and batch collection: the runtime-glue seed tests (SPEC §6.3).

Ports of [seed-RT] (``shared/seeds/001_7a71462dbe079ad1.txt``) ``active_sequence_*`` tests,
SPEC §9.5 Q01-Q06. Time is a ``FakeClock``; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from kv_slot_tracker.core.events import (
    FREE,
    MARK_PREFILL_COMPLETED,
    ActiveSequenceEvent,
    AddRequest,
    Free,
    MarkPrefillCompleted,
)
from kv_slot_tracker.core.tracker import ActiveSequencesMultiWorker, SequencePublisher
from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.replication.queue import (
    REPLICA_EVENT_CHANNEL_CAPACITY,
    EventQueue,
    PublishQueueClosed,
    PublishQueueFull,
)
from tests.fakes import FakeClock
from tests.support.replica_runtime import (
    MAX_REPLICA_BATCH_DURATION_NS,
    MAX_REPLICA_BATCH_EVENTS,
    collect_batch,
    drain,
    run_singleton_publisher,
    send_event,
)
from tests.support.tracker import SequenceRequest, add_request, new_tracker
from tests.support.wire import decode_batch, encode_batch

WORKER = WorkerWithDpRank(1, 0)


def free_event(request_id: str) -> ActiveSequenceEvent:
    return ActiveSequenceEvent(request_id, WORKER, FREE, 7, None)


def add_event(request_id: str) -> ActiveSequenceEvent:
    return ActiveSequenceEvent(request_id, WORKER, AddRequest(None, False, None, None), 7, None)


def mark_event(request_id: str) -> ActiveSequenceEvent:
    return ActiveSequenceEvent(request_id, WORKER, MARK_PREFILL_COMPLETED, 7, None)


def event_name(event: ActiveSequenceEvent) -> str:
    if isinstance(event.data, AddRequest):
        return "add"
    if isinstance(event.data, MarkPrefillCompleted):
        return "mark"
    assert isinstance(event.data, Free)
    return "free"


class QueuePublisher(SequencePublisher):
    """A runtime-like publisher: ``enqueue_event`` try-sends into a bounded ``EventQueue``."""

    def __init__(self, queue: EventQueue[ActiveSequenceEvent]) -> None:
        self.queue = queue

    def enqueue_event(self, event: ActiveSequenceEvent) -> None:
        send_event(self.queue, event)


def test_publish_queue_constants() -> None:
    assert REPLICA_EVENT_CHANNEL_CAPACITY == 100_000
    assert EventQueue().capacity == 100_000
    assert MAX_REPLICA_BATCH_EVENTS == 256
    assert MAX_REPLICA_BATCH_DURATION_NS == 1_000_000


def test_active_sequence_publish_sender_preserves_lifecycle_order() -> None:
    queue: EventQueue[ActiveSequenceEvent] = EventQueue(3)
    queue.try_send(add_event("ordered"))
    queue.try_send(mark_event("ordered"))
    queue.try_send(free_event("ordered"))

    received = [queue.try_recv() for _ in range(3)]
    assert [event_name(e) for e in received] == ["add", "mark", "free"]
    assert queue.try_recv() is None


def test_active_sequence_publish_sender_drops_newest_when_full() -> None:
    queue: EventQueue[ActiveSequenceEvent] = EventQueue(1)
    queue.try_send(add_event("accepted"))

    with pytest.raises(PublishQueueFull) as plain:
        queue.try_send(free_event("dropped"))
    # the queue holds any items and names none; the seeds' sender names the event
    assert str(plain.value) == "publish queue full; dropping the newest item (capacity=1)"
    with pytest.raises(PublishQueueFull) as excinfo:
        send_event(queue, free_event("dropped"))
    error = str(excinfo.value)
    assert "queue full" in error
    assert "request_id=dropped" in error
    assert "capacity=1" in error
    assert error == (
        "active-sequence publish queue full; dropping newest event (request_id=dropped, "
        "worker=WorkerWithDpRank { worker_id: 1, dp_rank: 0 }, capacity=1)"
    )
    assert len(queue) == 1
    assert queue.dropped == 2
    first = queue.try_recv()
    assert first is not None and first.request_id == "accepted"
    assert queue.try_recv() is None


def _drive_lifecycle(tracker: ActiveSequencesMultiWorker, clock: FakeClock) -> None:
    req = SequenceRequest("r", WORKER, [1, 2, 3], track_prefill_tokens=False)
    add_request(tracker, req, clock.now())
    tracker.mark_prefill_completed("r", clock.now())
    tracker.free("r", clock.now())


def test_active_sequence_publish_channel_is_absent_when_replica_sync_disabled() -> None:
    # Port intent: with replica sync off, the tracker never hands an event to the publisher.
    clock = FakeClock()
    disabled: EventQueue[ActiveSequenceEvent] = EventQueue(1)
    tracker = new_tracker(
        QueuePublisher(disabled), 4, {1: (0, 1)}, replica_sync=False, clock=clock.now
    )
    _drive_lifecycle(tracker, clock)
    assert len(disabled) == 0
    assert disabled.dropped == 0

    # Control: the same lifecycle with replica sync on enqueues add, mark, free in order.
    enabled: EventQueue[ActiveSequenceEvent] = EventQueue(3)
    tracker = new_tracker(
        QueuePublisher(enabled), 4, {1: (0, 1)}, replica_sync=True, clock=clock.now
    )
    _drive_lifecycle(tracker, clock)
    assert [event_name(e) for e in drain(enabled)] == ["add", "mark", "free"]


def test_active_sequence_publish_sender_classifies_closed_queue_by_cancellation() -> None:
    queue: EventQueue[ActiveSequenceEvent] = EventQueue(1)
    queue.close()  # the consumer is gone

    with pytest.raises(PublishQueueClosed) as plain:
        queue.try_send(free_event("unexpected"))
    assert str(plain.value) == "publish queue closed; dropping the item (capacity=1)"
    assert plain.value.during_shutdown is False
    with pytest.raises(PublishQueueClosed) as unexpected:
        send_event(queue, free_event("unexpected"))
    assert unexpected.value.during_shutdown is False
    assert str(unexpected.value) == (
        "active-sequence publish queue closed; dropping event (request_id=unexpected, "
        "worker=WorkerWithDpRank { worker_id: 1, dp_rank: 0 }, capacity=1)"
    )

    queue.shutting_down = True  # the consumer's cancellation token is cancelled
    with pytest.raises(PublishQueueClosed) as shutdown:
        send_event(queue, free_event("shutdown"))
    assert shutdown.value.during_shutdown is True


def test_tracker_logs_closed_queue_error_only_outside_shutdown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # SPEC §6.3: the tracker only logs enqueue failures (error, or debug during shutdown).
    clock = FakeClock()
    queue: EventQueue[ActiveSequenceEvent] = EventQueue(1)
    queue.close()
    tracker = new_tracker(QueuePublisher(queue), 4, {1: (0, 1)}, replica_sync=True, clock=clock.now)
    caplog.set_level(logging.DEBUG, logger="kv_slot_tracker.core.tracker")

    add_request(tracker, SequenceRequest("unexpected", WORKER, [1]), clock.now())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "Failed to publish replica-sync event" in errors[0].getMessage()
    assert "request_id=unexpected" in errors[0].getMessage()
    assert tracker.worker_for("unexpected") == WORKER  # the local mutation stands

    caplog.clear()
    queue.shutting_down = True
    tracker.free("unexpected", clock.now())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("request_id=unexpected" in r.getMessage() for r in caplog.records)
    assert tracker.worker_for("unexpected") is None


class BlockingSingletonPublisher:
    """Records attempts; an add blocks until released; a mark fails."""

    def __init__(self) -> None:
        self.attempted: asyncio.Queue[str] = asyncio.Queue()
        self.release_add = asyncio.Semaphore(0)
        self.active = 0
        self.max_active = 0

    async def publish(self, event: ActiveSequenceEvent) -> None:
        name = event_name(event)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.attempted.put_nowait(name)
        if name == "add":
            await self.release_add.acquire()
        self.active -= 1
        if name == "mark":
            raise RuntimeError("synthetic singleton publish failure")


async def _next_attempt(publisher: BlockingSingletonPublisher) -> str:
    return await asyncio.wait_for(publisher.attempted.get(), 1.0)


async def test_active_sequence_singleton_publisher_serializes_and_stops_on_cancellation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="tests.support.replica_runtime")
    publisher = BlockingSingletonPublisher()
    queue: EventQueue[ActiveSequenceEvent] = EventQueue(3)
    queue.try_send(add_event("ordered"))
    queue.try_send(mark_event("ordered"))
    queue.try_send(free_event("ordered"))

    task = asyncio.create_task(run_singleton_publisher(queue, publisher.publish))

    first = await _next_attempt(publisher)
    assert first == "add"
    for _ in range(10):  # give a non-serializing loop every chance to start the next publish
        await asyncio.sleep(0)
    assert publisher.attempted.empty()
    assert publisher.max_active == 1

    publisher.release_add.release()
    attempted = [first]
    for _ in range(2):
        attempted.append(await _next_attempt(publisher))
    assert attempted == ["add", "mark", "free"]
    assert publisher.max_active == 1

    # the mark's failure was logged (request id, worker, error) and the free still attempted
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(failures) == 1
    assert "request_id=ordered" in failures[0]
    assert "synthetic singleton publish failure" in failures[0]

    queue.try_send(add_event("blocked"))
    assert await _next_attempt(publisher) == "add"
    assert publisher.active == 1  # blocked in flight

    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    assert task in done, "singleton publisher should stop after cancellation"
    assert task.cancelled()


async def test_singleton_publisher_stops_when_queue_closes() -> None:
    published: list[str] = []

    async def publish(event: ActiveSequenceEvent) -> None:
        published.append(event.request_id)

    queue: EventQueue[ActiveSequenceEvent] = EventQueue(3)
    queue.try_send(free_event("a"))
    queue.try_send(free_event("b"))
    queue.close()
    await asyncio.wait_for(run_singleton_publisher(queue, publish), 1.0)
    assert published == ["a", "b"]  # drains what was queued, then returns


def _fake_waiter(clock: FakeClock, waits: list[int]):
    async def wait(_queue: EventQueue, remaining_ns: int) -> bool:
        waits.append(remaining_ns)
        clock.advance_ns(remaining_ns)  # the timer fires: nothing arrived meanwhile
        return False

    return wait


async def test_active_sequence_batch_collection_uses_time_and_count_caps() -> None:
    clock = FakeClock()
    waits: list[int] = []
    wait = _fake_waiter(clock, waits)
    queue: EventQueue[ActiveSequenceEvent] = EventQueue(MAX_REPLICA_BATCH_EVENTS + 1)

    for i in range(100):
        queue.try_send(free_event(f"free-{i}"))
    start = clock.now()
    events, stop = await collect_batch(queue, clock=clock.now, wait=wait)
    assert not stop
    assert len(events) == 100
    assert clock.now() - start == 1_000_000  # exactly MAX_REPLICA_BATCH_DURATION
    decoded = decode_batch(encode_batch(events))
    assert len(decoded) == 100
    assert [e.request_id for e in decoded] == [f"free-{i}" for i in range(100)]
    assert len(queue) == 0

    for i in range(MAX_REPLICA_BATCH_EVENTS + 1):
        queue.try_send(free_event(f"count-{i}"))
    start = clock.now()
    waits.clear()
    events, stop = await collect_batch(queue, clock=clock.now, wait=wait)
    assert not stop
    assert len(events) == 256
    assert [e.request_id for e in events] == [f"count-{i}" for i in range(256)]
    assert clock.now() == start  # the count cap returns at once
    assert waits == []
    assert len(queue) == 1

    start = clock.now()
    remaining, stop = await collect_batch(queue, clock=clock.now, wait=wait)
    assert not stop
    assert [e.request_id for e in remaining] == ["count-256"]
    assert clock.now() - start == 1_000_000


async def test_batch_collection_returns_collected_prefix_on_close_or_cancel() -> None:
    # SPEC §6.3: closure or cancellation while collecting still yields what was gathered.
    clock = FakeClock()
    queue: EventQueue[ActiveSequenceEvent] = EventQueue(4)
    queue.try_send(free_event("a"))
    queue.try_send(free_event("b"))
    queue.close()
    events, stop = await collect_batch(queue, clock=clock.now, wait=_fake_waiter(clock, []))
    assert stop
    assert [e.request_id for e in events] == ["a", "b"]

    queue = EventQueue(4)
    queue.try_send(free_event("c"))
    events, stop = await collect_batch(
        queue, clock=clock.now, wait=_fake_waiter(clock, []), cancelled=lambda: True
    )
    assert stop
    assert [e.request_id for e in events] == ["c"]

    closed_empty: EventQueue[ActiveSequenceEvent] = EventQueue(1)
    closed_empty.close()
    assert await collect_batch(closed_empty, clock=clock.now) == ([], True)
