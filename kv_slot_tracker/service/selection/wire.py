"""Selection records on the replica stream, and the selection state in a snapshot.

A selection record is the service's envelope plus ``{"selection": <one mutation>}``: the
changes of ``kv_slot_tracker.service.selection.mutations`` that other instances must repeat (a worker put
or removed, a booking's reservation entry and approximate-cache write, a pending selection, a
release), each declared once below as a msgspec struct of a tagged union (``op``) with every
field's type, range and length: a record decoder built on them
(``kv_slot_tracker.service.records``) checks a peer's change in C while decoding it, and
``mutation_from_wire`` only converts the checked values. A malformed record fails to decode;
the replica counts and skips it like any record it cannot apply.

The snapshot form (``export_selection`` / ``restore_selection`` in
``kv_slot_tracker.service.selection.replica``) reuses the same encoders for specs and pending entries;
instants travel as wall-clock nanoseconds.

Block hashes travel as unsigned u64, as they always did (an instance of an earlier version on
the same stream, and snapshots stored before, read and write the same records); inside they are
in the service's signed form, converted here (``kv_slot_tracker.core.hashing``).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Any, Literal, get_args

import msgspec
from msgspec import Meta

from kv_slot_tracker.core.bounds import U32, U64, U64_LIMIT
from kv_slot_tracker.core.events import Id, Name
from kv_slot_tracker.core.hashing import signed_hashes, unsigned_hashes
from kv_slot_tracker.core.limits import MAX_ID_LENGTH, MAX_NAME_LENGTH, MAX_TEXT_LENGTH
from kv_slot_tracker.core.selection.catalog import (
    KV_TRANSFER_ENFORCEMENTS,
    MAX_DP_SIZE,
    WorkerSpec,
    replay_endpoints_problem,
)
from kv_slot_tracker.core.selection.pending import PendingSelection
from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.service.selection import mutations


def _fail(what: str, value: Any) -> ValueError:
    return ValueError(f"malformed selection record: {what} = {value!r}")


def as_uint(v: Any, what: str, bound: int = U64_LIMIT) -> int:
    if type(v) is not int or not 0 <= v < bound:
        raise _fail(what, v)
    return v


# the longest string each field may hold, as the HTTP models allow (``kv_slot_tracker.core.limits``)
_LENGTH = {"model_name": MAX_NAME_LENGTH, "routing_group": MAX_NAME_LENGTH,
           "lora_name": MAX_NAME_LENGTH, "id": MAX_ID_LENGTH}  # fmt: skip


def as_str(v: Any, what: str) -> str:
    if type(v) is not str or len(v) > _LENGTH.get(what, MAX_TEXT_LENGTH):
        raise _fail(what, f"{v!r:.80}")
    return v


def _u64s(values: tuple[int, ...] | None) -> list[int] | None:
    """The service's (signed) hashes as a record carries them: unsigned 64-bit integers."""
    return None if values is None else unsigned_hashes(values)


def worker_to_wire(w: WorkerWithDpRank) -> list[int]:
    return [w.worker_id, w.dp_rank]


def worker_from_wire(v: Any) -> WorkerWithDpRank:
    """A ``[worker_id, dp_rank]`` of a snapshot (raises ``ValueError``)."""
    return WorkerWithDpRank(*msgspec.convert(v, Rank))


_SPEC_FIELDS = tuple(f.name for f in fields(WorkerSpec))


# -- mutations: the records ------------------------------------------------------------------

Text = Annotated[str, Meta(max_length=MAX_TEXT_LENGTH)]
Rank = tuple[U64, U32]  # [worker_id, dp_rank]
Enforcement = Literal["required", "preferred"]
assert set(get_args(Enforcement)) == set(KV_TRANSFER_ENFORCEMENTS)


class WireSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A ``WorkerSpec``: every field of the reference's body always present (null when not
    given); ``replay_endpoints`` (an extension) only when given, so a worker without it travels
    as an instance of an earlier version writes and reads it."""

    worker_id: U64
    model_name: Name
    routing_group: Name
    endpoint: Text | None
    kv_events_endpoint: Text | None
    kv_events_endpoints: dict[Text, Text] | None
    replay_endpoint: Text | None
    block_size: U32 | None
    data_parallel_start_rank: U32 | None
    data_parallel_size: U32 | None
    max_num_batched_tokens: U64 | None
    total_kv_blocks: U64 | None
    stable_routing_id: Text | None
    is_eagle: bool | None
    taints: list[Text]
    topology_domains: dict[Text, Text] | None
    kv_transfer_domain: Text | None
    kv_transfer_enforcement: Enforcement | None
    kv_transfer_preferred_weight: float | None
    replay_endpoints: Annotated[list[Text], Meta(max_length=MAX_DP_SIZE)] | None = None


assert WireSpec.__struct_fields__ == _SPEC_FIELDS, "every spec field travels"


class WirePending(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A ``PendingSelection``."""

    m: Name
    g: Name
    w: Rank
    sh: list[U64]
    bh: list[U64] | None
    isl: U64
    ept: U64
    track: bool
    eot: U64 | None
    lora: Name | None
    tok: bool


