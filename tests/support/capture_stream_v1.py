"""Writes ``tests/data/replica_stream_v1.msgpack``: real stream entries of the first stream
format, as an instance of that version appended them, for the rolling-upgrade tests.

Run once, from a checkout of the version whose format is captured (the data file is committed;
the script stays as the record of how it was made):

    .venv/bin/python -m tests.support.capture_stream_v1

(``tests/service/test_stream_formats.py`` runs ``produce`` again with this version's records
written in format 1, which must give the same entries.)

One instance (origin 1, its own lifecycle, topology, early and selection calls) publishes
through a sink that stamps each record as that version's outbox did (``incarnation``, ``seq``)
and keeps the ``d`` field of each entry. The file holds the entries in stream order and what
the producing instance held at the end (``export_state``, ``export_early``,
``export_selection``, taken at the clock readings stored with them), which an instance that
replays the entries must hold too.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgpack

from kv_slot_tracker.core.selection import RouterConfig
from kv_slot_tracker.core.selection.catalog import WorkerSpec
from kv_slot_tracker.core.types import WorkerDpRange, WorkerWithDpRank
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service import commands as c
from kv_slot_tracker.service.selection import commands as sc
from kv_slot_tracker.service.selection.service import SelectionService
from tests.calls import AddCall, register

DATA = Path(__file__).resolve().parent.parent / "data" / "replica_stream_v1.msgpack"
S = 1_000_000_000
START = 1_000_000_000_000
WALL = 1_700_000_000 * S
ORIGIN = 1
INCARNATION = 0x5EED_0001
KEY = ("m", "default")
GROUP = ("m", "blue")
BS = 4


class Clock:
    def __init__(self) -> None:
        self.ns = START

    def now(self) -> int:
        return self.ns

    def wall(self) -> int:
        return WALL + self.ns


class Sink:
    """Stamps each record as the outbox of that version did and keeps the entry's bytes."""

    def __init__(self) -> None:
        self.entries: list[bytes] = []

    def publish(self, record: dict[str, Any]) -> int:
        seq = len(self.entries) + 1
        record["incarnation"] = INCARNATION
        record["seq"] = seq
        self.entries.append(msgpack.packb(record))
        return seq


def produce(sink: Any = None) -> dict[str, Any]:
    """The calls, published through ``sink`` (``Sink``: as the captured version did)."""
    clock = Clock()
    sink = Sink() if sink is None else sink
    svc = SlotTrackerService(
        clock=clock.now, wall_clock=clock.wall, instance_id=ORIGIN, replicator=sink
    )
    svc.replica.use_early_calls(1000, 600 * S, 1 << 20)
    sel = SelectionService(
        svc.registry, config=RouterConfig(use_kv_events=False), clock=clock.now,
        rng=random.Random(1),
    )  # fmt: skip
    svc.replica.bind_selection(sel.replica)

    def tick(seconds: float = 0.25) -> None:
        clock.ns += int(seconds * S)

    # topology: upsert (register), renew (heartbeat), reconcile, unregister
    register(svc, KEY, 1, BS, 0, 2)
    tick()
    register(svc, KEY, 2, BS, 0, 1)
    register(svc, GROUP, 3, BS, 0, 1)
    tick()
    svc.heartbeat(c.Heartbeat(model_name=KEY[0], routing_group=KEY[1], worker_id=1))
    svc.replica.emit_renew(KEY, BS, 1)  # what a heartbeat sends with leases on
    svc.reconcile(
        c.Reconcile(
            model_name=GROUP[0], routing_group=GROUP[1], block_size=BS,
            workers=[WorkerDpRange(3, 0, 2), WorkerDpRange(4, 0, 1)],
        )
    )  # fmt: skip
    tick()
    # lifecycle events: adds of every shape, a prefill completion, frees
    svc.add(AddCall(*KEY, "r1", 1, 0, sequence_hashes=[-5, 7, -(2**63), 2**63 - 1]))
    svc.add(
        AddCall(*KEY, "r2", 1, 1, token_ids=list(range(9)), new_isl_tokens=9,
                expected_prefill_ms=1500.25, expected_output_tokens=64, lora_name="lora-a")
    )  # fmt: skip
    tick()
    svc.add(AddCall(*KEY, "r3", 2, 0, sequence_hashes=[1, 2], new_isl_tokens=8,
                    track_prefill_tokens=False))  # fmt: skip
    svc.add(AddCall(*GROUP, "g1", 4, 0, sequence_hashes=[3], new_isl_tokens=4))
    tick()
    svc.prefill_complete(c.PrefillComplete(model_name=KEY[0], request_id="r2"))
    svc.free(c.Free(model_name=KEY[0], request_id="r3"))
    tick()
    svc.unregister(c.Unregister(model_name=GROUP[0], routing_group=GROUP[1], worker_id=4))
    # early calls: a tombstone and a pending mark for ids not added yet
    svc.replica.remember_early(KEY, "free", "late-1")
    svc.replica.remember_early(KEY, "prefill_complete", "late-2")
    tick()
    svc.add(AddCall(*KEY, "late-2", 1, 1, sequence_hashes=[9], new_isl_tokens=4))
    # selection: workers put and removed, a booking, a pending selection, a release
    sel.upsert_worker(
        sc.UpsertWorker(spec=WorkerSpec(worker_id=11, model_name=KEY[0], endpoint="http://w11",
                                        block_size=BS, data_parallel_size=2,
                                        taints=("gpu-a",), topology_domains={"rack": "r1"}))
    )  # fmt: skip
    sel.upsert_worker(sc.UpsertWorker(spec=WorkerSpec(worker_id=12, model_name=KEY[0], endpoint="http://w12",
                                                      block_size=BS)))  # fmt: skip
    tick()
    sel.select(
        sc.Select(model_name=KEY[0], block_hashes=[21, -22, 23], sequence_hashes=[21, -22, 23],
                  isl_tokens=12, selection_id="s1", reserve=True,
                  pinned_worker=WorkerWithDpRank(11, 1))
    )  # fmt: skip
    sel.select(
        sc.Select(model_name=KEY[0], block_hashes=[31, 32], sequence_hashes=[31, 32],
                  isl_tokens=8, selection_id="s2", reserve=True,
                  pinned_worker=WorkerWithDpRank(12, 0))
    )  # fmt: skip
    sel.select(sc.Select(model_name=KEY[0], token_ids=list(range(10)), selection_id="p1"))
    tick()
    sel.release(sc.ReservationCall(selection_id="s2"))
    sel.delete_worker(sc.DeleteWorker(worker_id=12))
    tick()
    return {
        "format": 1,
        "origin": ORIGIN,
        "incarnation": INCARNATION,
        "clock": clock.now(),
        "wall": clock.wall(),
        "entries": sink.entries,
        "trackers": svc.export_state(),
        "early": svc.export_early(),
        "selection": svc.export_selection(),
    }


def main() -> None:
    data = produce()
    DATA.write_bytes(msgpack.packb(data))
    kinds: dict[str, int] = {}
    for entry in data["entries"]:
        rec = msgpack.unpackb(entry, raw=False)
        kind = next(k for k in ("event", "topology", "early", "selection") if k in rec)
        sub = rec[kind].get("op") if type(rec[kind]) is dict else None
        if kind == "event":
            data_ = rec["event"]["data"]
            sub = data_ if type(data_) is str else next(iter(data_))
        kinds[f"{kind}:{sub}"] = kinds.get(f"{kind}:{sub}", 0) + 1
    print(f"{len(data['entries'])} entries written to {DATA}: {kinds}")


if __name__ == "__main__":
    main()
