"""A peer's replica record, checked with the rules of the call that would have produced it.

Records come from the shared stream, which anyone who reaches Redis can write to: a record is
input like an HTTP body. Before a record reaches a tracker it passes the checks the HTTP edge
and the service apply to the same values (``kv_slot_tracker.core.limits`` and
``kv_slot_tracker.service.topology_rules``): types, u32/u64 ranges, block sizes, rank caps, the prompt's
length. A record that fails is *rejected* with one of ``REASONS``; the replica counts it, logs
it (rate-limited) and goes on with the records behind it.
"""

from __future__ import annotations

from typing import Any

from kv_slot_tracker.core.events import EventDecodeError, event_from_wire
from kv_slot_tracker.core.limits import MAX_BLOCK_SIZE, MAX_ID_LENGTH, MAX_NAME_LENGTH
from kv_slot_tracker.core.types import U32_MAX, U64_MAX
from kv_slot_tracker.service.early import OPS

# Why a record was rejected (the ``reason`` label of the rejection counter; replication adds
# ``undecodable`` for stream entries that are not records at all):
ENVELOPE = "envelope"  # model_name, routing_group, block_size or the record kind
TOPOLOGY = "topology"  # a topology change of the wrong shape or beyond the limits
EVENT = "event"  # a lifecycle event of the wrong shape or beyond the limits
EARLY = "early"  # a tombstone or pending mark of the wrong shape
SELECTION = "selection"  # a selection change of the wrong shape or beyond the limits
CONFLICT = "conflict"  # well formed, but refused by the state here (e.g. block size)
REASONS = (ENVELOPE, TOPOLOGY, EVENT, EARLY, SELECTION, CONFLICT)

_KINDS = ("topology", "event", "early")


class RejectedRecord(ValueError):
    """A record refused before it reached the state; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _uint(v: Any, high: int) -> bool:
    return type(v) is int and 0 <= v <= high


def check_envelope(rec: dict[str, Any]) -> str:
    """A tracker record's key, block size and kind (``topology``, ``event`` or ``early``)."""
    kinds = [k for k in _KINDS if k in rec]
    if len(kinds) != 1:
        raise RejectedRecord(ENVELOPE, f"a record carries one of {_KINDS}, not {kinds}")
    if type(rec.get("model_name")) is not str or type(rec.get("routing_group")) is not str:
        raise RejectedRecord(
            ENVELOPE,
            f"model_name and routing_group must be strings, not "
            f"{rec.get('model_name')!r:.80}, {rec.get('routing_group')!r:.80}",
        )
    if len(rec["model_name"]) > MAX_NAME_LENGTH or len(rec["routing_group"]) > MAX_NAME_LENGTH:
        raise RejectedRecord(ENVELOPE, f"model_name or routing_group over {MAX_NAME_LENGTH}")
    if not _uint(rec.get("block_size"), MAX_BLOCK_SIZE):
        raise RejectedRecord(ENVELOPE, f"block_size {rec.get('block_size')!r:.80} is not a u32")
    return kinds[0]


def check_topology(op: Any) -> tuple[str, Any]:
    """A topology change's kind and, typed, what the service's topology methods take:
    ``(worker_id, dp_start, dp_size)`` for an upsert, ``worker_id`` for an unregister or a
    lease renewal and a
    list of those triples for a reconcile. The ranges and caps are the service's own checks
    (``topology_rules``), run by the caller with the tracker at hand."""
    if type(op) is not dict:
        raise RejectedRecord(TOPOLOGY, "topology is not a map")
    kind = op.get("op")
    if kind == "upsert":
        return kind, _triple([op.get("worker_id"), op.get("dp_start"), op.get("dp_size")])
    if kind in ("unregister", "renew"):
        wid = op.get("worker_id")
        if not _uint(wid, U64_MAX):
            raise RejectedRecord(TOPOLOGY, f"worker_id {wid!r:.80} is not a u64")
        return kind, wid
    if kind == "reconcile":
        workers = op.get("workers")
        if type(workers) is not list:
            raise RejectedRecord(TOPOLOGY, "reconcile workers is not a list")
        return kind, [_triple(w) for w in workers]
    raise RejectedRecord(TOPOLOGY, f"unknown topology op {kind!r:.80}")


def _triple(w: Any) -> tuple[int, int, int]:
    if (
        type(w) is not list
        or len(w) != 3
        or not _uint(w[0], U64_MAX)
        or not _uint(w[1], U32_MAX)
        or not _uint(w[2], U32_MAX)
    ):
        raise RejectedRecord(TOPOLOGY, f"worker range {w!r:.120} is not (u64, u32, u32)")
    return w[0], w[1], w[2]


def check_event(wire: Any, max_hashes: int) -> Any:
    """A lifecycle event decoded (``kv_slot_tracker.core.events`` checks every field's type and range), with
    at most ``max_hashes`` prompt blocks, as ``/add`` allows."""
    try:
        event = event_from_wire(wire)
    except EventDecodeError as err:
        raise RejectedRecord(EVENT, str(err)) from None
    if len(event.request_id) > MAX_ID_LENGTH:
        raise RejectedRecord(EVENT, f"request_id longer than {MAX_ID_LENGTH}")
    if event.lora_name is not None and len(event.lora_name) > MAX_NAME_LENGTH:
        raise RejectedRecord(EVENT, f"lora_name longer than {MAX_NAME_LENGTH}")
    seq = getattr(event.data, "token_sequence", None)
    if seq is not None and len(seq) > max_hashes:
        raise RejectedRecord(EVENT, f"{len(seq)} prompt blocks exceed the maximum {max_hashes}")
    return event


def check_selection(change: Any, max_hashes: int) -> None:
    """The lengths of a selection change's hash lists, as the selection routes bound them
    (the selection wire decoder checks every field's type and string length)."""
    if type(change) is not dict:
        return  # the decoder rejects it
    entry = change.get("entry")
    lists = [change.get("bh"), change.get("ch")]
    if type(entry) is dict:
        lists += [entry.get("sh"), entry.get("bh")]
    for hashes in lists:
        if type(hashes) is list and len(hashes) > max_hashes:
            raise RejectedRecord(
                SELECTION, f"{len(hashes)} block hashes exceed the maximum {max_hashes}"
            )


def check_early(op: Any) -> tuple[str, str]:
    """A tombstone or pending mark: ``(op, request_id)``."""
    if (
        type(op) is not dict
        or op.get("op") not in OPS
        or type(op.get("request_id")) is not str
        or len(op["request_id"]) > MAX_ID_LENGTH
    ):
        raise RejectedRecord(EARLY, f"malformed early call {op!r:.120}")
    return op["op"], op["request_id"]