class _Op(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op"):
    pass


class WireBook(_Op, frozen=True, tag="book", omit_defaults=True):
    """A booking without what its request carries (that travels as a lifecycle record): the
    reservation and the approximate-cache write. ``s`` is absent without a session."""

    id: Id
    m: Name
    g: Name
    w: Rank
    bh: list[U64] | None
    ch: list[U64] | None
    cp: bool
    s: Text | None = None


class WireRelease(_Op, frozen=True, tag="release"):
    id: Id


class WireCacheSelection(_Op, frozen=True, tag="pending"):
    id: Id
    entry: WirePending


class WirePutWorker(_Op, frozen=True, tag="put_worker"):
    spec: WireSpec


class WireRemoveWorker(_Op, frozen=True, tag="remove_worker"):
    worker_id: U64


SelectionChange = WireBook | WireRelease | WireCacheSelection | WirePutWorker | WireRemoveWorker

Replicated = (
    mutations.PutWorker
    | mutations.RemoveWorker
    | mutations.Book
    | mutations.CacheSelection
    | mutations.Release
)


def change_hashes(c: SelectionChange) -> int:
    """The longest hash list of a change (each is bounded like a request's prompt)."""
    if type(c) is WireBook:
        return max(len(c.bh or ()), len(c.ch or ()))
    if type(c) is WireCacheSelection:
        return max(len(c.entry.sh), len(c.entry.bh or ()))
    return 0


def _pending_wire(p: PendingSelection) -> WirePending:
    return WirePending(
        p.model_name, p.routing_group, (p.worker.worker_id, p.worker.dp_rank),
        unsigned_hashes(p.sequence_hashes), _u64s(p.block_hashes), p.isl_tokens,
        p.effective_prefill_tokens, p.track_prefill_tokens, p.expected_output_tokens,
        p.lora_name, p.from_tokens,
    )  # fmt: skip


def _pending(v: WirePending) -> PendingSelection:
    return PendingSelection(
        model_name=v.m,
        routing_group=v.g,
        worker=WorkerWithDpRank(*v.w),
        sequence_hashes=tuple(signed_hashes(v.sh)),
        block_hashes=None if v.bh is None else tuple(signed_hashes(v.bh)),
        isl_tokens=v.isl,
        effective_prefill_tokens=v.ept,
        track_prefill_tokens=v.track,
        expected_output_tokens=v.eot,
        lora_name=v.lora,
        from_tokens=v.tok,
    )


def _spec_wire(spec: WorkerSpec) -> WireSpec:
    replay = None if spec.replay_endpoints is None else list(spec.replay_endpoints)
    return WireSpec(**{name: getattr(spec, name) for name in _SPEC_FIELDS}
                    | {"taints": list(spec.taints), "replay_endpoints": replay})  # fmt: skip


def _spec(v: WireSpec) -> WorkerSpec:
    out = {name: getattr(v, name) for name in _SPEC_FIELDS}
    out["taints"] = tuple(v.taints)
    if v.kv_events_endpoints is not None:
        out["kv_events_endpoints"] = dict(v.kv_events_endpoints)
    if v.replay_endpoints is not None:
        out["replay_endpoints"] = tuple(v.replay_endpoints)
    spec = WorkerSpec(**out)
    problem = replay_endpoints_problem(spec)  # as a registration is checked
    if problem is not None:
        raise _fail("replay_endpoints", problem)
    return spec


def mutation_to_wire(mutation: Replicated) -> SelectionChange:
    if isinstance(mutation, mutations.Book):
        return WireBook(
            mutation.selection_id, mutation.model_name, mutation.routing_group,
            (mutation.worker.worker_id, mutation.worker.dp_rank),
            _u64s(mutation.block_hashes), _u64s(mutation.cache_chain),
            mutation.consumes_pending, mutation.session_id,
        )  # fmt: skip
    if isinstance(mutation, mutations.Release):
        return WireRelease(mutation.selection_id)
    if isinstance(mutation, mutations.CacheSelection):
        return WireCacheSelection(mutation.selection_id, _pending_wire(mutation.entry))
    if isinstance(mutation, mutations.PutWorker):
        return WirePutWorker(_spec_wire(mutation.spec))
    return WireRemoveWorker(mutation.worker_id)


def mutation_from_wire(v: SelectionChange) -> Replicated:
    """A peer's selection change, decoded and checked (``SelectionChange``). A booking comes
    back without what its request carries (the request itself travels as a lifecycle record):
    only the reservation and cache write."""
    if type(v) is WireBook:
        if v.ch is not None and (v.bh is None or len(v.ch) != len(v.bh)):
            raise _fail("cache_chain", "length")
        return mutations.Book(
            selection_id=v.id,
            model_name=v.m,
            routing_group=v.g,
            worker=WorkerWithDpRank(*v.w),
            sequence_hashes=(),
            block_hashes=None if v.bh is None else tuple(signed_hashes(v.bh)),
            cache_chain=None if v.ch is None else tuple(signed_hashes(v.ch)),
            isl_tokens=0,
            prefill_tokens=0,
            consumes_pending=v.cp,
            session_id=v.s,
        )
    if type(v) is WireRelease:
        return mutations.Release(v.id)
    if type(v) is WireCacheSelection:
        return mutations.CacheSelection(v.id, _pending(v.entry))
    if type(v) is WirePutWorker:
        return mutations.PutWorker(_spec(v.spec))
    assert type(v) is WireRemoveWorker
    return mutations.RemoveWorker(v.worker_id)


# -- the snapshot form: the same structs, as plain maps ---------------------------------------


def spec_to_wire(spec: WorkerSpec) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(_spec_wire(spec))
    return out


def spec_from_wire(v: Any) -> WorkerSpec:
    """A spec of a snapshot, checked as a record's (raises ``ValueError``)."""
    return _spec(msgspec.convert(v, WireSpec))


def pending_to_wire(p: PendingSelection) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(_pending_wire(p))
    out["w"] = list(out["w"])  # a list, as a decoded snapshot holds it
    return out


def pending_from_wire(v: Any) -> PendingSelection:
    """A pending selection of a snapshot, checked as a record's (raises ``ValueError``)."""
    return _pending(msgspec.convert(v, WirePending))
