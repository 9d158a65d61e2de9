"""Replica events: what one tracker tells its peers about the request lifecycle (SPEC §6.1-§6.2).

The msgpack form matches serde's ``rmp_serde::to_vec_named``: structs are maps keyed by field name
in declaration order, unit variants are strings, the struct variant is a one-entry map, and a
``Duration`` is ``{"secs", "nanos"}``. A prompt's hashes travel unsigned (u64), the format
records always had; the service's own signed form (``kv_slot_tracker.core.hashing``) converts
here, in both directions, so instances of earlier versions read and write the same records.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import msgspec

from .hashing import signed_hashes, unsigned_hashes
from .types import NS_PER_S, U32_MAX, U64_MAX, PrefillLoadHint, WorkerWithDpRank


class AddRequest(msgspec.Struct, frozen=True):
    """A peer's add as the seeds' replica event carries it (``ActiveSequenceEventData::
    AddRequest``), not a second add command: what the producing tracker resolved from the
    command (``kv_slot_tracker.core.commands.Add``): the prompt as block hashes, whether prefill
    tokens are tracked, the prefill hint in nanoseconds. A peer applies these as they are,
    and the wire form stays the reference's."""

    token_sequence: list[int] | None = None
    track_prefill_tokens: bool = True
    expected_output_tokens: int | None = None
    prefill_load_hint: PrefillLoadHint | None = None


class Free(msgspec.Struct, frozen=True):
    pass


class MarkPrefillCompleted(msgspec.Struct, frozen=True):
    pass


EventData = AddRequest | Free | MarkPrefillCompleted
FREE = Free()
MARK_PREFILL_COMPLETED = MarkPrefillCompleted()


class ActiveSequenceEvent(msgspec.Struct, frozen=True):
    """One lifecycle change of one request. The event types are frozen msgspec structs, built
    in C: a peer's every record becomes one (and an add one more), where a frozen dataclass
    cost a ``object.__setattr__`` call per field."""

    request_id: str
    worker: WorkerWithDpRank
    data: EventData
    router_id: int
    lora_name: str | None = None


class EventDecodeError(ValueError):
    """A payload that is not a well-formed event (or batch)."""


# -- to/from plain msgpack-able objects -------------------------------------------------------


