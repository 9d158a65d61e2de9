"""Dynamo's ZMQ replica-sync payloads (msgpack) for the seed wire tests: a singleton
``ActiveSequenceEvent`` or an ``ActiveSequenceEventBatch``. The service replicates through Redis
records instead, so only the tests speak this format; the event in it is the records' own
(``kv_slot_tracker.core.events.WireEvent``)."""

from __future__ import annotations

import msgspec

from kv_slot_tracker.core.events import (
    ActiveSequenceEvent,
    EventDecodeError,
    WireEvent,
    event_from_wire,
    event_to_wire,
)


class _Batch(msgspec.Struct, forbid_unknown_fields=True):
    events: list[WireEvent]


_encode = msgspec.msgpack.Encoder().encode
_decode_event = msgspec.msgpack.Decoder(WireEvent).decode
_decode_batch = msgspec.msgpack.Decoder(_Batch).decode

# -- bytes ------------------------------------------------------------------------------------


def encode_event(ev: ActiveSequenceEvent) -> bytes:
    """A singleton payload: one ``ActiveSequenceEvent``."""
    return _encode(event_to_wire(ev))


def encode_batch(events: list[ActiveSequenceEvent]) -> bytes:
    """A batch payload: ``ActiveSequenceEventBatch {events: [...]}``."""
    return _encode(_Batch([event_to_wire(e) for e in events]))


def decode_event(payload: bytes) -> ActiveSequenceEvent:
    try:
        return event_from_wire(_decode_event(payload))
    except msgspec.MsgspecError as e:
        raise EventDecodeError(f"not an ActiveSequenceEvent: {e}") from None


def decode_batch(payload: bytes) -> list[ActiveSequenceEvent]:
    try:
        return [event_from_wire(e) for e in _decode_batch(payload).events]
    except msgspec.MsgspecError as e:
        raise EventDecodeError(f"not an ActiveSequenceEventBatch: {e}") from None
