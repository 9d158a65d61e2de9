"""Body-level operations: JSON bytes in, ``(status, JSON bytes)`` out.

Each operation validates its body (``app.http.body``), builds the service's command
(``app.service.commands``), runs it and encodes the answer. Every route, whichever path serves it
(the lean dispatcher or FastAPI), runs the same operation, so it answers identically. Expected
errors become their status and ``{"error": ...}`` body through the one error table
(``app.http.errors``).
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Callable
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from app.core.types import U32_MAX, U64_MAX
from app.http import schemas as s
from app.http.body import parse_json, parse_object
from app.http.errors import EXPECTED, JSON_SHAPE, HttpError, describe, error_result
from app.service import SlotTrackerService
from app.service import commands as c

OK = b'{"status":"ok"}'
_CREATED = b'{"status":201}'
_DONE = b'{"status":200}'

Result = tuple[int, bytes]
Operation = Callable[[bytes], Result]

_POTENTIAL_ROW = (
    b'{"worker_id":%d,"dp_rank":%d,"potential_prefill_tokens":%d,'
    b'"potential_decode_blocks":%d,"active_requests":%d}'
)


def hashes_u64(hashes: list[int] | None) -> list[int] | None:
    """The API's signed 64-bit hashes reinterpreted bit for bit as unsigned."""
    if not hashes or min(hashes) >= 0:
        return hashes
    return [h & U64_MAX if h < 0 else h for h in hashes]


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
        "sequence_hashes": hashes_u64(b.sequence_hashes),
        "token_ids": b.token_ids,
        "lora_name": b.lora_name,
    }


