"""The selection service keeps hashes signed inside; its records, snapshots, peers' index lines
and ``/dump`` carry them unsigned, exactly as when it kept them unsigned: an instance of the
previous version on the same stream, and snapshots it stored, keep working
(``kv_slot_tracker.core.hashing``).

The prompt is SELECTION.md §3's: tokens 0..9, block size 4, two blocks, the second block's and
sequence hash negative as the API sends them. Every expected record, snapshot and answer below
is what the previous version wrote for the same calls.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import msgpack
import orjson
from starlette.datastructures import QueryParams

from kv_slot_tracker.core.selection import RouterConfig
from kv_slot_tracker.core.selection.catalog import WorkerSpec
from kv_slot_tracker.core.types import WorkerWithDpRank as W
from kv_slot_tracker.http.selection.operations import SelectionQueries, select_json
from kv_slot_tracker.ingest.peers import dump_lines
from kv_slot_tracker.ingest.records import decode_batch, encode_batch
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service.selection import commands as sc
from kv_slot_tracker.service.selection.service import SelectionService
from tests.fakes import FakeClock
from tests.support.records import Records, format_1, format_2

WALL = 1_700_000_000_000_000_000
S = 1_000_000_000
PEER = 7
TOKENS = list(range(10))
BH_U64 = [9143094415614847814, 12124091508212882195]
SH_U64 = [9143094415614847814, 9510318385840434533]  # the chained hash /dump shows
BH_I64 = [9143094415614847814, 12124091508212882195 - 2**64]
SH_I64 = [9143094415614847814, -8936425687869117083]  # as the API sends and echoes them


def instance(
    records: Records | None = None, *, kv_events: bool = False
) -> tuple[FakeClock, SlotTrackerService, SelectionService]:
    clock = FakeClock()
    s = SlotTrackerService(
        clock=clock.now, wall_clock=lambda: WALL + clock.now(), instance_id=1, replicator=records
    )
    sel = SelectionService(
        s.registry,
        config=RouterConfig(use_kv_events=kv_events),
        clock=clock.now,
        rng=random.Random(1),
    )
    s.replica.bind_selection(sel.replica)
    endpoints = {"0": "tcp://w1:5557", "1": "tcp://w1:5558"} if kv_events else None
    spec = WorkerSpec(worker_id=1, model_name="m", endpoint="http://w1", block_size=4,
                      data_parallel_size=2, kv_events_endpoints=endpoints)  # fmt: skip
    sel.upsert_worker(sc.UpsertWorker(spec=spec))
    if records is not None:
        del records.payloads[:]  # the worker's record
    return clock, s, sel


def by_hashes(**fields: Any) -> sc.Select:
    return sc.Select(model_name="m", block_hashes=BH_I64, sequence_hashes=SH_I64, isl_tokens=10,
                     **fields)  # fmt: skip


def by_tokens(**fields: Any) -> sc.Select:
    return sc.Select(model_name="m", token_ids=TOKENS, **fields)


def add_record(rid: str, dp_rank: int, ts: int, ept: int) -> dict[str, Any]:
    return {
        "model_name": "m", "routing_group": "default", "block_size": 4, "origin": 1, "ts": ts,
        "event": {
            "request_id": rid,
            "worker": {"worker_id": 1, "dp_rank": dp_rank},
            "data": {"AddRequest": {
                "token_sequence": SH_U64, "track_prefill_tokens": True,
                "expected_output_tokens": None,
                "prefill_load_hint": {"initial_effective_prefill_tokens": ept,
                                      "expected_prefill_duration": None},
            }},
            "router_id": 1, "lora_name": None,
        },
    }  # fmt: skip


def book(sid: str, dp_rank: int, chain: list[int] | None, consumes: bool) -> dict[str, Any]:
    return {"op": "book", "id": sid, "m": "m", "g": "default", "w": [1, dp_rank],
            "bh": BH_U64, "ch": chain, "cp": consumes}  # fmt: skip


def pending_entry(from_tokens: bool) -> dict[str, Any]:
    return {"m": "m", "g": "default", "w": [1, 0], "sh": SH_U64, "bh": BH_U64, "isl": 10,
            "ept": 2, "track": True, "eot": None, "lora": None, "tok": from_tokens}  # fmt: skip


def selection_record(ts: int, selection: dict[str, Any]) -> dict[str, Any]:
    return {"origin": 1, "ts": ts, "selection": selection}


T0, T1 = WALL + 1000 * S, WALL + 1001 * S  # FakeClock starts at 1000 s

PREVIOUS_RECORDS = [
    add_record("h", 0, T0, 10),
    selection_record(T0, book("h", 0, SH_U64, False)),
    add_record("t", 1, T0, 10),
    selection_record(T0, book("t", 1, SH_U64, False)),
    selection_record(T0, {"op": "pending", "id": "p", "entry": pending_entry(False)}),
    selection_record(T0, {"op": "pending", "id": "pt", "entry": pending_entry(True)}),
    add_record("p", 0, T1, 2),
    selection_record(T1, book("p", 0, None, True)),
    {"model_name": "m", "routing_group": "default", "block_size": 4, "origin": 1, "ts": T1,
     "event": {"request_id": "h", "worker": {"worker_id": 1, "dp_rank": 0}, "data": "Free",
               "router_id": 1, "lora_name": None}},
    selection_record(T1, {"op": "release", "id": "h"}),
]  # fmt: skip

EXPIRES = WALL + 1120 * S  # written at 1000 s, router_ttl_secs 120


def previous_snapshot() -> dict[str, Any]:
    """The previous version's ``export_selection(WALL)`` after the four selections below."""
    spec = {
        "worker_id": 1,
        "model_name": "m",
        "routing_group": "default",
        "endpoint": "http://w1",
        "kv_events_endpoint": None,
        "kv_events_endpoints": None,
        "replay_endpoint": None,
        "block_size": 4,
        "data_parallel_start_rank": None,
        "data_parallel_size": 2,
        "max_num_batched_tokens": None,
        "total_kv_blocks": None,
        "stable_routing_id": None,
        "is_eagle": None,
        "taints": [],
        "topology_domains": None,
        "kv_transfer_domain": None,
        "kv_transfer_enforcement": None,
        "kv_transfer_preferred_weight": None,
    }
    rows = [
        [1, r, key, parent, local, EXPIRES]
        for r in (0, 1)
        for key, parent, local in ((SH_U64[0], -1, BH_U64[0]), (SH_U64[1], SH_U64[0], BH_U64[1]))
    ]
    return {
        "format": 1,
        "catalog": [[spec, "schedulable", []]],
        "partitions": [["m", "default", 4, [1], rows]],
        "reservations": [["h", "m", "default", [1, 0], T0, False],
                         ["t", "m", "default", [1, 1], T0, False]],
        "pending": [["p", EXPIRES, pending_entry(False)], ["pt", EXPIRES, pending_entry(True)]],
    }  # fmt: skip


