"""The seeds' runtime glue that the app itself does not use, kept for the ports of their tests.

* The replica apply loop (SPEC §6.4): drain a subscriber in batches, flush effects per batch. A
  subscriber offers ``async next_event()`` and a non-blocking ``try_next_event()``; each returns
  an event, a ``ReceiveError``, ``None`` when the stream is closed, and (``try_next_event`` only)
  ``PENDING`` when nothing is available right now.
* The singleton publisher (SPEC §6.3): publish queued events one at a time, in order.
* The seeds' wake-up and cleanup counts of a tracker's replica batches (``sync_counts``): a
  batch that applied a free or a prefill completion wakes waiters once, one that applied an add
  or a free attempts one cleanup.
* ``collect_batch`` with the seeds' caps (``MAX_REPLICA_BATCH_*``); the app passes its own.

(The app replicates through Redis instead: ``kv_slot_tracker.replication.redis``.)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kv_slot_tracker.core.events import ActiveSequenceEvent, AddRequest, Free
from kv_slot_tracker.core.tracker import ActiveSequencesMultiWorker, ReplicaEffects
from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.replication.queue import EventQueue, PublishQueueError, PublishQueueFull
from kv_slot_tracker.replication.queue import collect_batch as collect_capped_batch

log = logging.getLogger(__name__)

# The seeds' caps of one replica batch (the service's publisher takes its own from settings).
MAX_REPLICA_BATCH_EVENTS = 256
MAX_REPLICA_BATCH_DURATION_NS = 1_000_000

T = TypeVar("T")

collect_batch = functools.partial(
    collect_capped_batch,
    max_events=MAX_REPLICA_BATCH_EVENTS,
    max_duration_ns=MAX_REPLICA_BATCH_DURATION_NS,
)

PENDING: Any = type("Pending", (), {"__repr__": lambda self: "PENDING"})()


@dataclass(frozen=True, slots=True)
class ReceiveError:
    message: str


class SequenceSubscriber(Protocol):
    async def next_event(self) -> ActiveSequenceEvent | ReceiveError | None: ...

    def try_next_event(self) -> Any: ...


class Cancel:
    """A cancellation token that loops can poll and await."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def cancel(self) -> None:
        self._event.set()

    def is_cancelled(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


async def _first_of(coro, cancel: Cancel):
    """Await ``coro`` unless ``cancel`` fires first (then returns the Cancel object)."""
    if cancel.is_cancelled():
        coro.close()
        return cancel
    task = asyncio.ensure_future(coro)
    if task.done():
        return task.result()
    waiter = asyncio.ensure_future(cancel.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task in done:
        return task.result()
    task.cancel()
    return cancel


@dataclass(slots=True)
class SyncCounts:
    """The seeds' ``remote_state_update_count`` (wakes) and cleanup attempts of one tracker."""

    wakes: int = 0
    cleanups: int = 0


_COUNTS: weakref.WeakKeyDictionary[ActiveSequencesMultiWorker, SyncCounts] = (
    weakref.WeakKeyDictionary()
)


def sync_counts(tracker: ActiveSequencesMultiWorker) -> SyncCounts:
    """The wake-ups and cleanup attempts of ``tracker``'s replica batches so far."""
    counts = _COUNTS.get(tracker)
    if counts is None:
        counts = _COUNTS[tracker] = SyncCounts()
    return counts


async def run_replica_sync(
    tracker: ActiveSequencesMultiWorker,
    subscriber: SequenceSubscriber,
    cancel: Cancel,
    apply: Callable[[ActiveSequenceEvent, ReplicaEffects], object] | None = None,
) -> None:
    """Apply a peer's events until the stream closes or ``cancel`` fires."""
    apply = apply or tracker.apply_replica_event
    clock = tracker.clock
    counts = sync_counts(tracker)
    effects = ReplicaEffects()
    while True:
        r = await _first_of(subscriber.next_event(), cancel)
        if r is cancel or r is None:
            break
        if isinstance(r, ReceiveError):
            log.warning("Error receiving active sequence event: %s", r.message)
            continue
        event, start, n = r, clock(), 0
        exit_after = yield_after = wake = cleanup = False
        while True:
            if apply(event, effects):
                kind = type(event.data)
                wake = wake or kind is not AddRequest
                cleanup = cleanup or kind is AddRequest or kind is Free
            n += 1
            if cancel.is_cancelled():
                exit_after = True
                break
            if n >= MAX_REPLICA_BATCH_EVENTS or clock() - start >= MAX_REPLICA_BATCH_DURATION_NS:
                yield_after = True
                break
            nxt = subscriber.try_next_event()
            if nxt is PENDING:
                break
            if nxt is None:
                exit_after = True
                break
            if isinstance(nxt, ReceiveError):
                log.warning("Error receiving active sequence event: %s", nxt.message)
                break
            event = nxt
        tracker.flush_replica_effects(effects)
        counts.wakes += wake
        counts.cleanups += cleanup
        if exit_after:
            break
        if yield_after:
            await asyncio.sleep(0)


def start_replica_sync(
    tracker: ActiveSequencesMultiWorker, subscriber: SequenceSubscriber, cancel: Cancel
) -> asyncio.Task:
    async def runner() -> None:
        try:
            await run_replica_sync(tracker, subscriber, cancel)
        except Exception:
            log.exception("replica sync loop failed")

    return asyncio.create_task(runner(), name="replica-sync")


async def run_singleton_publisher(
    queue: EventQueue[T], publish: Callable[[T], Awaitable[None]]
) -> None:
    """Publish one event at a time, in order; a failure is logged and the loop goes on.

    Stops when the queue closes or the task is cancelled (abandoning an in-flight publish).
    """
    while True:
        item = await queue.recv()
        if item is None:
            return
        try:
            await publish(item)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # transport errors must not stop the loop
            rid, worker = describe(item)
            log.error("Failed to publish replica event request_id=%s worker=%s: %s", rid, worker, e)


def describe(item: object) -> tuple[str, WorkerWithDpRank]:
    """``(request_id, worker)`` of a queued event, for messages."""
    event = getattr(item, "event", item)
    if isinstance(event, ActiveSequenceEvent):
        return event.request_id, event.worker
    return str(getattr(item, "request_id", "")), WorkerWithDpRank(0, 0)


def send_event(queue: EventQueue[ActiveSequenceEvent], event: ActiveSequenceEvent) -> None:
    """The seeds' publish sender: ``try_send``, a refusal worded as Dynamo's runtime words it
    (the dropped event's request and worker; the queue itself knows nothing of events)."""
    try:
        queue.try_send(event)
    except PublishQueueError as e:
        full = isinstance(e, PublishQueueFull)
        what = "full; dropping newest event" if full else "closed; dropping event"
        e.args = (
            f"active-sequence publish queue {what} (request_id={event.request_id}, "
            f"worker={event.worker.debug()}, capacity={queue.capacity})",
        )
        raise


def drain(queue: EventQueue[T]) -> list[T]:
    """Everything queued, in order (the queue is empty afterwards)."""
    items = []
    while (item := queue.try_recv()) is not None:
        items.append(item)
    return items
