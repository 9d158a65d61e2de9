"""Selection records on the replica stream, and the selection state in a snapshot.

A selection record is the service's envelope plus ``{"selection": <one mutation>}``: the
changes of ``kv_slot_tracker.service.selection.mutations`` that other instances must repeat (a worker put
or removed, a booking's reservation entry and approximate-cache write, a pending selection, a
release). Decoding checks every field's type: a malformed record raises ``ValueError``, which
the replica counts and skips like any record it cannot apply.

The snapshot form (``export_selection`` / ``restore_selection`` in
``kv_slot_tracker.service.selection.replica``) reuses the same encoders for specs and pending entries;
instants travel as wall-clock nanoseconds.

Block hashes travel as unsigned u64, as they always did (an instance of an earlier version on
the same stream, and snapshots stored before, read and write the same records); inside they are
in the service's signed form, converted here (``kv_slot_tracker.core.hashing``).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from kv_slot_tracker.core.hashing import signed_hashes, unsigned_hashes
from kv_slot_tracker.core.limits import MAX_ID_LENGTH, MAX_NAME_LENGTH, MAX_TEXT_LENGTH
from kv_slot_tracker.core.selection.catalog import KV_TRANSFER_ENFORCEMENTS, WorkerSpec
from kv_slot_tracker.core.selection.pending import PendingSelection
from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.service.selection import mutations as m

U64 = 1 << 64
U32 = 1 << 32


def _fail(what: str, value: Any) -> ValueError:
    return ValueError(f"malformed selection record: {what} = {value!r}")


def as_uint(v: Any, what: str, bound: int = U64) -> int:
    if type(v) is not int or not 0 <= v < bound:
        raise _fail(what, v)
    return v


def _opt_uint(v: Any, what: str, bound: int = U64) -> int | None:
    return None if v is None else as_uint(v, what, bound)


# the longest string each field may hold, as the HTTP models allow (``kv_slot_tracker.core.limits``)
_LENGTH = {"model_name": MAX_NAME_LENGTH, "routing_group": MAX_NAME_LENGTH,
           "lora_name": MAX_NAME_LENGTH, "id": MAX_ID_LENGTH}  # fmt: skip


def as_str(v: Any, what: str) -> str:
    if type(v) is not str or len(v) > _LENGTH.get(what, MAX_TEXT_LENGTH):
        raise _fail(what, f"{v!r:.80}")
    return v


def _opt_str(v: Any, what: str) -> str | None:
    return None if v is None else as_str(v, what)


def _enforcement(v: Any, what: str) -> str | None:
    if v is not None and v not in KV_TRANSFER_ENFORCEMENTS:
        raise _fail(what, v)
    return v


def _hashes(v: Any, what: str) -> tuple[int, ...]:
    """A record's u64 hashes in the service's signed form."""
    if type(v) is not list or not all(type(h) is int and 0 <= h < U64 for h in v):
        raise _fail(what, "…" if type(v) is list else v)
    return tuple(signed_hashes(v))


def _opt_hashes(v: Any, what: str) -> tuple[int, ...] | None:
    return None if v is None else _hashes(v, what)


def _u64s(values: tuple[int, ...] | None) -> list[int] | None:
    """The service's (signed) hashes as a record carries them: unsigned 64-bit integers."""
    return None if values is None else unsigned_hashes(values)


def worker_to_wire(w: WorkerWithDpRank) -> list[int]:
    return [w.worker_id, w.dp_rank]


def worker_from_wire(v: Any) -> WorkerWithDpRank:
    if type(v) is not list or len(v) != 2:
        raise _fail("worker", v)
    return WorkerWithDpRank(as_uint(v[0], "worker_id"), as_uint(v[1], "dp_rank", U32))


# -- worker specs ----------------------------------------------------------------------------


def _str_map(v: Any, what: str) -> dict[str, str] | None:
    if v is None:
        return None
    if type(v) is not dict or not all(
        type(k) is str and type(x) is str and len(k) <= MAX_TEXT_LENGTH >= len(x)
        for k, x in v.items()
    ):
        raise _fail(what, f"{v!r:.80}")
    return dict(v)


def _opt_bool(v: Any, what: str) -> bool | None:
    if v is not None and type(v) is not bool:
        raise _fail(what, v)
    return v


def _opt_float(v: Any, what: str) -> float | None:
    if v is None:
        return None
    if type(v) not in (int, float):
        raise _fail(what, v)
    return float(v)


def _taints(v: Any, what: str) -> tuple[str, ...]:
    if type(v) is not list or not all(type(t) is str and len(t) <= MAX_TEXT_LENGTH for t in v):
        raise _fail(what, f"{v!r:.80}")
    return tuple(v)


_SPEC_FIELDS: dict[str, Any] = {
    "worker_id": as_uint,
    "model_name": as_str,
    "routing_group": as_str,
    "endpoint": _opt_str,
    "kv_events_endpoint": _opt_str,
    "kv_events_endpoints": _str_map,
    "replay_endpoint": _opt_str,
    "block_size": lambda v, w: _opt_uint(v, w, U32),
    "data_parallel_start_rank": lambda v, w: _opt_uint(v, w, U32),
    "data_parallel_size": lambda v, w: _opt_uint(v, w, U32),
    "max_num_batched_tokens": _opt_uint,
    "total_kv_blocks": _opt_uint,
    "stable_routing_id": _opt_str,
    "is_eagle": _opt_bool,
    "taints": _taints,
    "topology_domains": _str_map,
    "kv_transfer_domain": _opt_str,
    "kv_transfer_enforcement": _enforcement,
    "kv_transfer_preferred_weight": _opt_float,
}
assert set(_SPEC_FIELDS) == {f.name for f in fields(WorkerSpec)}, "every spec field travels"


