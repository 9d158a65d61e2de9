"""Dynamo's ZMQ replica-sync payloads (msgpack) for the seed wire tests: a singleton
``ActiveSequenceEvent`` or an ``ActiveSequenceEventBatch``. The service replicates through Redis
records instead, so only the tests speak this format."""

from __future__ import annotations

from typing import Any

import msgpack

from kv_slot_tracker.core.events import (
    ActiveSequenceEvent,
    EventDecodeError,
    event_from_wire,
    event_to_wire,
)

# -- bytes ------------------------------------------------------------------------------------


def encode_event(ev: ActiveSequenceEvent) -> bytes:
    """A singleton payload: one ``ActiveSequenceEvent``."""
    return msgpack.packb(event_to_wire(ev))


def encode_batch(events: list[ActiveSequenceEvent]) -> bytes:
    """A batch payload: ``ActiveSequenceEventBatch {events: [...]}``."""
    return msgpack.packb({"events": [event_to_wire(e) for e in events]})


def _unpack(payload: bytes) -> Any:
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise EventDecodeError(f"undecodable payload: {e}") from None


def decode_event(payload: bytes) -> ActiveSequenceEvent:
    return event_from_wire(_unpack(payload))


def decode_batch(payload: bytes) -> list[ActiveSequenceEvent]:
    obj = _unpack(payload)
    if not isinstance(obj, dict) or set(obj) != {"events"} or not isinstance(obj["events"], list):
        raise EventDecodeError("not an ActiveSequenceEventBatch")
    return [event_from_wire(e) for e in obj["events"]]
