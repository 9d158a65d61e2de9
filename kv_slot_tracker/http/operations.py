"""Body-level operations: JSON bytes in, ``(status, JSON bytes)`` out.

Each operation decodes its body into the service's command (``kv_slot_tracker.service.commands``): a plain
body straight into it (``kv_slot_tracker.http.plain``), any other through its model (``kv_slot_tracker.http.body``,
``kv_slot_tracker.http.schemas``, which alone write error messages); then it runs the command and encodes
the answer. Every route, whichever path serves it (the lean dispatcher or FastAPI), runs the
same operation, so it answers identically. Expected errors become their status and
``{"error": ...}`` body through the one error table (``kv_slot_tracker.http.errors``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from kv_slot_tracker.core.types import WorkerDpRange
from kv_slot_tracker.http import plain as p
from kv_slot_tracker.http import schemas as s
from kv_slot_tracker.http.body import parse_json, parse_object, repeated_fields
from kv_slot_tracker.http.errors import EXPECTED, JSON_SHAPE, HttpError, describe, error_result
from kv_slot_tracker.http.responses import load_columns_json
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service import commands as c

OK = b'{"status":"ok"}'
_CREATED = b'{"status":201}'
_DONE = b'{"status":200}'

C = TypeVar("C", bound=c.Keyed)
P = TypeVar("P", bound=c.Prompt)
R = TypeVar("R", bound=c.Register)
Result = tuple[int, bytes]
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


def add_command(b: Any) -> c.Add:
    return prompt_command(c.Add, b)


def free_command(b: Any) -> c.Free:
    return command(c.Free, b)


def prefill_command(b: Any) -> c.PrefillComplete:
    return command(c.PrefillComplete, b)


def output_block_command(b: Any) -> c.OutputBlock:
    return command(c.OutputBlock, b)


def worker_range(cls: type[R], b: s.RegisterBody) -> R:
    return cls(
        model_name=b.model_name,
        routing_group=b.routing_group,
        worker_id=b.worker_id,
        block_size=b.block_size,
        dp_start=b.dp_start,
        dp_size=b.dp_size,
    )


def _ranks(ws) -> list[dict[str, int]]:
    return [{"worker_id": w.worker_id, "dp_rank": w.dp_rank} for w in ws]


BATCH_MODELS: dict[str, type[BaseModel]] = {
    "add": s.BatchAdd,
    "prefill_complete": s.BatchPrefillComplete,
    "free": s.BatchFree,
    "output_block": s.BatchOutputBlock,
}


class Operations:
    """Every body route's operation, by name (the route table names them)."""

    def __init__(self, service: SlotTrackerService, max_batch: int) -> None:
        self.service = service
        self.max_batch = max_batch

    def get(self, name: str) -> Operation:
        """The named operation, answering expected errors with their status and body."""
        op = getattr(self, name)

        def run(raw: bytes) -> Result:
            try:
                return op(raw)
            except EXPECTED as e:
                return error_result(e)

        return run

    # -- topology -------------------------------------------------------------------------

    def register(self, raw: bytes) -> Result:
        self.service.register(worker_range(c.Register, parse_json(raw, s.RegisterBody)))
        return 201, OK

    def upsert(self, raw: bytes) -> Result:
        created = self.service.upsert(worker_range(c.Upsert, parse_json(raw, s.UpsertBody)))
        return (201 if created else 200), OK

    def unregister(self, raw: bytes) -> Result:
        b = parse_json(raw, s.UnregisterBody)
        self.service.unregister(
            c.Unregister(
                model_name=b.model_name, routing_group=b.routing_group, worker_id=b.worker_id
            )
        )
        return 200, OK

    def heartbeat(self, raw: bytes) -> Result:
        b = parse_json(raw, s.HeartbeatBody)
        self.service.heartbeat(
            c.Heartbeat(
                model_name=b.model_name, routing_group=b.routing_group, worker_id=b.worker_id
            )
        )
        return 200, OK

    def reconcile(self, raw: bytes) -> Result:
        b = parse_json(raw, s.ReconcileBody)
        change = self.service.reconcile(
            c.Reconcile(
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
        cmd = p.add_body(raw)
        if cmd is None:  # not plain: the validating path, with its messages
            cmd = add_command(parse_json(raw, s.AddBody))
        self.service.add(cmd)
        return 201, OK

    def prefill_complete(self, raw: bytes) -> Result:
        cmd = p.prefill_complete_body(raw)
        if cmd is None:
            cmd = prefill_command(parse_json(raw, s.RequestBody))
        self.service.prefill_complete(cmd)
        return 200, OK

    def free(self, raw: bytes) -> Result:
        cmd = p.free_body(raw)
        if cmd is None:
            cmd = free_command(parse_json(raw, s.RequestBody))
        self.service.free(cmd)
        return 200, OK

    def output_block(self, raw: bytes) -> Result:
        self.service.output_block(output_block_command(parse_json(raw, s.OutputBlockBody)))
        return 200, OK

    # -- queries --------------------------------------------------------------------------

    def potential_loads(self, raw: bytes) -> Result:
        cmd = p.potential_loads_body(raw)
        if cmd is None:  # not plain: the validating path, with its messages
            b = parse_json(raw, s.PotentialLoadsBody)
            cmd = prompt_command(c.PotentialLoads, b)
        return 200, load_columns_json(self.service.potential_loads(cmd))

    def project_loads(self, raw: bytes) -> Result:
        rows = self.service.project_loads(
            prompt_command(c.ProjectLoads, parse_json(raw, s.ProjectLoadsBody))
        )
        return 200, orjson.dumps(rows)

    # -- batch ----------------------------------------------------------------------------

    def _apply(self, b: Any) -> bytes:
        """One well-formed batch operation; its result object."""
        service, name = self.service, b.op
        try:
            if name == "add":
                service.add(add_command(b))
                return _CREATED
            if name == "free":
                service.free(free_command(b))
            elif name == "prefill_complete":
                service.prefill_complete(prefill_command(b))
            else:
                service.output_block(output_block_command(b))
        except EXPECTED as e:
            return _batch_error(e)
        return _DONE

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
            return _batch_error(e)

    def batch(self, raw: bytes) -> Result:
        ops = p.batch_operations(raw)
        if ops is None:  # not plain: the validating path, with its messages
            return self._run_batch(self._batch_ops(raw))
        self._check_size(len(ops))
        return self._run_commands(ops)

    def _run_commands(self, ops: list[c.BatchOperation]) -> Result:
        """A plain batch's commands (``kv_slot_tracker.http.plain.batch_operations``), in order."""
        service = self.service
        add, free = service.add, service.free
        results: list[Any] = []
        append = results.append
        free_cmd, add_cmd = c.Free, c.Add
        o: Any  # dispatched on its exact type below
        for o in ops:
            kind = type(o)
            try:
                if kind is free_cmd:
                    free(o)
                    append(_DONE)
                elif kind is add_cmd:
                    add(o)
                    append(_CREATED)
                elif kind is c.PrefillComplete:
                    service.prefill_complete(o)
                    append(_DONE)
                else:
                    service.output_block(o)
                    append(_DONE)
            except EXPECTED as e:
                append(_batch_error(e))
        return 200, b'{"results":[' + b",".join(results) + b"]}"

    def _batch_ops(self, raw: bytes) -> list[Any]:
        """The operations of a batch body: each a validated model, or its error result (bytes)
        when it did not validate (the others still apply)."""
        ops: list[Any] | None = None
        if b"NaN" not in raw and b"Infinity" not in raw:
            # one validation pass when every operation is well formed (the common case)
            with contextlib.suppress(ValidationError):
                ops = s.StrictBatchBody.model_validate_json(raw).operations
        if ops is not None:
            self._check_size(len(ops))
        else:  # malformed somewhere: validate each operation alone so the others still apply
            loose = parse_json(raw, s.BatchBody).operations
            self._check_size(len(loose))
            ops = [self._loose_op(op) for op in loose]
        # an operation that validated with a key given twice is refused, as a single call is
        for i, key in repeated_fields(raw, "operations").items():
            if i < len(ops) and type(ops[i]) is not bytes:
                ops[i] = _batch_error(HttpError(422, JSON_SHAPE + f"duplicate field `{key}`"))
        return ops

    def _run_batch(self, ops: list[Any], apply: Callable[[Any], bytes] | None = None) -> Result:
        apply = apply or self._apply
        results = [op if type(op) is bytes else apply(op) for op in ops]
        return 200, b'{"results":[' + b",".join(results) + b"]}"

    def _check_size(self, n: int) -> None:
        if n > self.max_batch:
            raise HttpError(422, "too many operations in one batch")


def _batch_error(e: Exception) -> bytes:
    status, message = describe(e)
    return orjson.dumps({"status": status, "error": message})
