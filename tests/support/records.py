"""Records for tests of the service's replica side: a sink that keeps what the service
publishes, and records as a peer's reader hands them over.

``format_1`` turns records written as plain maps, the way versions before the stream format 2
wrote them (the envelope's ``origin`` and ``ts`` among the record's fields), into what the
reader hands the service for such an entry; ``format_2`` gives the bytes this version's service
writes for the same record (the same fields in the same order, the envelope's left out, the
kind first).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgpack

from kv_slot_tracker.replication.port import Batch, OwnReadBack
from kv_slot_tracker.replication.records import Delivered, decode_entry

KINDS = ("event", "topology", "early", "selection")
ENVELOPE = ("origin", "incarnation", "seq", "ts")


class Records:
    """A record sink that keeps every record as the service published it (its bytes) with the
    producer's time."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.times: list[int] = []

    def publish(self, record: bytes, ts: int) -> int:
        self.payloads.append(record)
        self.times.append(ts)
        return len(self.payloads)

    def decoded(self) -> list[dict[str, Any]]:
        return [msgpack.unpackb(p, raw=False) for p in self.payloads]


def format_1(records: Iterable[dict[str, Any] | OwnReadBack], incarnation: int = 1) -> Batch:
    """Records of format 1 as the reader hands them to the service, each its own entry."""
    batch: Batch = []
    for seq, rec in enumerate(records, 1):
        if isinstance(rec, OwnReadBack):
            batch.append(rec)
            continue
        origin, ts = rec.get("origin"), rec.get("ts")
        batch.append(
            Delivered(
                origin if type(origin) is int else 0,
                incarnation,
                seq,
                ts if type(ts) is int else 0,
                msgpack.packb(rec),
                1,
            )
        )
    return batch


def format_2(previous: dict[str, Any]) -> bytes:
    """What this version's service writes for a record that the versions before wrote as
    ``previous`` (format 1)."""
    kind = next(k for k in KINDS if k in previous)
    return msgpack.packb({"k": kind, **{k: v for k, v in previous.items() if k not in ENVELOPE}})


def delivered(record: bytes, origin: int, ts: int, seq: int = 1) -> Delivered:
    """A record of this version (format 2) as the reader hands it to the service."""
    return Delivered(origin, 1, seq, ts, record)


def entry_view(payload: bytes) -> dict[str, Any]:
    """A stream entry's ``d`` field (either format) as one map: the record's fields and the
    envelope's."""
    d = decode_entry(payload)
    rec = msgpack.unpackb(d.record, raw=False)
    return {**rec, "origin": d.origin, "incarnation": d.incarnation, "seq": d.seq, "ts": d.ts}