def duration_to_wire(ns: int | None) -> dict[str, int] | None:
    if ns is None:
        return None
    return {"secs": ns // NS_PER_S, "nanos": ns % NS_PER_S}


def duration_from_wire(obj: Any) -> int | None:
    if obj is None:
        return None
    if not isinstance(obj, dict) or set(obj) != {"secs", "nanos"}:
        raise EventDecodeError(f"invalid duration: {obj!r}")
    secs: int = obj["secs"]
    nanos: int = obj["nanos"]
    if not _is_uint(secs, 64) or not _is_uint(nanos, 32) or nanos >= NS_PER_S:
        raise EventDecodeError(f"invalid duration: {obj!r}")
    return secs * NS_PER_S + nanos


def worker_to_wire(w: WorkerWithDpRank) -> dict[str, int]:
    return {"worker_id": w.worker_id, "dp_rank": w.dp_rank}


def _is_uint(v: Any, bits: int) -> TypeGuard[int]:
    return type(v) is int and 0 <= v < (1 << bits)


def event_to_wire(ev: ActiveSequenceEvent) -> dict[str, Any]:
    d = ev.data
    if isinstance(d, AddRequest):
        hint = d.prefill_load_hint
        data: Any = {
            "AddRequest": {
                "token_sequence": None
                if d.token_sequence is None
                else unsigned_hashes(d.token_sequence),
                "track_prefill_tokens": d.track_prefill_tokens,
                "expected_output_tokens": d.expected_output_tokens,
                "prefill_load_hint": None
                if hint is None
                else {
                    "initial_effective_prefill_tokens": hint.initial_effective_prefill_tokens,
                    "expected_prefill_duration": duration_to_wire(
                        hint.expected_prefill_duration_ns
                    ),
                },
            }
        }
    elif isinstance(d, Free):
        data = "Free"
    else:
        data = "MarkPrefillCompleted"
    return {
        "request_id": ev.request_id,
        "worker": worker_to_wire(ev.worker),
        "data": data,
        "router_id": ev.router_id,
        "lora_name": ev.lora_name,
    }


def event_from_wire(obj: Any) -> ActiveSequenceEvent:
    """A peer's event as the record carries it, every field checked (types, u32/u64 ranges).

    Every applied record passes through here, so the checks are written for speed: one type
    test and two comparisons per number, and a prompt's hashes checked and converted in C
    (``hashes_from_wire``)."""
    if not isinstance(obj, dict) or "events" in obj:
        raise EventDecodeError("not an ActiveSequenceEvent")
    try:
        rid = obj["request_id"]
        w = obj["worker"]
        raw = obj["data"]
        router_id = obj["router_id"]
    except KeyError as e:
        raise EventDecodeError(f"missing field {e}") from None
    if not isinstance(w, dict):
        raise EventDecodeError(f"invalid worker: {w!r:.200}")
    wid, rank = w.get("worker_id"), w.get("dp_rank", 0)
    if (
        type(wid) is not int
        or type(rank) is not int
        or not 0 <= wid <= U64_MAX
        or not 0 <= rank <= U32_MAX
    ):
        raise EventDecodeError(f"invalid worker: {w!r:.200}")
    lora = obj.get("lora_name")
    if type(router_id) is not int or not isinstance(rid, str) or not 0 <= router_id <= U64_MAX:
        raise EventDecodeError("invalid request_id or router_id")
    if lora is not None and not isinstance(lora, str):
        raise EventDecodeError("invalid lora_name")
    data: EventData
    if isinstance(raw, dict):  # a map never equals the unit variants' strings
        add = raw.get("AddRequest")
        if not isinstance(add, dict) or len(raw) != 1:
            raise EventDecodeError(f"unknown event data: {raw!r:.200}")
        data = _add_from_wire(add)
    elif raw == "Free":
        data = FREE
    elif raw == "MarkPrefillCompleted":
        data = MARK_PREFILL_COMPLETED
    else:
        raise EventDecodeError(f"unknown event data: {raw!r:.200}")
    return ActiveSequenceEvent(rid, WorkerWithDpRank(wid, rank), data, router_id, lora)


_INT = {int}


def hashes_from_wire(seq: Any) -> list[int]:
    """A prompt as records carry it (a list of u64) in the service's signed form, checked and
    converted in C: the types (an int and nothing else, so not a bool either), then the range
    (``signed_hashes`` raises OverflowError below 0 and from 2^64). Raises EventDecodeError."""
    if not isinstance(seq, list):
        raise EventDecodeError("invalid token_sequence")
    if not seq:
        return []
    if set(map(type, seq)) != _INT:
        raise EventDecodeError("invalid token_sequence")
    try:
        return signed_hashes(seq)
    except OverflowError:
        raise EventDecodeError("invalid token_sequence") from None


def _add_from_wire(a: dict[str, Any]) -> AddRequest:
    seq = a.get("token_sequence")
    if seq is not None:
        seq = hashes_from_wire(seq)
    track = a.get("track_prefill_tokens", True)
    eot = a.get("expected_output_tokens")
    if type(track) is not bool or (
        eot is not None and (type(eot) is not int or not 0 <= eot <= U32_MAX)
    ):
        raise EventDecodeError("invalid AddRequest fields")
    raw_hint = a.get("prefill_load_hint")
    hint = None
    if raw_hint is not None:
        if not isinstance(raw_hint, dict):
            raise EventDecodeError("invalid prefill_load_hint")
        tokens = raw_hint.get("initial_effective_prefill_tokens")
        if not _is_uint(tokens, 64):
            raise EventDecodeError("invalid initial_effective_prefill_tokens")
        hint = PrefillLoadHint(
            tokens, duration_from_wire(raw_hint.get("expected_prefill_duration"))
        )
    return AddRequest(seq, track, eot, hint)
