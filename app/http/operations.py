"""Body-level operations: JSON bytes in, ``(status, JSON bytes)`` out.

Each operation validates its body (``app.http.body``), builds the service's command
(``app.service.commands``), runs it and encodes the answer. Every route, whichever path serves it
(the lean dispatcher or FastAPI), runs the same operation, so it answers identically. Expected
errors become their status and ``{"error": ...}`` body through the one error table
(``app.http.errors``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from app.http import plain as p
from app.http import schemas as s
from app.http.body import parse_json, parse_object
from app.http.errors import EXPECTED, JSON_SHAPE, HttpError, describe, error_result
from app.http.responses import load_columns_json
from app.service import SlotTrackerService
from app.service import commands as c

OK = b'{"status":"ok"}'
_CREATED = b'{"status":201}'
_DONE = b'{"status":200}'

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


def prompt_fields(b: Any) -> dict[str, Any]:
    """A body's prompt fields, checked (``check_prompt``)."""
    check_prompt(b)
    return {
        "model_name": b.model_name,
        "routing_group": b.routing_group,
        "sequence_hashes": p.hashes_u64(b.sequence_hashes),
        "token_ids": b.token_ids,
        "lora_name": b.lora_name,
    }


def add_command(b: s.AddBody) -> c.Add:
    check_prompt(b)  # the hot path: no intermediate dict
    return c.Add(
        model_name=b.model_name,
        routing_group=b.routing_group,
        sequence_hashes=p.hashes_u64(b.sequence_hashes),
        token_ids=b.token_ids,
        lora_name=b.lora_name,
        request_id=b.request_id,
        worker_id=b.worker_id,
        dp_rank=b.dp_rank,
        new_isl_tokens=b.new_isl_tokens,
        expected_prefill_ms=b.expected_prefill_ms,
        track_prefill_tokens=b.track_prefill_tokens,
        expected_output_tokens=b.expected_output_tokens,
    )


def free_command(b: Any) -> c.Free:
    return c.Free(model_name=b.model_name, routing_group=b.routing_group, request_id=b.request_id)


def prefill_command(b: Any) -> c.PrefillComplete:
    return c.PrefillComplete(
        model_name=b.model_name, routing_group=b.routing_group, request_id=b.request_id
    )


def output_block_command(b: Any) -> c.OutputBlock:
    return c.OutputBlock(
        model_name=b.model_name,
        routing_group=b.routing_group,
        request_id=b.request_id,
        decay_fraction=b.decay_fraction,
    )


def worker_range(cls: type[c.Register], b: s.RegisterBody) -> c.Register:
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
        added, removed = self.service.reconcile(
            c.Reconcile(
                model_name=b.model_name,
                routing_group=b.routing_group,
                block_size=b.block_size,
                workers=[(w.worker_id, w.dp_start, w.dp_size) for w in b.workers],
            )
        )
        return 200, orjson.dumps({"added": _ranks(added), "removed": _ranks(removed)})

    # -- lifecycle ------------------------------------------------------------------------

    def add(self, raw: bytes) -> Result:
        fields = p.add_body(raw)
        if fields is None:  # not plain: the validating path, with its messages
            self.service.add(add_command(parse_json(raw, s.AddBody)))
        else:
            self.service.add_fields(*fields)
        return 201, OK

    def prefill_complete(self, raw: bytes) -> Result:
        fields = p.request_body(raw)
        if fields is None:
            self.service.prefill_complete(prefill_command(parse_json(raw, s.RequestBody)))
        else:
            self.service.prefill_complete_fields(*fields)
        return 200, OK

    def free(self, raw: bytes) -> Result:
        fields = p.request_body(raw)
        if fields is None:
            self.service.free(free_command(parse_json(raw, s.RequestBody)))
        else:
            self.service.free_fields(*fields)
        return 200, OK

    def output_block(self, raw: bytes) -> Result:
        self.service.output_block(output_block_command(parse_json(raw, s.OutputBlockBody)))
        return 200, OK

    # -- queries --------------------------------------------------------------------------

    def potential_loads(self, raw: bytes) -> Result:
        found = p.prompt_object(raw, p.POTENTIAL_KEYS)
        fields = p.potential_fields(*found) if found is not None else None
        if fields is None:  # not plain: the validating path, with its messages
            b = parse_json(raw, s.PotentialLoadsBody)
            cmd = c.PotentialLoads(**prompt_fields(b), new_isl_tokens=b.new_isl_tokens)
        else:
            model, group, hashes, tokens, lora, isl = fields
            cmd = c.PotentialLoads(model_name=model, routing_group=group, sequence_hashes=hashes,
                                   token_ids=tokens, lora_name=lora, new_isl_tokens=isl)  # fmt: skip
        return 200, load_columns_json(*self.service.potential_loads(cmd))

    def project_loads(self, raw: bytes) -> Result:
        rows = self.service.project_loads(
            c.ProjectLoads(**prompt_fields(parse_json(raw, s.ProjectLoadsBody)))
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
        service = self.service
        add, free = service.add_fields, service.free_fields
        results = []
        append = results.append
        batch_free, batch_add = p.BatchFree, p.BatchAdd
        for o in ops:
            kind = type(o)
            try:
                if kind is batch_free:
                    free(o.model_name, o.routing_group, o.request_id)
                    append(_DONE)
                elif kind is batch_add:
                    add(o.model_name, o.routing_group, o.sequence_hashes, o.token_ids,
                        o.lora_name, o.request_id, o.worker_id, o.dp_rank, o.new_isl_tokens,
                        o.expected_prefill_ms, o.track_prefill_tokens,
                        o.expected_output_tokens)  # fmt: skip
                    append(_CREATED)
                elif kind is p.BatchPrefillComplete:
                    service.prefill_complete_fields(o.model_name, o.routing_group, o.request_id)
                    append(_DONE)
                else:
                    service.output_block(output_block_command(o))
                    append(_DONE)
            except EXPECTED as e:
                append(_batch_error(e))
        return 200, b'{"results":[' + b",".join(results) + b"]}"

    def _batch_ops(self, raw: bytes) -> list[Any]:
        """The operations of a batch body: each a validated model, or its error result (bytes)
        when it did not validate (the others still apply)."""
        ops = None
        if b"NaN" not in raw and b"Infinity" not in raw:
            # one validation pass when every operation is well formed (the common case)
            with contextlib.suppress(ValidationError):
                ops = s.StrictBatchBody.model_validate_json(raw).operations
        if ops is not None:
            self._check_size(len(ops))
            return ops
        # malformed somewhere: validate each operation alone so the others still apply
        loose = parse_json(raw, s.BatchBody).operations
        self._check_size(len(loose))
        return [self._loose_op(op) for op in loose]

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
