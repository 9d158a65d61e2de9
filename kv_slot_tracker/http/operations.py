"""Body-level operations: JSON bytes in, ``(status, JSON bytes)`` out.

Each operation decodes its body into the service's command (``kv_slot_tracker.service.commands``): a plain
body straight into it (``kv_slot_tracker.http.fast_bodies``), any other through its model (``kv_slot_tracker.http.body``,
``kv_slot_tracker.http.schemas``, which alone write error messages); then it runs the command and encodes
the answer. Every route, whichever path serves it (the lean dispatcher or FastAPI), runs the
same operation, so it answers identically. Expected errors become their status and
``{"error": ...}`` body through the one error table (``kv_slot_tracker.http.errors``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from kv_slot_tracker.core.serde.shapes import repeated_fields
from kv_slot_tracker.core.types import WorkerDpRange, WorkerWithDpRank
from kv_slot_tracker.http import fast_bodies, schemas
from kv_slot_tracker.http.answers import Result
from kv_slot_tracker.http.body import parse_json, parse_object
from kv_slot_tracker.http.errors import EXPECTED, JSON_SHAPE, HttpError, describe, error_result
from kv_slot_tracker.http.responses import load_columns_json
from kv_slot_tracker.service import SlotTrackerService, commands

OK = b'{"status":"ok"}'
# a batch operation's result object: applied (an add: created)
BATCH_CREATED = b'{"status":201}'
BATCH_DONE = b'{"status":200}'

C = TypeVar("C", bound=commands.Keyed)
P = TypeVar("P", bound=commands.Prompt)
R = TypeVar("R", bound=commands.Register)
Operation = Callable[[bytes], Result]


def check_prompt(b: Any) -> None:
    """``sequence_hashes`` xor ``token_ids`` (the schema documents it as ``oneOf``; checked
    before the tracker is looked up, as the reference does)."""
    if b.sequence_hashes is None:
        if b.token_ids is None:
            raise HttpError(422, JSON_SHAPE + "missing field `sequence_hashes`")
    elif b.token_ids is not None:
        raise HttpError(422, JSON_SHAPE + "give either `sequence_hashes` or `token_ids`, not both")


def command(cls: type[C], b: Any) -> C:
    """The command ``cls`` of a validated model: the model's values of the command's fields
    (the two declare the same fields: ``tests/api/test_commands.py``)."""
    return cls(**{name: getattr(b, name) for name in cls.__struct_fields__})


def prompt_command(cls: type[P], b: Any) -> P:
    """``command`` of a model with a prompt, its form checked (``check_prompt``); hashes pass
    as given (``kv_slot_tracker.core.hashing``)."""
    check_prompt(b)
    return command(cls, b)


def add_command(b: Any) -> commands.Add:
    return prompt_command(commands.Add, b)


def free_command(b: Any) -> commands.Free:
    return command(commands.Free, b)


def prefill_command(b: Any) -> commands.PrefillComplete:
    return command(commands.PrefillComplete, b)


def output_block_command(b: Any) -> commands.OutputBlock:
    return command(commands.OutputBlock, b)


def decode_prefill_complete(raw: bytes) -> commands.PrefillComplete:
    """A ``/prefill_complete`` body's command: a plain body decoded straight into it
    (``kv_slot_tracker.http.fast_bodies``), any other through its model, with its messages."""
    cmd = fast_bodies.prefill_complete_body(raw)
    if cmd is None:
        cmd = prefill_command(parse_json(raw, schemas.RequestBody))
    return cmd


def decode_free(raw: bytes) -> commands.Free:
    """A ``/free`` body's command (as ``decode_prefill_complete``)."""
    cmd = fast_bodies.free_body(raw)
    if cmd is None:
        cmd = free_command(parse_json(raw, schemas.RequestBody))
    return cmd


def decode_output_block(raw: bytes) -> commands.OutputBlock:
    """An ``/output_block`` body's command (through its model: no plain path)."""
    return output_block_command(parse_json(raw, schemas.OutputBlockBody))


def worker_range(cls: type[R], b: schemas.RegisterBody) -> R:
    return cls(
        model_name=b.model_name,
        routing_group=b.routing_group,
        worker_id=b.worker_id,
        block_size=b.block_size,
        dp_start=b.dp_start,
        dp_size=b.dp_size,
    )


