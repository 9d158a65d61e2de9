"""The selection state shared between instances: catalog, reservations, approximate caches and
pending selections, through records in one stream (a list here, in msgpack as on Redis), each
instance reading the others' records and markers for its own, in stream order."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest

from kv_slot_tracker.core.selection import RouterConfig
from kv_slot_tracker.core.selection.catalog import WorkerSpec
from kv_slot_tracker.core.selection.errors import ReservationNotFound
from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.replication.port import Batch, OwnReadBack
from kv_slot_tracker.replication.records import decode_entry, encode_entry
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service.selection import commands as sc
from kv_slot_tracker.service.selection.service import SelectionService
from tests.fakes import FakeClock
from tests.support.records import format_1

S = 1_000_000_000
WALL = 1_700_000_000 * S
BS = 4
KEY = ("m", "default")


class Stream:
    """One shared stream: records in append order, with per-origin sequence numbers."""

    def __init__(self) -> None:
        self.entries: list[bytes] = []
        self.read: dict[int, int] = {}

    def producer(self, origin: int) -> Any:
        stream = self

        class Producer:
            seq = 0

            def publish(self, record: bytes, ts: int) -> int:
                self.seq += 1
                stream.entries.append(encode_entry(origin, 1, self.seq, ts, record))
                return self.seq

        return Producer()


class Node:
    def __init__(self, stream: Stream, origin: int, clock: FakeClock) -> None:
        self.origin = origin
        self.stream = stream
        self.service = SlotTrackerService(
            clock=clock.now,
            wall_clock=lambda: WALL + clock.now(),
            instance_id=origin,
            replicator=stream.producer(origin),
        )
        self.service.replica.use_early_calls(1000, 60 * S, 1 << 20)
        self.selection = SelectionService(
            self.service.registry,
            config=RouterConfig(use_kv_events=False),
            clock=clock.now,
            rng=random.Random(origin),
        )
        self.service.replica.bind_selection(self.selection.replica)
        stream.read[origin] = 0

    def deliver(self) -> None:
        """Read the stream from where this instance stopped, as the reader does."""
        batch: Batch = []
        for blob in self.stream.entries[self.stream.read[self.origin] :]:
            rec = decode_entry(blob)
            batch.append(OwnReadBack(rec.seq) if rec.origin == self.origin else rec)
        self.stream.read[self.origin] = len(self.stream.entries)
        self.service.apply_remote(batch)

    def view(self) -> dict[str, Any]:
        """Everything a client can read of the selection state."""
        sel = self.selection
        tally: dict[Any, int] = {}
        for _, r in sel.reservations.items():
            tally[(r.key, r.lingering)] = tally.get((r.key, r.lingering), 0) + 1
        assert sel.reservations.held == tally  # the per-partition tally kept as reservations change
        return {
            "workers": [(r.spec, r.lifecycle, r.reasons) for r in sel.workers(None, None)],
            "loads": sel.loads(None, None),
            # ranks are listed in first-write order, which concurrent bookings on two
            # instances can make differ: compared as sets
            "dump": [(k, bs, sorted(runs, key=repr)) for k, bs, runs in sel.dump()],
            "reservations": {
                sid: (r.key, r.worker, r.lingering) for sid, r in sel.reservations.items()
            },
            "pending": [(sid, e) for sid, _, e in sel.pending.entries()],
            "requests": {k: sorted(t.indexed_requests()) for k, t in self.service.trackers.items()},
        }


def cluster(n: int = 3) -> tuple[FakeClock, list[Node]]:
    clock = FakeClock()
    stream = Stream()
    return clock, [Node(stream, i + 1, clock) for i in range(n)]


def sync(nodes: list[Node]) -> None:
    for node in nodes:
        node.deliver()


def worker(wid: int, **fields: Any) -> sc.UpsertWorker:
    return sc.UpsertWorker(
        spec=WorkerSpec(
            worker_id=wid, model_name=KEY[0], endpoint=f"http://w{wid}", block_size=BS, **fields
        )  # fmt: skip
    )


def reserve(sid: str | None, blocks: list[int], **fields: Any) -> sc.Select:
    return sc.Select(
        model_name=KEY[0], block_hashes=blocks, sequence_hashes=blocks,
        isl_tokens=BS * len(blocks), selection_id=sid, reserve=True, **fields,
    )  # fmt: skip


def assert_same(nodes: list[Node]) -> dict[str, Any]:
    first = nodes[0].view()
    for node in nodes[1:]:
        assert node.view() == first, f"instance {node.origin} differs from instance 1"
    return first


def test_catalog_reservations_and_cache_are_the_same_everywhere() -> None:
    clock, (a, b, c) = cluster()
    a.selection.upsert_worker(worker(1, data_parallel_size=2))
    b.deliver()
    b.selection.upsert_worker(worker(2))
    sync([a, b, c])
    assert [r.spec.worker_id for r in c.selection.workers(None, None)] == [1, 2]

    out = a.selection.select(reserve("s1", [11, 12, 13], pinned_worker=WorkerWithDpRank(1, 1)))
    assert (out.selection.worker, out.selection.effective_prefill_tokens) == ((1, 1), 12)
    sync([a, b, c])
    view = assert_same([a, b, c])
    assert view["reservations"] == {"s1": (KEY, (1, 1), False)}
    assert [row for _, rows in view["loads"] for row in rows if row[1] == 1] == [(1, 1, 12, 3, 1)]
    # the booking's blocks are in every instance's approximate cache: the same overlap
    scores = [
        n.selection.overlap_scores(
            sc.OverlapScores(
                model_name=KEY[0], block_hashes=[11, 12], sequence_hashes=[11, 12], isl_tokens=8
            )
        )
        for n in (a, b, c)
    ]
    assert {tuple(s.rows) for s in scores} == {((1, 0, 0), (1, 1, 2), (2, 0, 0))}

    # prefill completed on B, released on C: gone everywhere
    clock.advance(1)
    b.selection.prefill_complete(sc.ReservationCall(selection_id="s1"))
    sync([a, b, c])
    assert [row for _, rows in a.view()["loads"] for row in rows if row[1] == 1] == [
        (1, 1, 0, 3, 1)
    ]
    c.selection.release(sc.ReservationCall(selection_id="s1"))
    sync([a, b, c])
    view = assert_same([a, b, c])
    assert view["reservations"] == {} and view["requests"] == {KEY: []}
    with pytest.raises(ReservationNotFound):
        a.selection.release(sc.ReservationCall(selection_id="s1"))


def test_a_selection_made_on_one_instance_is_booked_on_another() -> None:
    _, (a, b, c) = cluster()
    a.selection.upsert_worker(worker(1))
    a.selection.upsert_worker(worker(2))
    sync([a, b, c])
    picked = a.selection.select(
        sc.Select(model_name=KEY[0], token_ids=list(range(10)), selection_id="p1")
    ).selection.worker
    sync([a, b, c])
    assert [sid for sid, _ in assert_same([a, b, c])["pending"]] == ["p1"]
    booked = b.selection.replay(sc.ReplaySelection(model_name=KEY[0], selection_id="p1"))
    assert booked.worker == picked
    sync([a, b, c])
    view = assert_same([a, b, c])
    assert view["pending"] == []  # single use, on every instance
    assert view["reservations"] == {"p1": (KEY, picked, False)}


def test_the_same_id_booked_on_two_instances_at_once_keeps_the_first_in_the_stream() -> None:
    _, (a, b, c) = cluster()
    a.selection.upsert_worker(worker(1))
    a.selection.upsert_worker(worker(2))
    sync([a, b, c])
    a.selection.select(reserve("dup", [5, 6], pinned_worker=WorkerWithDpRank(1, 0)))
    b.selection.select(reserve("dup", [7, 8, 9], pinned_worker=WorkerWithDpRank(2, 0)))
    sync([a, b, c])
    view = assert_same([a, b, c])
    assert view["reservations"] == {"dup": (KEY, (1, 0), False)}
    assert [(r[0], r[4]) for _, rows in view["loads"] for r in rows] == [(1, 1), (2, 0)]
    assert b.service.replica.duplicate_adds + c.service.replica.duplicate_adds >= 1
    # the winner's reservation works from any instance
    c.selection.release(sc.ReservationCall(selection_id="dup"))
    sync([a, b, c])
    assert assert_same([a, b, c])["reservations"] == {}


def test_a_worker_deleted_elsewhere_leaves_its_ids_lingering_everywhere() -> None:
    _, (a, b, c) = cluster()
    a.selection.upsert_worker(worker(1))
    a.selection.upsert_worker(worker(2))
    sync([a, b, c])
    a.selection.select(reserve("r", [1, 2], pinned_worker=WorkerWithDpRank(2, 0)))
    sync([a, b, c])
    b.selection.delete_worker(sc.DeleteWorker(worker_id=2))
    sync([a, b, c])
    view = assert_same([a, b, c])
    assert view["reservations"] == {"r": (KEY, (2, 0), True)}
    assert [r.spec.worker_id for r in c.selection.workers(None, None)] == [1]
    with pytest.raises(ReservationNotFound):  # lingering: a lifecycle call answers 404
        c.selection.prefill_complete(sc.ReservationCall(selection_id="r"))


def test_a_snapshot_carries_the_selection_state() -> None:
    clock, (a, b) = cluster(2)
    a.selection.upsert_worker(worker(1, data_parallel_size=2))
    a.selection.upsert_worker(sc.UpsertWorker(spec=WorkerSpec(worker_id=9, model_name=KEY[0])))
    a.selection.select(reserve("r1", [1, 2, 3]))
    a.selection.select(sc.Select(model_name=KEY[0], token_ids=list(range(8)), selection_id="p"))
    clock.advance(2)
    state = msgpack.unpackb(
        msgpack.packb(
            [a.service.export_state(), a.service.export_early(), a.service.export_selection()]
        ),
        raw=False,
    )
    b.service.restore_state(*state)
    assert b.view() == a.view()
    # what was restored keeps working: the pending selection books, the cache expires on time
    b.selection.replay(sc.ReplaySelection(model_name=KEY[0], selection_id="p"))
    assert set(b.selection.reservations) == {"r1", "p"}
    clock.advance(RouterConfig().router_ttl_secs)
    assert b.view()["dump"] == a.view()["dump"]
    # malformed selection state: nothing changes
    before = b.view()
    with pytest.raises(ValueError):
        b.service.restore_state(state[0], state[1], {**state[2], "reservations": [["x"]]})
    assert b.view() == before


def test_a_malformed_selection_record_is_counted_and_skipped() -> None:
    _, (a, b) = cluster(2)
    a.selection.upsert_worker(worker(1))
    bad = [
        {"origin": 1, "ts": WALL, "selection": {"op": "put_worker", "spec": {"worker_id": -1}}},
        {"origin": 1, "ts": WALL, "selection": {"op": "nope"}},
        {"origin": 1, "ts": WALL, "selection": {"op": "book", "id": "x"}},
    ]
    b.service.apply_remote(format_1(bad))
    assert b.service.replica.dropped == 3
    b.deliver()
    assert [r.spec.worker_id for r in b.selection.workers(None, None)] == [1]
