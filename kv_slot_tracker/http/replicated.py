"""The body operations of a replicated instance: ``Operations`` plus what sharing state needs.

* The readiness gate (``kv_slot_tracker.http.gate``): 503 before anything runs while the instance has not
  caught up with its peers.
* With ``replication_ack = "redis"``, a mutating call is answered only once its records are in
  the stream: refused (503, nothing applied) while Redis is known to be unreachable, else
  applied, then answered when the append holding its last record returns (calls waiting at one
  moment share it), or 503 after ``replication_ack_timeout_ms`` (applied here, not
  acknowledged). A call that queued no record (an error, a read, an output block) is answered
  at once.
* Lifecycle calls for request ids this instance does not know yet (``/prefill_complete``,
  ``/output_block``, ``/free``, and the same inside ``/batch``) wait for the add's record
  (``kv_slot_tracker.service.consistency``). Only they take this slow path: the operation returns a
  coroutine instead of a result, which the dispatchers (``kv_slot_tracker.http.lean``, the FastAPI
  endpoints) await. A call whose ids are all known runs synchronously, exactly as in embedded
  mode. A batch is scanned first; an id added earlier in the same batch counts as known. Plain
  bodies (``kv_slot_tracker.http.plain``), a batch's included, decode straight into their commands
  as in embedded mode; only other bodies take the models.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kv_slot_tracker.http import plain as p
from kv_slot_tracker.http import schemas as s
from kv_slot_tracker.http.body import parse_json
from kv_slot_tracker.http.errors import EXPECTED, error_result
from kv_slot_tracker.http.gate import ReadinessGate
from kv_slot_tracker.http.operations import (
    _CREATED,
    _DONE,
    OK,
    Operations,
    Result,
    _batch_error,
    add_command,
    free_command,
    output_block_command,
    prefill_command,
)
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service import commands as c
from kv_slot_tracker.service.consistency import Consistency
from kv_slot_tracker.service.errors import NotAcknowledged, WritesRefused

Lifecycle = c.PrefillComplete | c.Free | c.OutputBlock
Deferred = Result | Awaitable[Result]

# a validated batch operation's command, by its ``op``
_COMMAND_OF: dict[str, Callable[[Any], c.BatchOperation]] = {
    "add": add_command,
    "prefill_complete": prefill_command,
    "free": free_command,
    "output_block": output_block_command,
}

# operations that may queue replica records: with durable acknowledgements they wait for them
MUTATING = frozenset({"register", "upsert", "unregister", "heartbeat", "reconcile", "add",
                      "prefill_complete", "free", "output_block", "batch"})  # fmt: skip


async def finish_waiting(pending: Awaitable[Result]) -> Result:
    """The result of an operation that had to wait, errors mapped like synchronous ones."""
    try:
        return await pending
    except EXPECTED as e:
        return error_result(e)


def run_replicated(
    gate: ReadinessGate, acks: DurableAcks | None, op: Callable[..., Any], raw: bytes, *args: Any
) -> Any:
    """One call on a replicated instance: the readiness gate, then (``acks``: a mutating call
    with durable acknowledgements) the write refusal, the operation with expected errors
    mapped, and the acknowledgement. An operation that had to wait returns a coroutine, which
    the dispatchers (``kv_slot_tracker.http.lean``, the FastAPI endpoints) await."""
    if gate.closed:
        refused = gate.refusal()
        if refused is not None:
            return error_result(refused)
    if acks is not None:
        refused_writes = acks.refusal()
        if refused_writes is not None:
            return refused_writes
    try:
        result = op(raw, *args)
    except EXPECTED as e:
        result = error_result(e)  # with acks: may rest on an unconfirmed change (``finish``)
    if acks is not None:
        return acks.finish(result)
    return result if type(result) is tuple else finish_waiting(result)


# Answers that tell the client about the shared state (a change applied, a request found or
# not found); any other status is about the request alone and never waits.
STATE_ANSWERS = frozenset({200, 201, 204, 404, 409})


class DurableAcks:
    """``replication_ack = "redis"``: refuse a mutating call while Redis is known unreachable,
    and answer one that queued records only once they are in the stream (see the module
    docstring). Shared by the slot-tracker and the selection operations."""

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

    def finish(self, result: Deferred) -> Deferred:
        """``result`` once every record this instance accepted so far is acknowledged: at once
        when none waits (the call queued nothing, and nothing earlier is pending).

        Also for a call that changed nothing: its answer may rest on a change whose own call
        was answered 503 and is not acknowledged yet (an add retried after a timeout answers
        409), and a client takes that answer as acknowledging the change."""
        rep = self.replication
        if type(result) is tuple and (
            rep.last_accepted() <= rep.acknowledged_through() or result[0] not in STATE_ANSWERS
        ):
            return result  # nothing waits, or a refusal about the request itself (422, 413)
        return self._acknowledged(result)

    async def _acknowledged(self, result: Deferred) -> Result:
        if type(result) is not tuple:
            try:
                result = await result  # type: ignore[misc]
            except EXPECTED as e:
                return error_result(e)
        seq = self.replication.last_accepted()
        if seq <= self.replication.acknowledged_through():
            return result  # type: ignore[return-value]
        counters = self.counters
        counters.ack_waits += 1
        if await self.replication.appended(seq, self.timeout_ms / 1000):
            return result  # type: ignore[return-value]
        counters.ack_timeouts += 1
        return error_result(NotAcknowledged(self.timeout_ms))


class ReplicatedOperations(Operations):
    def __init__(
        self,
        service: SlotTrackerService,
        max_batch: int,
        gate: ReadinessGate,
        consistency: Consistency,
        ack_timeout_ms: int | None = None,
    ) -> None:
        super().__init__(service, max_batch)
        self.gate = gate
        self.consistency = consistency
        # None: local acknowledgements
        self.acks = DurableAcks(consistency, ack_timeout_ms) if ack_timeout_ms is not None else None

    def get(self, name: str) -> Callable[[bytes], Any]:
        op = getattr(self, name)
        gate = self.gate
        acks = self.acks if name in MUTATING else None
        return lambda raw: run_replicated(gate, acks, op, raw)

    # -- lifecycle calls that may wait for their add --------------------------------------

    def _lifecycle(self, cmd: Lifecycle, run: Callable[[Any], Any]) -> Deferred:
        if self.consistency.known(cmd.key, cmd.request_id):
            run(cmd)
            return 200, OK
        return self._after_wait(cmd)

    async def _after_wait(self, cmd: Lifecycle) -> Result:
        consistency = self.consistency
        certain = await consistency.settle([(cmd.key, cmd.request_id)])
        consistency.run(cmd, certain)
        return 200, OK

    def prefill_complete(self, raw: bytes) -> Deferred:  # type: ignore[override]
        cmd = p.prefill_complete_body(raw)  # plain bodies decode straight into the command
        if cmd is None:  # not plain: the validating path, with its messages
            cmd = prefill_command(parse_json(raw, s.RequestBody))
        return self._lifecycle(cmd, self.service.prefill_complete)

    def free(self, raw: bytes) -> Deferred:  # type: ignore[override]
        cmd = p.free_body(raw)
        if cmd is None:
            cmd = free_command(parse_json(raw, s.RequestBody))
        return self._lifecycle(cmd, self.service.free)

    def output_block(self, raw: bytes) -> Deferred:  # type: ignore[override]
        cmd = output_block_command(parse_json(raw, s.OutputBlockBody))
        return self._lifecycle(cmd, self.service.output_block)

    # -- batch ----------------------------------------------------------------------------

    def batch(self, raw: bytes) -> Deferred:  # type: ignore[override]
        commands = p.batch_operations(raw)  # plain bodies decode straight into the commands
        if commands is not None:
            self._check_size(len(commands))
            unknown = self._unknown_ids(commands)
            if not unknown:
                return self._run_commands(commands)
            return self._batch_after_wait(commands, unknown)
        ops = self._batch_ops(raw)  # not plain: the validating path, with its messages
        unknown = self._unknown_ids(ops)
        if not unknown:
            return self._run_batch(ops)
        return self._batch_after_wait(ops, unknown)

    def _unknown_ids(self, ops: list[Any]) -> list[tuple[c.Key, str]]:
        """Ids of the batch's lifecycle calls that neither this instance nor an earlier add of
        the batch knows (``ops``: commands, or models and error results)."""
        known = self.consistency.known
        added: set[tuple[c.Key, str]] = set()
        unknown = []
        add, add_model = c.Add, s.BatchAdd
        for b in ops:
            kind = type(b)
            if kind is bytes:
                continue
            rid = (b.model_name, b.routing_group), b.request_id
            if kind is add or kind is add_model:
                added.add(rid)
            elif rid not in added and not known(*rid):
                unknown.append(rid)
        return unknown

    async def _batch_after_wait(self, ops: list[Any], unknown: list[tuple[c.Key, str]]) -> Result:
        consistency = self.consistency
        certain = await consistency.settle(unknown)
        add = self.service.add

        def apply(b: Any) -> bytes:
            try:
                cmd: Any = b if isinstance(b, c.Keyed) else _COMMAND_OF[b.op](b)
                if type(cmd) is c.Add:
                    add(cmd)
                    return _CREATED
                consistency.run(cmd, certain)
            except EXPECTED as e:
                return _batch_error(e)
            return _DONE

        return self._run_batch(ops, apply)
