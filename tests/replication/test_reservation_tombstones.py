"""Released reservation ids across instances, record by record: a late booking of a freed id,
made on an instance that had not heard of the free yet, is refused or dropped on every instance,
and two bookings of one id by two instances followed by one free leave no reservation anywhere.

The instances share one stream (a list in stream order, as ``tests/service/test_selection_replica``
keeps it); each reads it when the test says so, which is how a paused instance or a lagging
reader looks. Every test here failed before released ids were remembered.
"""

from __future__ import annotations

from typing import Any

import pytest

from kv_slot_tracker.core.selection.errors import ReservationConflict, ReservationNotFound
from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.replication.records import encode_entry
from kv_slot_tracker.service.selection import commands as sc
from tests.service.test_selection_replica import KEY, Node, assert_same, cluster, sync, worker

RANK = WorkerWithDpRank(1, 0)


def book(node: Node, sid: str, blocks: list[int]) -> None:
    """The client's select_and_reserve of ``sid`` on ``node`` (one worker: always ``RANK``)."""
    out = node.selection.select(
        sc.Select(model_name=KEY[0], block_hashes=blocks, sequence_hashes=blocks,
                  isl_tokens=4 * len(blocks), selection_id=sid, reserve=True)
    )  # fmt: skip
    assert out.selection.worker == RANK


def release(node: Node, sid: str) -> None:
    node.selection.release(sc.ReservationCall(selection_id=sid))


def released_drops(node: Node) -> int:
    return node.service.replica.rejected["released"]


def empty(view: dict[str, Any]) -> bool:
    return view["reservations"] == {} and view["requests"] == {KEY: []}


def test_a_late_booking_run_after_the_free_is_dropped_on_every_instance() -> None:
    """The paused-instance run: the booking sent to A timed out, its retry on B was booked,
    completed and freed; then A resumed and ran the stale booking before reading the stream."""
    clock, (a, b, c) = cluster()
    a.selection.upsert_worker(worker(1))
    sync([a, b, c])
    book(b, "late", [1, 2, 3])
    clock.advance(1)
    b.selection.prefill_complete(sc.ReservationCall(selection_id="late"))
    release(b, "late")
    sync([b, c])  # A is paused: it has not read any of this
    clock.advance(1)
    book(a, "late", [1, 2, 3])  # the stale call: A knows nothing of the free yet
    sync([a, b, c])
    sync([a, b, c])
    view = assert_same([a, b, c])
    assert empty(view), view
    # its request's add and its selection record, dropped on B and C; A's own add, replaced by
    # B's earlier add and read back after the free, dropped there too
    assert (released_drops(a), released_drops(b), released_drops(c)) == (1, 2, 2)
    for node in (a, b, c):
        with pytest.raises(ReservationConflict):
            book(node, "late", [1, 2, 3])
        with pytest.raises(ReservationNotFound):
            node.selection.prefill_complete(sc.ReservationCall(selection_id="late"))
        with pytest.raises(ReservationNotFound):
            node.selection.output_block(sc.ReservationOutputBlock(selection_id="late"))
        with pytest.raises(ReservationNotFound):
            release(node, "late")
    assert_same([a, b, c])


def test_a_late_booking_after_the_free_was_read_is_refused_and_changes_nothing() -> None:
    clock, (a, b) = cluster(2)
    a.selection.upsert_worker(worker(1))
    sync([a, b])
    book(b, "late", [1, 2])
    release(b, "late")
    sync([a, b])
    before = a.view()
    with pytest.raises(ReservationConflict) as refused:
        book(a, "late", [1, 2])
    assert str(refused.value) == (
        "selection late was released and cannot be reserved again "
        "(a late duplicate of a finished booking; use a new selection_id)"
    )
    assert a.view() == before
    assert a.selection.reservations.tombstones.counters.refused == 1
    sync([a, b])
    assert empty(assert_same([a, b]))


class Outbox:
    """An instance's records held back (Redis unreachable), appended when ``flush`` is called,
    with the sequence numbers they were given when made."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.held: list[bytes] = []
        replica = node.service.replica
        self.seq: int = replica.replicator.seq  # type: ignore[union-attr]  # numbering goes on
        replica.replicator = self

    def publish(self, record: bytes, ts: int) -> int:
        self.seq += 1
        self.held.append(encode_entry(self.node.origin, 1, self.seq, ts, record))
        return self.seq

    def flush(self) -> None:
        self.node.stream.entries.extend(self.held)
        self.held.clear()


def test_two_bookings_of_one_id_and_one_free_leave_no_reservation_anywhere() -> None:
    """The durable-acknowledgement run: B booked the id while its records could not reach the
    stream, the client retried on A (booked there too), then freed it on B before B had read
    A's booking. Stream order: A's booking, B's booking, B's free."""
    _, (a, b, c) = cluster()
    a.selection.upsert_worker(worker(1))
    sync([a, b, c])
    outbox = Outbox(b)
    book(b, "twice", [4, 5])  # B's records wait: appended after A's
    book(a, "twice", [4, 5])
    release(b, "twice")  # B frees its own copy: it has not read A's booking
    outbox.flush()
    sync([a, b, c])
    sync([a, b, c])
    view = assert_same([a, b, c])
    assert empty(view), view
    # B applied A's booking after its own free: refused there (its add and its record)
    assert released_drops(b) == 2
    assert (released_drops(a), released_drops(c)) == (0, 0)


def test_two_bookings_of_one_id_converge_whichever_copy_the_free_finds() -> None:
    """The same two bookings, B having read A's booking (which replaced its own copy: the
    first in the stream wins) before the free: the free removes that copy everywhere."""
    _, (a, b, c) = cluster()
    a.selection.upsert_worker(worker(1))
    sync([a, b, c])
    book(a, "twice", [4, 5])
    book(b, "twice", [6, 7])
    b.deliver()
    release(b, "twice")
    sync([a, b, c])
    sync([a, b, c])
    assert empty(assert_same([a, b, c]))


def test_released_ids_travel_in_the_snapshot_and_expire_with_their_ttl() -> None:
    clock, (a, b) = cluster(2)
    a.selection.upsert_worker(worker(1))
    sync([a, b])
    book(a, "gone", [1])
    release(a, "gone")
    sync([a, b])
    offset = 1_000_000_000
    snapshot = a.selection.replica.export_selection(offset)
    assert [row[0] for row in snapshot["released"]] == ["gone"]
    assert snapshot["released"][0][1:3] == list(KEY)
    b.selection.replica.restore_selection(None, offset)  # an empty state first
    assert not b.selection.reservations.released("gone", clock.now())
    b.selection.replica.restore_selection(snapshot, offset)
    with pytest.raises(ReservationConflict):
        book(b, "gone", [1])
    # a tombstone lasts its ttl (the default: 300 s after the release), then the id is free
    clock.advance(299)
    with pytest.raises(ReservationConflict):
        book(b, "gone", [1])
    clock.advance(1)
    book(b, "gone", [1])
    assert "released" not in b.selection.replica.export_selection(offset)  # pruned: none left
