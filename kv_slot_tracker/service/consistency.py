"""Lifecycle calls about request ids this instance does not know yet (replicated mode).

Behind a load balancer, a ``/free``, ``/prefill_complete`` or ``/output_block`` may reach this
instance before the replica record of the request's add, made on a peer a moment earlier. Such a
call (and only such a call: a known id is served at once, synchronously) waits, asynchronously
and for at most ``consistency_wait_ms``:

1. for the read barrier: until this instance has applied every stream entry that existed when
   the call arrived (``Replication.caught_up``);
2. with ``replication_ack = "local"`` through Redis, also until the ids appear or the bound
   passes, since a peer answers an add before its record reaches the stream (it may be in the
   peer's outbox). The processes of one ``--workers`` supervisor skip this: their barrier has
   every sibling send what it accepted first (``replication.local.hub``).

Then it runs like any call, synchronously, and ids still unknown are resolved
(``resolve``): a free becomes a replicated tombstone and a prefill completion a replicated
pending mark (``kv_slot_tracker.service.early_calls``), both answered like a success: the request may exist on a
peer whose record has not arrived yet (an outbox, a Redis stall), so "unknown" would be wrong,
and nothing is lost: the add is cancelled, or its prefill completed, when it arrives, on every
instance. When the barrier proved the id unknown and every acknowledged add is already in the
stream (``replication_ack = "redis"``, or the hub's barrier: ``barrier_certain``), the call is
answered as one instance answers it: a
prefill completion or output block 404, a free 200 for an id of a known tracker and 404
``no slot tracker`` otherwise. A free still keeps its tombstone then, for an add that was
answered 503 (applied on its instance, its record not confirmed) and whose record reaches the
stream after the free.
Output blocks are local to the instance that receives them (as in Dynamo: never replicated),
so one for an id still unknown has nowhere to go: it is dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from kv_slot_tracker.replication.port import Replication
from kv_slot_tracker.service import commands
from kv_slot_tracker.service.early_calls import FREE, PREFILL_COMPLETE
from kv_slot_tracker.service.service import SlotTrackerService

log = logging.getLogger(__name__)

RequestKey = tuple[commands.Key, str]


@dataclass(slots=True)
class ConsistencyCounters:
    barrier_waits: int = 0  # calls that waited for unknown request ids
    barrier_timeouts: int = 0  # ... whose read barrier could not be confirmed in time
    output_blocks_dropped: int = 0  # output blocks for ids still unknown after the wait
    # replication_ack = "redis"
    ack_waits: int = 0  # calls that waited for their records to reach the stream
    ack_timeouts: int = 0  # ... and were answered 503 after the timeout (applied here)
    ack_refused: int = 0  # calls refused before applying: Redis known unreachable


class Consistency:
    def __init__(
        self,
        service: SlotTrackerService,
        replication: Replication,
        *,
        wait_ms: int,
        durable_acks: bool = False,
    ) -> None:
        self.service = service
        self.replication = replication
        self.wait_s = wait_ms / 1000
        # an id unknown after a confirmed barrier is certainly unknown: every acknowledged add
        # is in the stream (durable acknowledgements), or the barrier had it sent there first
        self.barrier_certain = durable_acks or replication.barrier_covers_acknowledged
        self.counters = ConsistencyCounters()
        self._applied: asyncio.Event | None = None  # set after a batch of peers' records
        service.replica.on_applied = self._on_applied

    def known(self, key: commands.Key, request_id: str) -> bool:
        t = self.service.registry.trackers.get(key)
        return t is not None and t.has_request(request_id)

    def _on_applied(self) -> None:
        event = self._applied
        if event is not None:
            self._applied = None
            event.set()

    async def next_batch(self, timeout_s: float) -> None:
        event = self._applied
        if event is None:
            event = self._applied = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)

    async def settle(self, ids: list[RequestKey]) -> bool:
        """Wait (bounded) for the adds of ``ids`` to arrive (see the module docstring).

        Returns True when an id still unknown afterwards is certainly unknown: the barrier
        was confirmed and acknowledged adds are durable (``replication_ack = "redis"``).
        """
        known = self.known
        return await self.settle_until(lambda: all(known(key, rid) for key, rid in ids))

    async def settle_until(self, arrived: Callable[[], bool]) -> bool:
        """``settle`` for whatever ``arrived`` tells: the read barrier, then with local
        acknowledgements the peers' next batches until ``arrived()`` or the bound."""
        self.counters.barrier_waits += 1
        if self.wait_s <= 0:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        confirmed = await self.replication.caught_up(self.wait_s)
        if not confirmed:
            self.counters.barrier_timeouts += 1
        if self.barrier_certain:
            return confirmed
        while not arrived():
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            await self.next_batch(remaining)
        return False

    def resolve(
        self, cmd: commands.PrefillComplete | commands.Free | commands.OutputBlock, certain: bool
    ) -> None:
        """Run a lifecycle call whose id is still unknown after ``settle`` (``certain``: its
        answer). Raises the service's not-found errors when the id is certainly unknown."""
        replica = self.service.replica
        if isinstance(cmd, commands.Free):
            replica.remember_early(cmd.key, FREE, cmd.request_id)
            if certain:
                self.service.free(cmd)  # a no-op for the id; raises NoTracker
        elif isinstance(cmd, commands.PrefillComplete):
            if certain:
                self.service.prefill_complete(cmd)  # raises NoTracker / RequestNotFound
            replica.remember_early(cmd.key, PREFILL_COMPLETE, cmd.request_id)
        else:
            if certain:
                self.service.output_block(cmd)  # raises NoTracker / RequestNotFound
            self.counters.output_blocks_dropped += 1
            log.info(
                "output block for request %s dropped: unknown here after %.0f ms",
                cmd.request_id,
                self.wait_s * 1000,
            )

    def release_unknown(self, selection_id: str, keys: list[commands.Key]) -> None:
        """A reservation released while still unknown here after the wait: its id is gone for
        good. Its request may yet arrive (a peer's outbox, a Redis stall), in any of the
        partitions ``keys``, so each gets a replicated tombstone of the id."""
        for key in keys:
            self.service.replica.remember_early(key, FREE, selection_id)

    def run(
        self, cmd: commands.PrefillComplete | commands.Free | commands.OutputBlock, certain: bool
    ) -> None:
        """After ``settle``: the call as usual when its id is known now, else ``resolve``."""
        if not self.known(cmd.key, cmd.request_id):
            self.resolve(cmd, certain)
        elif isinstance(cmd, commands.Free):
            self.service.free(cmd)
        elif isinstance(cmd, commands.PrefillComplete):
            self.service.prefill_complete(cmd)
        else:
            self.service.output_block(cmd)
