"""Records and the sequence ledger (pure, no Redis)."""

from __future__ import annotations

import msgpack
import pytest

from kv_slot_tracker.replication.records import (
    Delivered,
    MalformedRecord,
    SeqLedger,
    as_replayed,
    decode_entry,
    encode_entry,
    record_bytes,
)


def test_ledger_tells_next_duplicate_and_gap() -> None:
    ledger = SeqLedger()
    key = (7, 1)
    assert ledger.missing_before(key, 1) == 0  # an unknown origin starts at 1
    assert ledger.missing_before(key, 3) == 2  # ... or records were lost
    ledger.advance(key, 1, wall_ns=100)
    assert ledger.missing_before(key, 1) == -1
    assert ledger.missing_before(key, 2) == 0
    assert ledger.missing_before((7, 2), 1) == 0  # another incarnation numbers afresh


def test_ledger_round_trip_and_pruning() -> None:
    ledger = SeqLedger()
    ledger.advance((1, 10), 5, wall_ns=100)
    ledger.advance((2, 20), 9, wall_ns=300)
    rows = msgpack.unpackb(msgpack.packb(ledger.export()))
    loaded = SeqLedger.load(rows)
    assert loaded.highest == ledger.highest and loaded.seen_at == ledger.seen_at
    copy = loaded.copy()
    assert loaded.prune(seen_before_wall_ns=200) == 1
    assert loaded.highest == {(2, 20): 9}
    assert copy.get((1, 10)) == 5  # copies are independent


def test_entries_carry_the_record_untouched_in_a_versioned_envelope() -> None:
    record = b"\x81\xa1k\xa5bytes the service made"
    entry = encode_entry(1, 2, 3, -4, record)
    assert msgpack.unpackb(entry) == [2, 1, 2, 3, -4, record]  # format 2 first
    assert decode_entry(entry) == Delivered(1, 2, 3, -4, record, format=2)
    assert record_bytes(record) == len(record) + 64  # the size is the bytes', never read
    edges = encode_entry(2**64 - 1, 2**64 - 1, 2**64 - 1, -(2**63), b"")
    assert decode_entry(edges) == Delivered(2**64 - 1, 2**64 - 1, 2**64 - 1, -(2**63), b"")


def test_entries_of_format_1_are_read_whole() -> None:
    """Format 1: one map, the envelope's fields among the record's; the whole entry is the
    record, for the service to decode."""
    entry = msgpack.packb({"origin": 1, "incarnation": 2, "seq": 3, "ts": 4,
                           "topology": {"op": "upsert"}})  # fmt: skip
    assert decode_entry(entry) == Delivered(1, 2, 3, 4, entry, format=1)


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b"\xc1",
        msgpack.packb([1]),
        msgpack.packb(7),
        msgpack.packb([3, 1, 2, 3, 4, b""]),  # a format this version does not know
        msgpack.packb([2, 1, 2, 3, 4, "not bytes"]),
        msgpack.packb([2, -1, 2, 3, 4, b""]),  # an origin below 0
        msgpack.packb([2, 1, 2, 3, 4, b"", "more"]),
        msgpack.packb({"origin": 1, "incarnation": 2, "seq": "3", "ts": 4}),
        msgpack.packb({"origin": 1, "incarnation": 2, "seq": 3}),  # no ts
        msgpack.packb({"origin": True, "incarnation": 2, "seq": 3, "ts": 4}),
    ],
)
def test_entries_that_are_not_records_are_malformed(bad: bytes) -> None:
    with pytest.raises(MalformedRecord):
        decode_entry(bad)


def test_replayed_records_are_marked_and_the_original_is_untouched() -> None:
    rec = Delivered(9, 1, 1, 5, b"x")
    out = as_replayed(rec)
    assert out.replayed and out.origin == 9 and out.record == b"x"
    assert not rec.replayed
