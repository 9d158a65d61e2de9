"""The call routes of a replicated instance: the operations composed with what sharing state
needs.

``ReplicatedEdge`` wraps the slot tracker's ``Operations`` (which stay synchronous, each
answering its ``Result``) and answers ``Answer`` (``kv_slot_tracker.http.answers``): the
``Result`` at once when nothing has to wait, else ``Later``, which the dispatchers await.
``replicated_call`` and ``DurableAcks`` serve the selection API's routes too
(``kv_slot_tracker.http.selection.replicated``).

* The readiness gate (``kv_slot_tracker.http.gate``): 503 before anything runs while the
  instance has not caught up with its peers.
* With ``replication_ack = "redis"``, a mutating call is answered only once its records are in
  the stream: refused (503, nothing applied) while Redis is known to be unreachable, else
  applied, then answered when the append holding its last record returns (calls waiting at one
  moment share it), or 503 after ``replication_ack_timeout_ms`` (applied here, not
  acknowledged). A call that queued no record (an error, a read, an output block) is answered
  at once.
* Lifecycle calls for request ids this instance does not know yet (``/prefill_complete``,
  ``/output_block``, ``/free``, and the same inside ``/batch``) wait for the add's record
  (``kv_slot_tracker.service.consistency``). Only they answer ``Later``; a call whose ids are
  all known runs synchronously, exactly as in embedded mode. A batch is scanned first; an id
  added earlier in the same batch counts as known. Bodies decode as in embedded mode (the
  ``decode_*`` functions and batch methods of ``kv_slot_tracker.http.operations``): plain ones
  straight into their commands, a batch's included; only other bodies take the models.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kv_slot_tracker.http.answers import Answer, Call, Later, Result
from kv_slot_tracker.http.errors import EXPECTED, error_result
from kv_slot_tracker.http.fast_bodies import batch_operations
from kv_slot_tracker.http.gate import ReadinessGate
from kv_slot_tracker.http.operations import (
    BATCH_CREATED,
    BATCH_DONE,
    OK,
    Operations,
    add_command,
    batch_error,
    decode_free,
    decode_output_block,
    decode_prefill_complete,
    free_command,
    output_block_command,
    prefill_command,
)
from kv_slot_tracker.http.schemas import BatchAdd
from kv_slot_tracker.service import commands
from kv_slot_tracker.service.consistency import Consistency, RequestKey
from kv_slot_tracker.service.errors import NotAcknowledged, WritesRefused

Lifecycle = commands.PrefillComplete | commands.Free | commands.OutputBlock

# a validated batch operation's command, by its ``op``
_COMMAND_OF: dict[str, Callable[[Any], commands.BatchOperation]] = {
    "add": add_command,
    "prefill_complete": prefill_command,
    "free": free_command,
    "output_block": output_block_command,
}

# operations that may queue replica records: with durable acknowledgements they wait for them
MUTATING = frozenset({"register", "upsert", "unregister", "heartbeat", "reconcile", "add",
                      "prefill_complete", "free", "output_block", "batch"})  # fmt: skip

# Answers that tell the client about the shared state (a change applied, a request found or
# not found); any other status is about the request alone and never waits.
STATE_ANSWERS = frozenset({200, 201, 204, 404, 409})


class DurableAcks:
    """``replication_ack = "redis"``: refuse a mutating call while Redis is known unreachable,
    and answer one that queued records only once they are in the stream (see the module
    docstring). Shared by the slot-tracker and the selection routes."""

    __slots__ = ("replication", "counters", "timeout_ms")

    def __init__(self, consistency: Consistency, timeout_ms: int) -> None:
        self.replication = consistency.replication
        self.counters = consistency.counters
        self.timeout_ms = timeout_ms

    def refusal(self) -> Result | None:
        """The answer when writes must be refused now (nothing was applied), else None."""
        reason = self.replication.write_refusal()
        if reason is None:
            return None
        self.counters.ack_refused += 1
        return error_result(WritesRefused(reason))

    def finish(self, answer: Answer) -> Answer:
        """``answer`` once every record this instance accepted so far is acknowledged: at once
        when none waits (the call queued nothing, and nothing earlier is pending).

        Also for a call that changed nothing: its answer may rest on a change whose own call
        was answered 503 and is not acknowledged yet (an add retried after a timeout answers
        409), and a client takes that answer as acknowledging the change."""
        rep = self.replication
        if not isinstance(answer, Later) and (
            rep.last_accepted() <= rep.acknowledged_through() or answer[0] not in STATE_ANSWERS
        ):
            return answer  # nothing waits, or a refusal about the request itself (422, 413)
        return Later(self._acknowledged(answer))

    async def _acknowledged(self, answer: Answer) -> Result:
        result = await answer if isinstance(answer, Later) else answer
        seq = self.replication.last_accepted()
        if seq <= self.replication.acknowledged_through():
            return result
        counters = self.counters
        counters.ack_waits += 1
        if await self.replication.appended(seq, self.timeout_ms / 1000):
            return result
        counters.ack_timeouts += 1
        return error_result(NotAcknowledged(self.timeout_ms))


def replicated_call(gate: ReadinessGate, acks: DurableAcks | None, op: Call) -> Call:
    """``op`` as a replicated instance runs it: behind the readiness gate, then (``acks``: a
    mutating call with durable acknowledgements) the write refusal, the operation, and the
    acknowledgement. Expected errors are answered with their status, never raised."""
    if acks is None:

        def call(raw: bytes, *args: Any) -> Answer:
            if gate.closed:
                refused = gate.refusal()
                if refused is not None:
                    return error_result(refused)
            try:
                return op(raw, *args)
            except EXPECTED as e:
                return error_result(e)

        return call

    def acknowledged(raw: bytes, *args: Any) -> Answer:
        if gate.closed:
            refused = gate.refusal()
            if refused is not None:
                return error_result(refused)
        refused_writes = acks.refusal()
        if refused_writes is not None:
            return refused_writes
        try:
            answer = op(raw, *args)
        except EXPECTED as e:
            answer = error_result(e)  # may rest on an unconfirmed change (``finish``)
        return acks.finish(answer)

    return acknowledged


class ReplicatedEdge:
    """The slot tracker's call routes on a replicated instance (module docstring): ``ops``
    behind the readiness gate and, with durable acknowledgements (``acks``; None: local ones),
    the write refusal and the acknowledgement; lifecycle calls about ids not known yet wait
    for their add (``consistency``)."""

    def __init__(
        self,
        ops: Operations,
        gate: ReadinessGate,
        consistency: Consistency,
        acks: DurableAcks | None = None,
    ) -> None:
        self.ops = ops
        self.service = ops.service
        self.gate = gate
        self.consistency = consistency
        self.known = consistency.known
        self.acks = acks
        # the calls that may wait for an add; every other is ``ops``' own, as it is
        self.waiting: dict[str, Call] = {
            "prefill_complete": self.prefill_complete,
            "free": self.free,
            "output_block": self.output_block,
            "batch": self.batch,
        }

    def get(self, name: str) -> Call:
        """The named call route's operation (the route table names them)."""
        op = self.waiting.get(name) or getattr(self.ops, name)
        return replicated_call(self.gate, self.acks if name in MUTATING else None, op)

    # -- lifecycle calls that may wait for their add --------------------------------------

    def prefill_complete(self, raw: bytes) -> Answer:
        cmd = decode_prefill_complete(raw)
        if self.known(cmd.key, cmd.request_id):
            self.service.prefill_complete(cmd)
            return 200, OK
        return Later(self._after_wait(cmd))

    def free(self, raw: bytes) -> Answer:
        cmd = decode_free(raw)
        if self.known(cmd.key, cmd.request_id):
            self.service.free(cmd)
            return 200, OK
        return Later(self._after_wait(cmd))

    def output_block(self, raw: bytes) -> Answer:
        cmd = decode_output_block(raw)
        if self.known(cmd.key, cmd.request_id):
            self.service.output_block(cmd)
            return 200, OK
        return Later(self._after_wait(cmd))

    async def _after_wait(self, cmd: Lifecycle) -> Result:
        consistency = self.consistency
        certain = await consistency.settle([(cmd.key, cmd.request_id)])
        consistency.run(cmd, certain)
        return 200, OK

    # -- batch ----------------------------------------------------------------------------

    def batch(self, raw: bytes) -> Answer:
        ops = self.ops
        cmds = batch_operations(raw)  # plain bodies decode straight into the commands
        if cmds is not None:
            ops.check_size(len(cmds))
            unknown = self._unknown_ids(cmds)
            if not unknown:
                return ops.run_commands(cmds)
            return Later(self._batch_after_wait(cmds, unknown))
        items = ops.validated_batch(raw)  # not plain: the validating path, with its messages
        unknown = self._unknown_ids(items)
        if not unknown:
            return ops.run_batch(items)
        return Later(self._batch_after_wait(items, unknown))

    def _unknown_ids(self, items: list[Any]) -> list[RequestKey]:
        """Ids of the batch's lifecycle calls that neither this instance nor an earlier add of
        the batch knows (``items``: commands, or models and error results)."""
        known = self.known
        added: set[RequestKey] = set()
        unknown = []
        add, add_model = commands.Add, BatchAdd
        for b in items:
            kind = type(b)
            if kind is bytes:
                continue
            rid = (b.model_name, b.routing_group), b.request_id
            if kind is add or kind is add_model:
                added.add(rid)
            elif rid not in added and not known(*rid):
                unknown.append(rid)
        return unknown

    async def _batch_after_wait(self, items: list[Any], unknown: list[RequestKey]) -> Result:
        consistency = self.consistency
        certain = await consistency.settle(unknown)
        add = self.service.add

        def apply(b: Any) -> bytes:
            try:
                cmd: Any = b if isinstance(b, commands.Keyed) else _COMMAND_OF[b.op](b)
                if type(cmd) is commands.Add:
                    add(cmd)
                    return BATCH_CREATED
                consistency.run(cmd, certain)
            except EXPECTED as e:
                return batch_error(e)
            return BATCH_DONE

        return self.ops.run_batch(items, apply)