def test_selection_records_and_snapshot_are_byte_identical_to_the_previous_format() -> None:
    records = Records()
    clock, _, sel = instance(records)
    sel.select(by_hashes(selection_id="h", reserve=True, pinned_worker=W(1, 0)))
    sel.select(by_tokens(selection_id="t", reserve=True, pinned_worker=W(1, 1)))
    sel.select(by_hashes(selection_id="p"))
    sel.select(by_tokens(selection_id="pt"))
    clock.advance(1)
    snapshot = msgpack.packb(sel.replica.export_selection(WALL))
    sel.replay(sc.ReplaySelection(model_name="m", selection_id="p"))
    sel.release(sc.ReservationCall(selection_id="h"))
    assert records.payloads == [format_2(r) for r in PREVIOUS_RECORDS]
    assert snapshot == msgpack.packb(previous_snapshot())


def overlaps(sel: SelectionService) -> list[tuple[int, int, int]]:
    """The overlap scores of the prompt given as signed hashes, the same as given as tokens."""
    rows = [
        sel.overlap_scores(sc.OverlapScores(model_name="m", **fields)).rows
        for fields in (
            {"block_hashes": BH_I64, "sequence_hashes": SH_I64, "isl_tokens": 10},
            {"token_ids": TOKENS},
        )
    ]
    assert rows[0] == rows[1]
    return rows[0]


def test_previous_records_apply_to_the_same_overlaps() -> None:
    records = Records()
    _, s, sel = instance(records)
    peer: list[Any] = [{**r, "origin": PEER} for r in PREVIOUS_RECORDS[:6]]
    for r in peer:
        if "event" in r:
            r["event"] = {**r["event"], "router_id": PEER}
    assert s.apply_remote(format_1(peer)) == 6
    assert overlaps(sel) == [(1, 0, 2), (1, 1, 2)]
    assert sorted(sid for sid, _, _ in sel.pending.entries()) == ["p", "pt"]
    # a pending selection of the previous version books the same prompt here
    booked = sel.replay(sc.ReplaySelection(model_name="m", selection_id="pt"))
    assert booked.worker == W(1, 0)
    book_pt = msgpack.unpackb(records.payloads[-1])["selection"]
    assert book_pt == book("pt", 0, SH_U64, True)
    assert s.tracker(("m", "default")).overlaps(SH_I64) == {(1, 0): 2, (1, 1): 2}


