"""The selection API's operations on a replicated instance: ``SelectionOperations`` plus what
sharing state needs, as ``kv_slot_tracker.http.replicated`` does for the slot-tracker routes.

* The readiness gate: 503 before anything runs while the instance has not caught up.
* With ``replication_ack = "redis"``, a call that changed shared state (a worker, a booking, a
  pending selection, a release) is answered once its records are in the stream
  (``DurableAcks``); a call that queued nothing (a read, a plain ``/select``, an error) at once.
* A call about something this instance does not know yet (a reservation, a pending selection
  or a worker made on a peer a moment earlier, whose records have not arrived) would answer
  404 wrongly. Such a call, and only it, waits: for the read barrier (this instance applied
  every stream entry that existed when the call arrived), and with local acknowledgements also
  for the next batches of peers' records, at most ``consistency_wait_ms``, and runs again
  (with durable acknowledgements the barrier alone is proof: every acknowledged change is
  already in the stream).
* With local acknowledgements a reservation may still be on its way after the wait (a peer's
  outbox, a Redis stall). Its ``DELETE`` answers 404 as the reference does, and nothing is
  lost: the id gets a replicated tombstone in every partition (``kv_slot_tracker.service.early``), so if its
  request arrives later it is cancelled on every instance, including the one that made it. An
  operation decides before it changes anything, so running it again is safe. Only then is the
  404 answered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kv_slot_tracker.core.selection.errors import (
    CatalogWorkerNotFound,
    PendingSelectionNotFound,
    RankNotFound,
    ReservationNotFound,
    SchedulableWorkerNotFound,
)
from kv_slot_tracker.http.gate import ReadinessGate
from kv_slot_tracker.http.replicated import DurableAcks, run_replicated
from kv_slot_tracker.http.selection.operations import Result, SelectionOperations
from kv_slot_tracker.service.consistency import Consistency
from kv_slot_tracker.service.selection.service import SelectionService

# Not found here, but perhaps made on a peer a moment ago. (A 503 for a partition without
# schedulable workers does not wait: it already tells the client to try again.)
NOT_YET_KNOWN = (
    ReservationNotFound,
    PendingSelectionNotFound,
    CatalogWorkerNotFound,
    SchedulableWorkerNotFound,
    RankNotFound,
)


class ReplicatedSelectionOperations(SelectionOperations):
    def __init__(
        self,
        service: SelectionService,
        gate: ReadinessGate,
        consistency: Consistency,
        ack_timeout_ms: int | None = None,
    ) -> None:
        super().__init__(service)
        self.gate = gate
        self.consistency = consistency
        self.acks = DurableAcks(consistency, ack_timeout_ms) if ack_timeout_ms is not None else None

    def get(self, name: str) -> Callable[..., Any]:
        op = getattr(self, name)
        gate, acks = self.gate, self.acks

        def call(raw: bytes, *args: Any) -> Any:
            try:
                return op(raw, *args)
            except NOT_YET_KNOWN:
                return self._after_wait(name, op, raw, args)

        return lambda raw, *args: run_replicated(gate, acks, call, raw, *args)

    async def _after_wait(
        self, name: str, op: Callable[..., Result], raw: bytes, args: tuple
    ) -> Result:
        """Run ``op`` again once the peers' records that may concern it were applied."""
        consistency = self.consistency
        done: list[Result] = []

        def arrived() -> bool:
            try:
                done.append(op(raw, *args))
            except NOT_YET_KNOWN:
                return False
            return True

        await consistency.settle_until(arrived)
        if done:
            return done[0]
        try:
            return op(raw, *args)
        except NOT_YET_KNOWN:
            if name == "delete_reservation" and not consistency.barrier_certain:
                consistency.release_unknown(args[0], sorted(self.service.partitions))
            raise
