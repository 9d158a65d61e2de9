"""Body-level operations: JSON bytes in, ``(status, JSON bytes)`` out.

The FastAPI routes and the lean ASGI path (``app.api.fast``) both call these, so a route answers
identically whichever path serves it. Validation errors and service errors become the same
``{"error": ...}`` bodies here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from app.api import schemas as s
from app.api.body import parse_json, parse_object
from app.service import AddCall, ServiceError, SlotTrackerService

OK = b'{"status":"ok"}'
_CREATED = b'{"status":201}'
_DONE = b'{"status":200}'
_U64 = 0xFFFF_FFFF_FFFF_FFFF

Result = tuple[int, bytes]


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def key_of(body: Any) -> tuple[str, str]:
    return (body.model_name, body.routing_group)


def hashes_u64(hashes: list[int] | None) -> list[int] | None:
    """The API's signed 64-bit hashes reinterpreted bit for bit as unsigned."""
    if not hashes or min(hashes) >= 0:
        return hashes
    return [h & _U64 if h < 0 else h for h in hashes]


_POTENTIAL_ROW = (
    b'{"worker_id":%d,"dp_rank":%d,"potential_prefill_tokens":%d,'
    b'"potential_decode_blocks":%d,"active_requests":%d}'
)


def add_call(b: s.AddBody) -> AddCall:
    return AddCall(
        b.model_name,
        b.routing_group,
        b.request_id,
        b.worker_id,
        b.dp_rank,
        hashes_u64(b.sequence_hashes),
        b.token_ids,
        b.new_isl_tokens,
        b.expected_prefill_ms,
        b.track_prefill_tokens,
        b.expected_output_tokens,
        b.lora_name,
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
    def __init__(self, service: SlotTrackerService) -> None:
        self.service = service
        self.by_name: dict[str, Callable[[bytes], Result]] = {
            "register": self.register,
            "upsert": self.upsert,
            "unregister": self.unregister,
            "reconcile": self.reconcile,
            "add": self.add,
            "prefill_complete": self.prefill_complete,
            "free": self.free,
            "output_block": self.output_block,
            "potential_loads": self.potential_loads,
            "project_loads": self.project_loads,
            "batch": self.batch,
        }

    def run(self, name: str, raw: bytes) -> Result:
        """Run one operation; every ``ServiceError`` becomes its status and error body."""
        try:
            return self.by_name[name](raw)
        except ServiceError as e:
            return e.status, error_body(e.message)

    # -- topology -------------------------------------------------------------------------

    def register(self, raw: bytes) -> Result:
        b = parse_json(raw, s.RegisterBody)
        self.service.register(key_of(b), b.worker_id, b.block_size, b.dp_start, b.dp_size)
        return 201, OK

    def upsert(self, raw: bytes) -> Result:
        b = parse_json(raw, s.UpsertBody)
        created = self.service.upsert(key_of(b), b.worker_id, b.block_size, b.dp_start, b.dp_size)
        return (201 if created else 200), OK

    def unregister(self, raw: bytes) -> Result:
        b = parse_json(raw, s.UnregisterBody)
        self.service.unregister(key_of(b), b.worker_id)
        return 200, OK

    def reconcile(self, raw: bytes) -> Result:
        b = parse_json(raw, s.ReconcileBody)
        added, removed = self.service.reconcile(
            key_of(b), b.block_size, [(w.worker_id, w.dp_start, w.dp_size) for w in b.workers]
        )
        return 200, orjson.dumps({"added": _ranks(added), "removed": _ranks(removed)})

    # -- lifecycle ------------------------------------------------------------------------

    def add(self, raw: bytes) -> Result:
        self.service.add(add_call(parse_json(raw, s.AddBody)))
        return 201, OK

    def prefill_complete(self, raw: bytes) -> Result:
        b = parse_json(raw, s.RequestBody)
        self.service.prefill_complete(key_of(b), b.request_id)
        return 200, OK

    def free(self, raw: bytes) -> Result:
        b = parse_json(raw, s.RequestBody)
        self.service.free(key_of(b), b.request_id)
        return 200, OK

    def output_block(self, raw: bytes) -> Result:
        b = parse_json(raw, s.OutputBlockBody)
        self.service.output_block(key_of(b), b.request_id, b.decay_fraction)
        return 200, OK

    # -- queries --------------------------------------------------------------------------

    def potential_loads(self, raw: bytes) -> Result:
        b = parse_json(raw, s.PotentialLoadsBody)
        rows = self.service.potential_loads(
            key_of(b), hashes_u64(b.sequence_hashes), b.token_ids, b.lora_name, b.new_isl_tokens
        )
        return 200, b"[" + b",".join([_POTENTIAL_ROW % row for row in rows]) + b"]"

    def project_loads(self, raw: bytes) -> Result:
        b = parse_json(raw, s.ProjectLoadsBody)
        rows = self.service.project_loads(
            key_of(b), hashes_u64(b.sequence_hashes), b.token_ids, b.lora_name
        )
        return 200, orjson.dumps(rows)

    # -- batch ----------------------------------------------------------------------------

    def _apply(self, name: str, b: Any) -> bytes:
        service = self.service
        if name == "add":
            service.add(add_call(b))
            return _CREATED
        if name == "prefill_complete":
            service.prefill_complete(key_of(b), b.request_id)
        elif name == "free":
            service.free(key_of(b), b.request_id)
        else:
            service.output_block(key_of(b), b.request_id, b.decay_fraction)
        return _DONE

    def _batch_op(self, op: Any) -> bytes:
        try:
            if not isinstance(op, dict):
                raise ServiceError(422, "operation must be a JSON object")
            name = op.get("op")
            model = BATCH_MODELS.get(name) if isinstance(name, str) else None
            if model is None:
                raise ServiceError(
                    422, "`op` must be one of add, prefill_complete, free, output_block"
                )
            return self._apply(name, parse_object(op, model))
        except ServiceError as e:
            return orjson.dumps({"status": e.status, "error": e.message})

    def _strict_op(self, b: Any) -> bytes:
        try:
            return self._apply(b.op, b)
        except ServiceError as e:
            return orjson.dumps({"status": e.status, "error": e.message})

    def batch(self, raw: bytes) -> Result:
        ops = None
        if b"NaN" not in raw and b"Infinity" not in raw:
            # one validation pass when every operation is well formed (the common case)
            with contextlib.suppress(ValidationError):
                ops = s.StrictBatchBody.model_validate_json(raw).operations
        if ops is not None:
            self._check_size(len(ops))
            results = [self._strict_op(b) for b in ops]
        else:
            # malformed somewhere: validate each operation alone so the others still apply
            loose = parse_json(raw, s.BatchBody).operations
            self._check_size(len(loose))
            results = [self._batch_op(op) for op in loose]
        return 200, b'{"results":[' + b",".join(results) + b"]}"

    def _check_size(self, n: int) -> None:
        if n > self.service.max_hashes:
            raise ServiceError(422, "too many operations in one batch")
