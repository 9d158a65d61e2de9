"""The selection API's call routes on a replicated instance: ``SelectionOperations`` composed
with what sharing state needs, as ``kv_slot_tracker.http.replicated`` does for the slot-tracker
routes (the operations stay synchronous; a call that waits answers ``Later``).

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
  lost: the id gets a replicated tombstone in every partition (``kv_slot_tracker.service.early_calls``), so if its
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
from kv_slot_tracker.http.answers import Answer, Call, Later, Result
from kv_slot_tracker.http.gate import ReadinessGate
from kv_slot_tracker.http.replicated import DurableAcks, replicated_call
from kv_slot_tracker.http.selection.operations import SelectionOperations
from kv_slot_tracker.service.consistency import Consistency

# Not found here, but perhaps made on a peer a moment ago. (A 503 for a partition without
# schedulable workers does not wait: it already tells the client to try again.)
NOT_YET_KNOWN = (
    ReservationNotFound,
    PendingSelectionNotFound,
    CatalogWorkerNotFound,
    SchedulableWorkerNotFound,
    RankNotFound,
)


class ReplicatedSelectionEdge:
    """The selection API's call routes on a replicated instance (module docstring): ``ops``
    behind the readiness gate and, with durable acknowledgements (``acks``; None: local ones),
    the write refusal and the acknowledgement; a call about something not known here yet
    waits for the peers' records and runs again (``consistency``)."""

    def __init__(
        self,
        ops: SelectionOperations,
        gate: ReadinessGate,
        consistency: Consistency,
        acks: DurableAcks | None = None,
    ) -> None:
        self.ops = ops
        self.gate = gate
        self.consistency = consistency
        self.acks = acks

    def get(self, name: str) -> Call:
        """The named call route's operation (the route table names them)."""
        op: Callable[..., Result] = getattr(self.ops, name)

        def call(raw: bytes, *args: Any) -> Answer:
            try:
                return op(raw, *args)
            except NOT_YET_KNOWN:
                return Later(self._after_wait(name, op, raw, args))

        return replicated_call(self.gate, self.acks, call)

    async def _after_wait(
        self, name: str, op: Callable[..., Result], raw: bytes, args: tuple[Any, ...]
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
                consistency.release_unknown(args[0], sorted(self.ops.service.partitions))
            raise