def _ranks(ws: Iterable[WorkerWithDpRank]) -> list[dict[str, int]]:
    return [{"worker_id": w.worker_id, "dp_rank": w.dp_rank} for w in ws]


BATCH_MODELS: dict[str, type[BaseModel]] = {
    "add": schemas.BatchAdd,
    "prefill_complete": schemas.BatchPrefillComplete,
    "free": schemas.BatchFree,
    "output_block": schemas.BatchOutputBlock,
}


class Operations:
    """Every body route's operation, by name (the route table names them): synchronous, each
    answering its ``Result``. A replicated instance composes them with what sharing state
    needs (``kv_slot_tracker.http.replicated.ReplicatedEdge``)."""

    def __init__(self, service: SlotTrackerService, max_batch: int) -> None:
        self.service = service
        self.max_batch = max_batch

    def get(self, name: str) -> Operation:
        """The named operation, answering expected errors with their status and body."""
        op: Callable[[bytes], Result] = getattr(self, name)

        def run(raw: bytes) -> Result:
            try:
                return op(raw)
            except EXPECTED as e:
                return error_result(e)

        return run

    # -- topology -------------------------------------------------------------------------

    def register(self, raw: bytes) -> Result:
        self.service.register(
            worker_range(commands.Register, parse_json(raw, schemas.RegisterBody))
        )
        return 201, OK

    def upsert(self, raw: bytes) -> Result:
        created = self.service.upsert(
            worker_range(commands.Upsert, parse_json(raw, schemas.UpsertBody))
        )
        return (201 if created else 200), OK

    def unregister(self, raw: bytes) -> Result:
        b = parse_json(raw, schemas.UnregisterBody)
        self.service.unregister(
            commands.Unregister(
                model_name=b.model_name, routing_group=b.routing_group, worker_id=b.worker_id
            )
        )
        return 200, OK

    def heartbeat(self, raw: bytes) -> Result:
        b = parse_json(raw, schemas.HeartbeatBody)
        self.service.heartbeat(
            commands.Heartbeat(
                model_name=b.model_name, routing_group=b.routing_group, worker_id=b.worker_id
            )
        )
        return 200, OK

    def reconcile(self, raw: bytes) -> Result:
        b = parse_json(raw, schemas.ReconcileBody)
        change = self.service.reconcile(
            commands.Reconcile(
                model_name=b.model_name,
                routing_group=b.routing_group,
                block_size=b.block_size,
                workers=[
                    WorkerDpRange(worker_id=w.worker_id, dp_start=w.dp_start, dp_size=w.dp_size)
                    for w in b.workers
                ],
            )
        )
        return 200, orjson.dumps({"added": _ranks(change.added), "removed": _ranks(change.removed)})

    # -- lifecycle ------------------------------------------------------------------------

    def add(self, raw: bytes) -> Result:
        cmd = fast_bodies.add_body(raw)
        if cmd is None:  # not plain: the validating path, with its messages
            cmd = add_command(parse_json(raw, schemas.AddBody))
        self.service.add(cmd)
        return 201, OK

    def prefill_complete(self, raw: bytes) -> Result:
        self.service.prefill_complete(decode_prefill_complete(raw))
        return 200, OK

    def free(self, raw: bytes) -> Result:
        self.service.free(decode_free(raw))
        return 200, OK

    def output_block(self, raw: bytes) -> Result:
        self.service.output_block(decode_output_block(raw))
        return 200, OK

    # -- queries --------------------------------------------------------------------------

    def potential_loads(self, raw: bytes) -> Result:
        cmd = fast_bodies.potential_loads_body(raw)
        if cmd is None:  # not plain: the validating path, with its messages
            b = parse_json(raw, schemas.PotentialLoadsBody)
            cmd = prompt_command(commands.PotentialLoads, b)
        return 200, load_columns_json(self.service.potential_loads(cmd))

    def project_loads(self, raw: bytes) -> Result:
        rows = self.service.project_loads(
            prompt_command(commands.ProjectLoads, parse_json(raw, schemas.ProjectLoadsBody))
        )
        return 200, orjson.dumps(rows)

    # -- batch ----------------------------------------------------------------------------

    def _apply(self, b: Any) -> bytes:
        """One well-formed batch operation; its result object."""
        service, name = self.service, b.op
        try:
            if name == "add":
                service.add(add_command(b))
                return BATCH_CREATED
            if name == "free":
                service.free(free_command(b))
            elif name == "prefill_complete":
                service.prefill_complete(prefill_command(b))
            else:
                service.output_block(output_block_command(b))
        except EXPECTED as e:
            return batch_error(e)
        return BATCH_DONE

    @staticmethod
    def _loose_op(op: Any) -> Any:
        """An operation of a batch that did not validate as a whole, validated on its own: its
        model, or its error result (bytes)."""
        try:
            if not isinstance(op, dict):
                raise HttpError(422, "operation must be a JSON object")
            name = op.get("op")
            model = BATCH_MODELS.get(name) if isinstance(name, str) else None
            if model is None:
                raise HttpError(
                    422, "`op` must be one of add, prefill_complete, free, output_block"
                )
            return parse_object(op, model)
        except HttpError as e:
            return batch_error(e)

    def batch(self, raw: bytes) -> Result:
        ops = fast_bodies.batch_operations(raw)
        if ops is None:  # not plain: the validating path, with its messages
            return self.run_batch(self.validated_batch(raw))
        self.check_size(len(ops))
        return self.run_commands(ops)

    def run_commands(self, ops: list[commands.BatchOperation]) -> Result:
        """A plain batch's commands (``kv_slot_tracker.http.fast_bodies.batch_operations``), in order."""
        service = self.service
        add, free = service.add, service.free
        results: list[Any] = []
        append = results.append
        free_cmd, add_cmd = commands.Free, commands.Add
        o: Any  # dispatched on its exact type below
        for o in ops:
            kind = type(o)
            try:
                if kind is free_cmd:
                    free(o)
                    append(BATCH_DONE)
                elif kind is add_cmd:
                    add(o)
                    append(BATCH_CREATED)
                elif kind is commands.PrefillComplete:
                    service.prefill_complete(o)
                    append(BATCH_DONE)
                else:
                    service.output_block(o)
                    append(BATCH_DONE)
            except EXPECTED as e:
                append(batch_error(e))
        return 200, b'{"results":[' + b",".join(results) + b"]}"

    def validated_batch(self, raw: bytes) -> list[Any]:
        """The operations of a batch body: each a validated model, or its error result (bytes)
        when it did not validate (the others still apply)."""
        ops: list[Any] | None = None
        if b"NaN" not in raw and b"Infinity" not in raw:
            # one validation pass when every operation is well formed (the common case)
            with contextlib.suppress(ValidationError):
                ops = schemas.StrictBatchBody.model_validate_json(raw).operations
        if ops is not None:
            self.check_size(len(ops))
        else:  # malformed somewhere: validate each operation alone so the others still apply
            loose = parse_json(raw, schemas.BatchBody).operations
            self.check_size(len(loose))
            ops = [self._loose_op(op) for op in loose]
        # an operation that validated with a key given twice is refused, as a single call is
        for i, key in repeated_fields(raw, "operations").items():
            if i < len(ops) and type(ops[i]) is not bytes:
                ops[i] = batch_error(HttpError(422, JSON_SHAPE + f"duplicate field `{key}`"))
        return ops

    def run_batch(self, ops: list[Any], apply: Callable[[Any], bytes] | None = None) -> Result:
        """``validated_batch``'s operations in order, each run by ``apply`` (by default as
        ``/batch`` runs it) unless it is already its error result."""
        apply = apply or self._apply
        results = [op if type(op) is bytes else apply(op) for op in ops]
        return 200, b'{"results":[' + b",".join(results) + b"]}"

    def check_size(self, n: int) -> None:
        """Refuse a batch of more than ``max_batch`` operations (before any runs)."""
        if n > self.max_batch:
            raise HttpError(422, "too many operations in one batch")


def batch_error(e: Exception) -> bytes:
    """A batch operation's result object for an error: its status and message."""
    status, message = describe(e)
    return orjson.dumps({"status": status, "error": message})
