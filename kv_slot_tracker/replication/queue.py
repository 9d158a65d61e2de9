"""A bounded FIFO publish queue (SPEC §6.3), transport-free and blind to what it holds: the
Redis outbox queues its records in it (the ports of the seeds' tests, their events).

``try_send`` never blocks: a full queue drops the *newest* item (``PublishQueueFull``; the caller
logs and counts it, naming what it dropped), a closed queue refuses it (``PublishQueueClosed``,
saying whether that happened during shutdown). Both are ``PublishRejected``, the core's contract
for a publisher that refuses an event. Consumers take items one at a time (``recv``) or in
batches capped by count and by time (``collect_batch``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from kv_slot_tracker.core.errors import PublishRejected

REPLICA_EVENT_CHANNEL_CAPACITY = 100_000

T = TypeVar("T")


class PublishQueueError(PublishRejected):
    pass


class PublishQueueFull(PublishQueueError):
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        super().__init__(f"publish queue full; dropping the newest item (capacity={capacity})")


class PublishQueueClosed(PublishQueueError):
    def __init__(self, capacity: int, during_shutdown: bool) -> None:
        self.capacity = capacity
        self.during_shutdown = during_shutdown
        super().__init__(f"publish queue closed; dropping the item (capacity={capacity})")


class EventQueue(Generic[T]):
    def __init__(self, capacity: int = REPLICA_EVENT_CHANNEL_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._items: deque[T] = deque()
        self._ready = asyncio.Event()
        self._closed = False
        self.shutting_down = False  # the cancellation token of the consumer
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def try_send(self, item: T) -> None:
        if self._closed:
            raise PublishQueueClosed(self.capacity, self.shutting_down)
        if len(self._items) >= self.capacity:
            self.dropped += 1
            raise PublishQueueFull(self.capacity)
        self._items.append(item)
        self._ready.set()

    def close(self) -> None:
        """The consumer is gone: later sends fail; receivers drain what is left."""
        self._closed = True
        self._ready.set()

    def try_recv(self) -> T | None:
        if self._items:
            item = self._items.popleft()
            if not self._items and not self._closed:
                self._ready.clear()
            return item
        return None

    async def recv(self) -> T | None:
        """The next item, or None once the queue is closed and drained."""
        while True:
            item = self.try_recv()
            if item is not None:
                return item
            if self._closed:
                return None
            self._ready.clear()
            await self._ready.wait()

    async def wait_ready(self, timeout_s: float) -> bool:
        if self._items or self._closed:
            return True
        self._ready.clear()
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


Waiter = Callable[["EventQueue[Any]", int], Awaitable[bool]]


async def _real_wait(queue: EventQueue[Any], timeout_ns: int) -> bool:
    return await queue.wait_ready(timeout_ns / 1e9)


async def collect_batch(
    queue: EventQueue[T],
    *,
    max_events: int,
    max_duration_ns: int,
    clock: Callable[[], int] = time.monotonic_ns,
    wait: Waiter = _real_wait,
    cancelled: Callable[[], bool] = lambda: False,
) -> tuple[list[T], bool]:
    """Wait for a first item, then gather until ``max_events`` or ``max_duration_ns`` after it.

    Returns ``(batch, stop)``; ``stop`` is True when the queue closed or the consumer was
    cancelled while collecting (what was gathered is still returned, to be published).
    """
    first = await queue.recv()
    if first is None:
        return [], True
    batch = [first]
    deadline = clock() + max_duration_ns
    while len(batch) < max_events:
        item = queue.try_recv()
        if item is not None:
            batch.append(item)
            continue
        if queue.closed or cancelled():
            return batch, True
        remaining = deadline - clock()
        if remaining <= 0:
            break
        await wait(queue, remaining)
    return batch, False


Acks = deque[tuple[int, "asyncio.Future[bool]"]]
"""Calls waiting for their records to be acknowledged: (sequence number, the call's future),
in sequence order."""


async def wait_acknowledged(acks: Acks, seq: int, timeout_s: float) -> bool:
    """Wait until the future queued in ``acks`` for ``seq`` is resolved (True: acknowledged),
    at most ``timeout_s`` (False); for any transport's outbox, which resolves them."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[bool] = loop.create_future()
    acks.append((seq, done))
    # a timer rather than wait_for, which would wrap each waiting call in a task
    timer = loop.call_later(timeout_s, resolve, done, False)
    try:
        return await done
    finally:
        timer.cancel()


def resolve(done: asyncio.Future[bool], value: bool) -> None:
    """Resolve a waiting call's future unless it already was (by its timer or a close)."""
    if not done.done():
        done.set_result(value)
