"""The replica records, each kind declared once, and their one decoder.

A record is what one instance tells the others about a change of its state: a topology change
of a tracker, a lifecycle event, an early call (tombstone or pending mark) or a selection
change. Each kind is a msgspec struct of one tagged union (``k``), its fields' types, ranges
and lengths declared with it (``kv_slot_tracker.core.bounds``, ``kv_slot_tracker.core.limits``,
the ``Wire*`` structs of ``kv_slot_tracker.core.events`` and
``kv_slot_tracker.service.selection.wire``), so that one decoder call checks a peer's record
in C with the rules of the HTTP call that would have produced it.

Replication carries a record as opaque bytes (``encode``) with an envelope of its own (origin,
incarnation, sequence number, producer's time; ``kv_slot_tracker.replication.records``) and
hands them back with the stream format they came in (``decode``):

* format 2 (this version): the ``Record`` union, msgpack, the kind in ``k``;
* format 1 (the versions before): the record and the envelope in one untagged msgpack map, the
  kind being whichever of ``event``, ``topology``, ``early``, ``selection`` the map holds. Its
  parts are the same structs, so a record of either format passes the same checks; an instance
  of this version reads a stream its predecessors wrote (a rolling upgrade).

A record that does not decode raises ``RejectedRecord`` with the reason of the part at fault
(``kv_slot_tracker.service.record_check.REASONS``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar

import msgspec

from kv_slot_tracker.core.bounds import U32, U64
from kv_slot_tracker.core.events import Id, Name, WireEvent
from kv_slot_tracker.service.record_check import (
    EARLY,
    ENVELOPE,
    EVENT,
    SELECTION,
    TOPOLOGY,
    RejectedRecord,
)
from kv_slot_tracker.service.selection.wire import SelectionChange

FORMAT = 2  # the stream format of ``encode``; ``decode`` reads this and format 1


# -- topology changes ---------------------------------------------------------------------------


class _TopologyOp(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="op"):
    pass


class Upsert(_TopologyOp, frozen=True, tag="upsert"):
    worker_id: U64
    dp_start: U32
    dp_size: U32


class Renew(_TopologyOp, frozen=True, tag="renew"):
    worker_id: U64


class Unregister(_TopologyOp, frozen=True, tag="unregister"):
    worker_id: U64


class Reconcile(_TopologyOp, frozen=True, tag="reconcile"):
    workers: list[tuple[U64, U32, U32]]  # (worker_id, dp_start, dp_size)


Topology = Upsert | Renew | Unregister | Reconcile


class EarlyCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A free (tombstone) or prefill completion (pending mark) of an id not known yet."""

    op: Literal["free", "prefill_complete"]
    request_id: Id


# -- records --------------------------------------------------------------------------------------


class _Tracked(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="k"):
    """A record of one tracker: its key and block size."""

    model_name: Name
    routing_group: Name
    block_size: U32


class EventRecord(_Tracked, frozen=True, tag="event"):
    event: WireEvent


class TopologyRecord(_Tracked, frozen=True, tag="topology"):
    topology: Topology


class EarlyRecord(_Tracked, frozen=True, tag="early"):
    early: EarlyCall


class SelectionRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="k",
                      tag="selection"):  # fmt: skip
    selection: SelectionChange


Record = EventRecord | TopologyRecord | EarlyRecord | SelectionRecord

_encoder = msgspec.msgpack.Encoder()
_decode = msgspec.msgpack.Decoder(Record).decode


def encode(record: Record) -> bytes:
    """A record as replication carries it (format ``FORMAT``)."""
    return _encoder.encode(record)


T = TypeVar("T")

# the part of a record a decoding error's path points into, and the reason it makes
_REASONS = {"event": EVENT, "topology": TOPOLOGY, "early": EARLY, "selection": SELECTION}


def _rejected(err: msgspec.MsgspecError) -> RejectedRecord:
    text = str(err)
    _, at, path = text.rpartition("- at `$.")
    part = path.split(".", 1)[0].split("[", 1)[0].rstrip("`") if at else ""
    return RejectedRecord(_REASONS.get(part, ENVELOPE), text)


def decode(payload: bytes, fmt: int) -> Record:
    """A record of stream format ``fmt`` from its bytes, every field checked. Raises
    ``RejectedRecord``."""
    if fmt == FORMAT:
        try:
            return _decode(payload)
        except msgspec.MsgspecError as err:
            raise _rejected(err) from None
    if fmt == 1:
        return _from_format_1(payload)
    raise RejectedRecord(ENVELOPE, f"stream format {fmt} is not one this version reads")


# -- format 1 -------------------------------------------------------------------------------------


_ABSENT = msgspec.Raw()  # a kind the record does not carry (a present one is never empty)


class _Format1(msgspec.Struct, frozen=True):
    """A record of format 1: the envelope's fields (``origin``, ``incarnation``, ``seq``, ``ts``
    are replication's, read by it) and exactly one kind, decoded once the kind is known."""

    model_name: Name | None = None
    routing_group: Name | None = None
    block_size: U32 | None = None
    event: msgspec.Raw = _ABSENT
    topology: msgspec.Raw = _ABSENT
    early: msgspec.Raw = _ABSENT
    selection: msgspec.Raw = _ABSENT


_decode_1 = msgspec.msgpack.Decoder(_Format1).decode
_decode_event = msgspec.msgpack.Decoder(WireEvent).decode
_decode_topology = msgspec.msgpack.Decoder(Topology).decode
_decode_early = msgspec.msgpack.Decoder(EarlyCall).decode
_decode_selection = msgspec.msgpack.Decoder(SelectionChange).decode
_KINDS = ("event", "topology", "early", "selection")


def _from_format_1(payload: bytes) -> Record:
    try:
        r = _decode_1(payload)
    except msgspec.MsgspecError as err:
        raise RejectedRecord(ENVELOPE, str(err)) from None
    parts = {"event": r.event, "topology": r.topology, "early": r.early, "selection": r.selection}
    kinds = [k for k, v in parts.items() if v]
    if len(kinds) != 1:
        raise RejectedRecord(ENVELOPE, f"a record carries one of {_KINDS}, not {kinds}")
    kind = kinds[0]
    raw = parts[kind]
    # each kind's part is decoded before the envelope is checked (its errors come first)
    if kind == "selection":
        return SelectionRecord(_part(kind, _decode_selection, raw))
    if kind == "event":
        event = _part(kind, _decode_event, raw)
        return EventRecord(*_envelope(r), event)
    if kind == "topology":
        topology = _part(kind, _decode_topology, raw)
        return TopologyRecord(*_envelope(r), topology)
    early = _part(kind, _decode_early, raw)
    return EarlyRecord(*_envelope(r), early)


def _part(kind: str, decode: Callable[[msgspec.Raw], T], raw: msgspec.Raw) -> T:
    try:
        return decode(raw)
    except msgspec.MsgspecError as err:
        raise RejectedRecord(_REASONS[kind], str(err)) from None


def _envelope(r: _Format1) -> tuple[str, str, int]:
    """The partition and block size a record of a tracker's kind carries."""
    model, group, block_size = r.model_name, r.routing_group, r.block_size
    if model is None or group is None or block_size is None:
        raise RejectedRecord(ENVELOPE, "model_name, routing_group and block_size are required")
    return model, group, block_size
