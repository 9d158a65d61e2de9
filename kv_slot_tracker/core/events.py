"""Replica events: what one tracker tells its peers about the request lifecycle (SPEC §6.1-§6.2).

The msgpack form matches serde's ``rmp_serde::to_vec_named``: structs are maps keyed by field name
in declaration order, unit variants are strings, the struct variant is a one-entry map, and a
``Duration`` is ``{"secs", "nanos"}``. A prompt's hashes travel unsigned (u64), the format
records always had; the service's own signed form (``kv_slot_tracker.core.hashing``) converts
here, in both directions, so instances of earlier versions read and write the same records.

That form is declared once, as the ``Wire*`` structs below, with every field's type and range
(``kv_slot_tracker.core.bounds``, ``kv_slot_tracker.core.limits``): a record decoder built on
them (``kv_slot_tracker.service.records``) checks a peer's event in C while decoding it, with
the rules of the HTTP call that would have produced it; ``event_from_wire`` only converts the
checked values.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from .bounds import U32, U64
from .hashing import signed_hashes, unsigned_hashes
from .limits import MAX_ID_LENGTH, MAX_NAME_LENGTH
from .types import NS_PER_S, PrefillLoadHint, WorkerWithDpRank


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


# -- the wire form ---------------------------------------------------------------------------

Name = Annotated[str, Meta(max_length=MAX_NAME_LENGTH)]  # model, routing group, LoRA
Id = Annotated[str, Meta(max_length=MAX_ID_LENGTH)]  # request ids
Nanos = Annotated[int, Meta(ge=0, lt=NS_PER_S)]


class WireWorker(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    worker_id: U64
    dp_rank: U32 = 0


class WireDuration(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """serde's ``Duration``."""

    secs: U64
    nanos: Nanos


class WireHint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    initial_effective_prefill_tokens: U64
    expected_prefill_duration: WireDuration | None = None


class WireAdd(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    token_sequence: list[U64] | None = None
    track_prefill_tokens: bool = True
    expected_output_tokens: U32 | None = None
    prefill_load_hint: WireHint | None = None


class WireAddVariant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The struct variant: a one-entry map."""

    AddRequest: WireAdd  # noqa: N815 - serde's variant name


WireData = Literal["Free", "MarkPrefillCompleted"] | WireAddVariant


class WireEvent(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``ActiveSequenceEvent`` as a record carries it."""

    request_id: Id
    worker: WireWorker
    data: WireData
    router_id: U64
    lora_name: Name | None = None


def duration_to_wire(ns: int | None) -> WireDuration | None:
    if ns is None:
        return None
    return WireDuration(ns // NS_PER_S, ns % NS_PER_S)


def event_to_wire(ev: ActiveSequenceEvent) -> WireEvent:
    d = ev.data
    data: WireData
    if type(d) is AddRequest:
        hint = d.prefill_load_hint
        data = WireAddVariant(
            WireAdd(
                None if d.token_sequence is None else unsigned_hashes(d.token_sequence),
                d.track_prefill_tokens,
                d.expected_output_tokens,
                None
                if hint is None
                else WireHint(
                    hint.initial_effective_prefill_tokens,
                    duration_to_wire(hint.expected_prefill_duration_ns),
                ),
            )
        )
    elif type(d) is Free:
        data = "Free"
    else:
        data = "MarkPrefillCompleted"
    w = ev.worker
    return WireEvent(ev.request_id, WireWorker(w.worker_id, w.dp_rank), data, ev.router_id,
                     ev.lora_name)  # fmt: skip


def event_from_wire(wire: WireEvent, router_id: int | None = None) -> ActiveSequenceEvent:
    """A peer's event, decoded and checked (``WireEvent``), in the tracker's form: the
    prompt's hashes signed (converted in C). ``router_id``: instead of the one carried."""
    raw = wire.data
    data: EventData
    if raw == "Free":
        data = FREE
    elif raw == "MarkPrefillCompleted":
        data = MARK_PREFILL_COMPLETED
    else:
        add = raw.AddRequest
        seq = add.token_sequence
        hint = add.prefill_load_hint
        data = AddRequest(
            None if seq is None else signed_hashes(seq),
            add.track_prefill_tokens,
            add.expected_output_tokens,
            None
            if hint is None
            else PrefillLoadHint(
                hint.initial_effective_prefill_tokens,
                None
                if (d := hint.expected_prefill_duration) is None
                else d.secs * NS_PER_S + d.nanos,
            ),
        )
    w = wire.worker
    return ActiveSequenceEvent(
        wire.request_id,
        WorkerWithDpRank(w.worker_id, w.dp_rank),
        data,
        wire.router_id if router_id is None else router_id,
        wire.lora_name,
    )