def spec_to_wire(spec: WorkerSpec) -> dict[str, Any]:
    out = {name: getattr(spec, name) for name in _SPEC_FIELDS}
    out["taints"] = list(spec.taints)
    return out


def spec_from_wire(v: Any) -> WorkerSpec:
    if type(v) is not dict or set(v) != _SPEC_FIELDS.keys():
        raise _fail("worker spec", v)
    return WorkerSpec(**{name: check(v[name], name) for name, check in _SPEC_FIELDS.items()})


# -- pending selections ----------------------------------------------------------------------


def pending_to_wire(p: PendingSelection) -> dict[str, Any]:
    return {
        "m": p.model_name,
        "g": p.routing_group,
        "w": worker_to_wire(p.worker),
        "sh": _u64s(p.sequence_hashes),
        "bh": _u64s(p.block_hashes),
        "isl": p.isl_tokens,
        "ept": p.effective_prefill_tokens,
        "track": p.track_prefill_tokens,
        "eot": p.expected_output_tokens,
        "lora": p.lora_name,
        "tok": p.from_tokens,
    }


def pending_from_wire(v: Any) -> PendingSelection:
    if type(v) is not dict:
        raise _fail("pending selection", v)
    try:
        track, tok = v["track"], v["tok"]
        if type(track) is not bool or type(tok) is not bool:
            raise _fail("pending flags", (track, tok))
        return PendingSelection(
            model_name=as_str(v["m"], "model_name"),
            routing_group=as_str(v["g"], "routing_group"),
            worker=worker_from_wire(v["w"]),
            sequence_hashes=_hashes(v["sh"], "sequence_hashes"),
            block_hashes=_opt_hashes(v["bh"], "block_hashes"),
            isl_tokens=as_uint(v["isl"], "isl_tokens"),
            effective_prefill_tokens=as_uint(v["ept"], "effective_prefill_tokens"),
            track_prefill_tokens=track,
            expected_output_tokens=_opt_uint(v["eot"], "expected_output_tokens"),
            lora_name=_opt_str(v["lora"], "lora_name"),
            from_tokens=tok,
        )
    except KeyError as e:
        raise _fail("pending selection field", str(e)) from None


# -- mutations -------------------------------------------------------------------------------

Replicated = m.PutWorker | m.RemoveWorker | m.Book | m.CacheSelection | m.Release


def mutation_to_wire(mutation: Replicated) -> dict[str, Any]:
    if isinstance(mutation, m.Book):
        book = {
            "op": "book",
            "id": mutation.selection_id,
            "m": mutation.model_name,
            "g": mutation.routing_group,
            "w": worker_to_wire(mutation.worker),
            "bh": _u64s(mutation.block_hashes),
            "ch": _u64s(mutation.cache_chain),
            "cp": mutation.consumes_pending,
        }
        if mutation.session_id is not None:  # absent from older records: no session
            book["s"] = mutation.session_id
        return book
    if isinstance(mutation, m.Release):
        return {"op": "release", "id": mutation.selection_id}
    if isinstance(mutation, m.CacheSelection):
        return {
            "op": "pending",
            "id": mutation.selection_id,
            "entry": pending_to_wire(mutation.entry),
        }
    if isinstance(mutation, m.PutWorker):
        return {"op": "put_worker", "spec": spec_to_wire(mutation.spec)}
    return {"op": "remove_worker", "worker_id": mutation.worker_id}


def mutation_from_wire(v: Any) -> Replicated:
    """A peer's selection change. A booking comes back without what its request carries (the
    request itself travels as a lifecycle record): only the reservation and cache write."""
    if type(v) is not dict:
        raise _fail("selection", v)
    op = v.get("op")
    try:
        if op == "book":
            consumes = v["cp"]
            if type(consumes) is not bool:
                raise _fail("cp", consumes)
            block_hashes = _opt_hashes(v["bh"], "block_hashes")
            chain = _opt_hashes(v["ch"], "cache_chain")
            if chain is not None and (block_hashes is None or len(chain) != len(block_hashes)):
                raise _fail("cache_chain", "length")
            return m.Book(
                selection_id=as_str(v["id"], "id"),
                model_name=as_str(v["m"], "model_name"),
                routing_group=as_str(v["g"], "routing_group"),
                worker=worker_from_wire(v["w"]),
                sequence_hashes=(),
                block_hashes=block_hashes,
                cache_chain=chain,
                isl_tokens=0,
                prefill_tokens=0,
                consumes_pending=consumes,
                session_id=_opt_str(v.get("s"), "session_id"),
            )
        if op == "release":
            return m.Release(as_str(v["id"], "id"))
        if op == "pending":
            return m.CacheSelection(as_str(v["id"], "id"), pending_from_wire(v["entry"]))
        if op == "put_worker":
            return m.PutWorker(spec_from_wire(v["spec"]))
        if op == "remove_worker":
            return m.RemoveWorker(as_uint(v["worker_id"], "worker_id"))
    except KeyError as e:
        raise _fail("field", str(e)) from None
    raise _fail("op", op)
