"""A record sink for the service (``ReplicaRecords``' ``RecordSink``) that keeps every record as
the stream carries it (msgpack bytes), for tests that compare the bytes written."""

from __future__ import annotations

from typing import Any

from kv_slot_tracker.replication.records import encode_record


class Records:
    """A record sink that keeps every record as the stream would carry it (msgpack bytes)."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def publish(self, record: dict[str, Any]) -> int:
        self.payloads.append(encode_record(record))
        return len(self.payloads)
