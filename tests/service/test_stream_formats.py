"""A rolling upgrade: an instance of this version reads the stream its predecessors wrote.

``tests/data/replica_stream_v1.msgpack`` holds real entries of stream format 1, written by the
version before format 2 (``tests/support/capture_stream_v1.py``: every kind of record, each
topology op, each event variant, tombstones and pending marks, each selection change), with
what the instance that wrote them held at the end. Replayed into an instance of this version,
through the reader's decoding, they leave the same state; and records of both formats in one
stream are applied in their order, as one stream.
"""

from __future__ import annotations

import random
from typing import Any

import msgpack

from kv_slot_tracker.core.selection import RouterConfig
from kv_slot_tracker.replication.port import Batch, OwnReadBack
from kv_slot_tracker.replication.records import decode_entry, encode_entry, encode_entry_1
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service.selection.service import SelectionService
from tests.calls import AddCall, register
from tests.support.capture_stream_v1 import DATA, GROUP, INCARNATION, KEY, ORIGIN, S, produce

CAPTURED = msgpack.unpackb(DATA.read_bytes(), raw=False)


class Instance:
    """An instance of this version on the captured clocks, with early calls and selection."""

    def __init__(self, instance_id: int, entries: list[bytes] | None = None) -> None:
        clock, wall = CAPTURED["clock"], CAPTURED["wall"]
        self.entries = entries  # where it publishes, when given
        self.service = SlotTrackerService(
            clock=lambda: clock, wall_clock=lambda: wall, instance_id=instance_id,
            replicator=self if entries is not None else None,
        )  # fmt: skip
        self.service.replica.use_early_calls(1000, 600 * S, 1 << 20)
        self.selection = SelectionService(
            self.service.registry, config=RouterConfig(use_kv_events=False),
            clock=lambda: clock, rng=random.Random(instance_id),
        )  # fmt: skip
        self.service.replica.bind_selection(self.selection.replica)
        self.seq = 0

    def publish(self, record: bytes, ts: int) -> int:  # the service's record sink
        assert self.entries is not None
        self.seq += 1
        self.entries.append(encode_entry(self.service.replica.instance_id, 7, self.seq, ts, record))
        return self.seq

    def read(self, entries: list[bytes]) -> int:
        """Apply ``entries`` as the reader hands them over (own ones as read-back marks)."""
        batch: Batch = []
        for e in entries:
            d = decode_entry(e)
            own = d.origin == self.service.replica.instance_id
            batch.append(OwnReadBack(d.seq) if own else d)
        return self.service.apply_remote(batch)

    def state(self) -> dict[str, Any]:
        s = self.service
        out = {"trackers": s.export_state(), "early": s.export_early(),
               "selection": s.export_selection()}  # fmt: skip
        return msgpack.unpackb(msgpack.packb(out), raw=False)  # as a snapshot carries it


def test_the_captured_entries_are_of_format_1_and_cover_every_kind() -> None:
    entries = [decode_entry(e) for e in CAPTURED["entries"]]
    assert {d.format for d in entries} == {1}
    assert [d.seq for d in entries] == list(range(1, len(entries) + 1))
    kinds = set()
    for e in CAPTURED["entries"]:
        rec = msgpack.unpackb(e, raw=False)
        (kind,) = [k for k in ("event", "topology", "early", "selection") if k in rec]
        part = rec[kind]
        data = part.get("data") if kind == "event" else part["op"]
        kinds.add((kind, data if type(data) is str else next(iter(data))))
    assert kinds == {
        ("topology", "upsert"), ("topology", "renew"), ("topology", "reconcile"),
        ("topology", "unregister"), ("event", "AddRequest"), ("event", "Free"),
        ("event", "MarkPrefillCompleted"), ("early", "free"), ("early", "prefill_complete"),
        ("selection", "put_worker"), ("selection", "remove_worker"), ("selection", "book"),
        ("selection", "pending"), ("selection", "release"),
    }  # fmt: skip


def test_a_stream_of_format_1_replays_to_the_state_of_the_instance_that_wrote_it() -> None:
    new = Instance(2)
    assert new.read(CAPTURED["entries"]) == 23  # all but the tombstone and a renew's no-op
    assert new.service.replica.dropped == 0, new.service.replica.rejected
    state = new.state()
    # the writer's version kept no released ids; this one remembers the stream's release
    released = state["selection"].pop("released")
    assert [row[0] for row in released] == [
        rec["selection"]["id"]
        for rec in map(msgpack.unpackb, CAPTURED["entries"])
        if rec.get("selection", {}).get("op") == "release"
    ]
    assert state == {k: CAPTURED[k] for k in ("trackers", "early", "selection")}
    assert {k for k, _ in new.service.trackers.items()} == {KEY, GROUP}


def test_records_of_both_formats_in_one_stream_converge() -> None:
    """An instance of this version writes format 2 among the old instance's format-1 entries;
    a third instance reads the whole stream and holds what the writer holds."""
    old = CAPTURED["entries"]
    stream: list[bytes] = list(old[:12])
    writer = Instance(2, stream)
    writer.read(stream)
    # the new instance's own changes, interleaved with the old instance's later ones
    register(writer.service, KEY, 5, 4, 0, 2)
    writer.service.add(AddCall(*KEY, "new-1", 5, 1, sequence_hashes=[-1, 2**62]))
    mine = len(stream)
    stream += old[12:]
    writer.read(stream[mine:])
    writer.service.add(AddCall(*KEY, "new-2", 1, 0, token_ids=list(range(12))))
    assert {decode_entry(e).format for e in stream} == {1, 2}

    reader = Instance(3)
    reader.read(stream)
    assert reader.service.replica.dropped == 0, reader.service.replica.rejected
    assert writer.service.replica.dropped == 0, writer.service.replica.rejected
    assert reader.state() == writer.state()
    t = reader.service.tracker(KEY)
    assert t.has_request("new-1") and t.has_request("new-2") and t.has_request("r1")


class Format1:
    """A sink that writes what an outbox with ``replication_stream_format = 1`` appends."""

    def __init__(self) -> None:
        self.entries: list[bytes] = []

    def publish(self, record: bytes, ts: int) -> int:
        seq = len(self.entries) + 1
        self.entries.append(encode_entry_1(ORIGIN, INCARNATION, seq, ts, record))
        return seq


def test_format_1_written_for_a_fleet_still_on_the_previous_version_is_what_it_wrote() -> None:
    """During a rolling upgrade an instance of this version writes format 1: the same calls
    give the very entries the previous version wrote (as maps: the order of their keys aside),
    which that version reads."""
    again = produce(Format1())
    assert [msgpack.unpackb(e, raw=False) for e in again["entries"]] == [
        msgpack.unpackb(e, raw=False) for e in CAPTURED["entries"]
    ]
    # the released ids this version remembers travel under a key of their own, which the
    # previous version does not read
    assert [row[0] for row in again["selection"].pop("released")] == ["s2"]
    for name in ("trackers", "early", "selection"):
        assert msgpack.unpackb(msgpack.packb(again[name]), raw=False) == CAPTURED[name]
