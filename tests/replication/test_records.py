"""Records and the sequence ledger (pure, no Redis)."""

from __future__ import annotations

import msgpack
import pytest

from kv_slot_tracker.replication.records import (
    MalformedRecord,
    SeqLedger,
    as_replayed,
    decode_record,
    encode_record,
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


def test_records_encode_and_validate() -> None:
    rec = {"origin": 1, "incarnation": 2, "seq": 3, "ts": 4, "topology": {"op": "upsert"}}
    assert decode_record(encode_record(rec)) == rec
    for bad in (b"\xc1", msgpack.packb([1]), msgpack.packb({**rec, "seq": "3"})):
        with pytest.raises(MalformedRecord):
            decode_record(bad)


def test_replayed_records_lose_the_own_ids() -> None:
    rec = {"origin": 9, "event": {"request_id": "r", "router_id": 9}, "seq": 1}
    out = as_replayed(rec)
    assert out["origin"] == 0 and out["event"]["router_id"] == 0
    assert rec["origin"] == 9 and rec["event"]["router_id"] == 9  # the original is untouched