def test_a_previous_snapshot_restores_to_the_same_overlaps() -> None:
    _, _, sel = instance()
    snapshot = {**previous_snapshot(), "reservations": []}  # their requests are not here
    sel.replica.restore_selection(snapshot, WALL)
    assert overlaps(sel) == [(1, 0, 2), (1, 1, 2)]
    assert sel.replica.export_selection(WALL) == snapshot  # and exports it as it was


def feed(sel: SelectionService, rank: int, events: list[Any]) -> None:
    sel.kv_events.apply_kv_batch(1, rank, decode_batch(0, encode_batch(0.0, events, rank)))


E_U64 = [2**64 - 5, 2**63 + 1]  # an engine's block hashes, unsigned
E_I64 = [-5, -(2**63) + 1]  # the same blocks, signed


def dp(sel: SelectionService, cmd: sc.Select) -> dict[str, int]:
    return select_json(sel.select(cmd), reserve=False)["overlap"]["dp"]


def test_kv_events_in_either_form_match_the_same_prompt_and_dump_as_before() -> None:
    _, _, sel = instance(kv_events=True)
    feed(sel, 0, [["BlockStored", E_U64, None, TOKENS[:8], 4, None, "GPU", None]])
    feed(sel, 1, [["BlockStored", E_I64, None, TOKENS[:8], 4, None, "GPU", None],
                  ["BlockStored", [7], E_I64[1], [8, 9, 10, 11], 4, None, "CPU", None]])  # fmt: skip
    assert dp(sel, by_tokens()) == dp(sel, by_hashes()) == {"0": 8, "1": 8}

    def stored(i: int, rank: int, tier: str, parent: int | None, blocks: list[tuple]) -> Any:
        return {"worker_id": 1, "storage_tier": tier, "residency_domain": "worker",
                "event": {"event_id": i, "data": {"stored": {
                    "parent_hash": parent, "start_position": None,
                    "blocks": [{"block_hash": block, "tokens_hash": tokens,
                                "mm_extra_info": None} for block, tokens in blocks]}},
                          "dp_rank": rank}}  # fmt: skip

    # one event per rank and device chain, then each host block (ids count per tier)
    chain = list(zip(E_U64, BH_U64, strict=True))
    body = orjson.loads(SelectionQueries(sel).dump(QueryParams("")).body)
    events = body["m:default"]["events"]
    events[:2] = sorted(events[:2], key=lambda e: e["event"]["dp_rank"])
    for i, e in enumerate(events[:2]):
        e["event"]["event_id"] = i  # the two ranks of one chain come in the set's order
    assert body == {
        "m:default": {
            "block_size": 4,
            "events": [
                stored(0, 0, "device", None, chain),
                stored(1, 1, "device", None, chain),
                stored(0, 1, "host_pinned", E_U64[1], [(7, 1088361764653601668)]),
            ],
        }
    }

    async def lines() -> bytes:
        return b"".join([line async for line in dump_lines(sel.kv_events, None)])

    assert asyncio.run(lines()) == (
        b'{"kind":"header","format":1}\n'
        b'{"kind":"partition","model_name":"m","routing_group":"default","block_size":4}\n'
        b'{"kind":"rank","worker_id":1,"dp_rank":0,"seq":null,"blocks":'
        b"[[0,18446744073709551611,null,9143094415614847814],"
        b"[0,9223372036854775809,18446744073709551611,12124091508212882195]]}\n"
        b'{"kind":"rank","worker_id":1,"dp_rank":1,"seq":null,"blocks":'
        b"[[0,18446744073709551611,null,9143094415614847814],"
        b"[0,9223372036854775809,18446744073709551611,12124091508212882195],"
        b"[1,7,9223372036854775809,1088361764653601668]]}\n"
        b'{"kind":"end","ranks":2,"blocks":5}\n'
    )

    # a removal in the other form removes the same block
    feed(sel, 0, [["BlockRemoved", [E_I64[1]], "GPU"]])
    feed(sel, 1, [["BlockRemoved", [E_U64[0]], "GPU"]])
    assert dp(sel, by_tokens()) == dp(sel, by_hashes()) == {"0": 4, "1": 0}