def add_command(b: s.AddBody) -> c.Add:
    check_prompt(b)  # the hot path: no intermediate dict
    return c.Add(
        model_name=b.model_name,
        routing_group=b.routing_group,
        sequence_hashes=hashes_u64(b.sequence_hashes),
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
        if type(self).run is not Operations.run:  # a subclass wraps every call
            wrapped = self.run
            return lambda raw: wrapped(op, raw)

        def run(raw: bytes) -> Result:  # the common case: one call less per request
            try:
                return op(raw)
            except EXPECTED as e:
                return error_result(e)

        return run

    def run(self, op: Operation, raw: bytes) -> Result:
        """Run one operation, answering expected errors with their status and body."""
        try:
            return op(raw)
        except EXPECTED as e:
            return error_result(e)

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
        self.service.add(add_command(parse_json(raw, s.AddBody)))
        return 201, OK

    def prefill_complete(self, raw: bytes) -> Result:
        self.service.prefill_complete(prefill_command(parse_json(raw, s.RequestBody)))
        return 200, OK

    def free(self, raw: bytes) -> Result:
        self.service.free(free_command(parse_json(raw, s.RequestBody)))
        return 200, OK

    def output_block(self, raw: bytes) -> Result:
        self.service.output_block(output_block_command(parse_json(raw, s.OutputBlockBody)))
        return 200, OK

    # -- queries --------------------------------------------------------------------------

    def potential_loads(self, raw: bytes) -> Result:
        b = parse_json(raw, s.PotentialLoadsBody)
        cmd = c.PotentialLoads(**prompt_fields(b), new_isl_tokens=b.new_isl_tokens)
        rows = self.service.potential_loads(cmd)
        return 200, b"[" + b",".join([_POTENTIAL_ROW % row for row in rows]) + b"]"

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
        calls = self._plain_batch(raw)
        if calls is None:  # something unusual: the validating path, with its messages
            return self._run_batch(self._batch_ops(raw))
        self._check_size(len(calls))
        results = []
        append = results.append
        for call, cmd, ok in calls:
            try:
                call(cmd)
            except EXPECTED as e:
                append(_batch_error(e))
            else:
                append(ok)
        return 200, b'{"results":[' + b",".join(results) + b"]}"

    def _plain_batch(
        self, raw: bytes
    ) -> list[tuple[Callable[[Any], Any], c.Command, bytes]] | None:
        """The batch's operations as ``(service method, command, success result)``, when the
        body is plain: valid JSON whose operations have only their own fields, each of exactly
        its schema type and range (what ``StrictBatchBody`` accepts, checked on the decoded
        values without building models). None for anything else, which the validating path
        then answers; so this path never has to produce an error message."""
        if b"NaN" in raw or b"Infinity" in raw:
            return None  # the validating path tells these literals from strings
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if type(body) is not dict or len(body) != 1:
            return None
        ops = body.get("operations")
        if type(ops) is not list:
            return None
        # without a JSON boolean anywhere, array() checks int-ness and range in C
        no_bools = b"true" not in raw and b"false" not in raw
        service = self.service
        calls: list[tuple[Callable[[Any], Any], c.Command, bytes]] = []
        append = calls.append
        for d in ops:
            if type(d) is not dict:
                return None
            name = d.get("op")
            model = d.get("model_name")
            group = d.get("routing_group", DEFAULT_GROUP)
            rid = d.get("request_id")
            if type(model) is not str or type(group) is not str or type(rid) is not str:
                return None
            if name == "free" or name == "prefill_complete":
                if not d.keys() <= _REQUEST_KEYS:
                    return None
                if name == "free":
                    append(
                        (
                            service.free,
                            c.Free(model_name=model, routing_group=group, request_id=rid),
                            _DONE,
                        )
                    )
                else:
                    append(
                        (
                            service.prefill_complete,
                            c.PrefillComplete(
                                model_name=model, routing_group=group, request_id=rid
                            ),
                            _DONE,
                        )
                    )
            elif name == "add":
                cmd = _plain_add(d, model, group, rid, no_bools)
                if cmd is None:
                    return None
                append((service.add, cmd, _CREATED))
            elif name == "output_block":
                if not d.keys() <= _OUTPUT_KEYS:
                    return None
                frac = d.get("decay_fraction")
                if frac is not None and not (type(frac) in _NUMBER and 0 <= frac <= 1):
                    return None
                append(
                    (
                        service.output_block,
                        c.OutputBlock(
                            model_name=model,
                            routing_group=group,
                            request_id=rid,
                            decay_fraction=frac,
                        ),
                        _DONE,
                    )
                )
            else:
                return None
        return calls

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


DEFAULT_GROUP = "default"
_REQUEST_KEYS = frozenset({"op", "model_name", "routing_group", "request_id"})
_OUTPUT_KEYS = _REQUEST_KEYS | {"decay_fraction"}
_ADD_KEYS = _REQUEST_KEYS | {
    "worker_id",
    "dp_rank",
    "sequence_hashes",
    "token_ids",
    "new_isl_tokens",
    "expected_prefill_ms",
    "track_prefill_tokens",
    "expected_output_tokens",
    "lora_name",
}
_NUMBER = (int, float)
_ABSENT: Any = object()
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_MAX_PREFILL_MS = 1e12


def _ints(values: Any, code: str, low: int, high: int, no_bools: bool) -> bool:
    """Whether ``values`` is a list of ints (no bools) in ``low..high`` (``code``: the array
    type of exactly that range)."""
    if type(values) is not list:
        return False
    if not values:
        return True
    if no_bools:
        try:
            array(code, values)
        except (TypeError, OverflowError):
            return False
        return True
    return set(map(type, values)) == {int} and min(values) >= low and max(values) <= high


def _plain_add(d: dict[str, Any], model: str, group: str, rid: str, no_bools: bool) -> c.Add | None:
    """An add operation's command when its fields are plain (see ``_plain_batch``)."""
    if not d.keys() <= _ADD_KEYS:
        return None
    wid = d.get("worker_id")
    rank = d.get("dp_rank")
    if (
        type(wid) is not int
        or not 0 <= wid <= U64_MAX
        or type(rank) is not int
        or not 0 <= rank <= U32_MAX
    ):
        return None
    hashes = d.get("sequence_hashes", _ABSENT)  # an explicit null is invalid here
    tokens = d.get("token_ids", _ABSENT)
    if hashes is not _ABSENT:
        if tokens is not _ABSENT or not _ints(hashes, "q", _I64_MIN, _I64_MAX, no_bools):
            return None
        if hashes and min(hashes) < 0:
            hashes = [h & U64_MAX if h < 0 else h for h in hashes]
        tokens = None
    elif tokens is _ABSENT or not _ints(tokens, "I", 0, U32_MAX, no_bools):
        return None
    else:
        hashes = None
    isl = d.get("new_isl_tokens", 0)
    ms = d.get("expected_prefill_ms")
    track = d.get("track_prefill_tokens")
    eot = d.get("expected_output_tokens")
    lora = d.get("lora_name")
    if (
        type(isl) is not int
        or not 0 <= isl <= U64_MAX
        or (ms is not None and not (type(ms) in _NUMBER and 0 <= ms <= _MAX_PREFILL_MS))
        or (track is not None and type(track) is not bool)
        or (eot is not None and (type(eot) is not int or not 0 <= eot <= U32_MAX))
        or (lora is not None and type(lora) is not str)
    ):
        return None
    return c.Add(
        model_name=model,
        routing_group=group,
        sequence_hashes=hashes,
        token_ids=tokens,
        lora_name=lora,
        request_id=rid,
        worker_id=wid,
        dp_rank=rank,
        new_isl_tokens=isl,
        expected_prefill_ms=ms,
        track_prefill_tokens=track,
        expected_output_tokens=eot,
    )


def _batch_error(e: Exception) -> bytes:
    status, message = describe(e)
    return orjson.dumps({"status": status, "error": message})
