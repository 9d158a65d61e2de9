"""The engine-publisher harness (``bench/engine_conformance.py``): its pure parts.

The loader runs on the engines' wheels when they are in the cache directory (``$KV_ENGINE_WHEELS``
or ``~/.cache/kv-slot-tracker/engines``; ``python bench/engine_publishers.py download`` fills it)
and is skipped otherwise; the comparison logic runs on canned answers. Neither starts a service.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.engine_conformance import (
    Check,
    SelectAnswer,
    compare_dump,
    compare_select,
    dump_facts,
    overlap_view,
    render,
    summarize,
    workers_view,
)
from bench.engine_publishers import ENGINES, cache_dir, find_wheel

REPO = Path(__file__).resolve().parent.parent

# Loads one engine's publisher from its wheel in a child process (the loader registers the
# engine's module names in sys.modules), publishes one batch on inproc sockets and asks the
# replay socket for it; prints what a subscriber and a replaying DEALER received.
_PROBE = """
import json, sys, time
import msgpack, zmq
sys.path.insert(0, sys.argv[3])
from bench.engine_publishers import load
eng = load(sys.argv[1], sys.argv[2], download=False)
pub = eng.publisher(0, "inproc://probe-pub", "inproc://probe-replay")
ctx = zmq.Context.instance()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect("inproc://probe-pub")
batch = [eng.stored([11, 12], None, list(range(8)), 4, "GPU"), eng.removed([12]), eng.cleared()]
frames = None
for _ in range(200):  # the subscription reaches the PUB socket after a moment (slow joiner)
    pub.publish(eng.batch(batch, 1.5))
    if sub.poll(50):
        frames = sub.recv_multipart()
        break
dealer = ctx.socket(zmq.DEALER)
dealer.connect("inproc://probe-replay")
dealer.send_multipart([b"", (0).to_bytes(8, "big")])
replayed = []
while dealer.poll(2000):
    got = dealer.recv_multipart()
    replayed.append(len(got))
    if got[2] == (-1).to_bytes(8, "big", signed=True):
        break
pub.shutdown()
print(json.dumps({
    "file": eng.module.__file__,
    "frames": len(frames),
    "seq": int.from_bytes(frames[1], "big"),
    "payload": msgpack.unpackb(frames[2]),
    "replay_frames": sorted(set(replayed)),
}))
"""


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_loader_runs_the_engines_own_publisher(engine: str) -> None:
    directory = cache_dir()
    if find_wheel(engine, directory) is None:
        pytest.skip(
            f"no {ENGINES[engine].requirement} wheel in {directory} (set KV_ENGINE_WHEELS or run"
            " `python bench/engine_publishers.py download`)"
        )
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, engine, str(directory), str(REPO)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    # the module ran from the extracted wheel, not from the repository
    assert not Path(got["file"]).resolve().is_relative_to(REPO)
    assert got["file"].endswith(ENGINES[engine].kv_events.replace(".", "/") + ".py")
    assert got["frames"] == 3  # topic, sequence number, payload
    ts, events, dp_rank = got["payload"]
    assert (ts, dp_rank) == (1.5, 0)  # the publisher filled in its rank
    # msgspec tagged structs: maps with a "type" key; optional fields left at None omitted
    assert events[0]["type"] == "BlockStored"
    assert events[0]["block_hashes"] == [11, 12] and events[0]["token_ids"] == list(range(8))
    assert events[0]["medium"] == "GPU" and events[0]["lora_id"] is None
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}
    assert events[2] == {"type": "AllBlocksCleared"}
    # the replay answer repeats the topic: [b"", topic, seq, payload] at a DEALER, end marker too
    assert got["replay_frames"] == [4]


# -- comparison on canned answers -------------------------------------------------------------


def _dump(*runs: tuple[int, int, str, int | None, list[tuple[int, int]]]) -> dict:
    return {
        "m:default": {
            "block_size": 4,
            "events": [
                {"worker_id": w, "storage_tier": tier, "event": {"dp_rank": r, "data": {
                    "stored": {"parent_hash": parent,
                               "blocks": [{"block_hash": b, "tokens_hash": t} for b, t in blocks]}
                }}}
                for w, r, tier, parent, blocks in runs
            ],
        },
        "other:default": {"block_size": 4, "events": []},
    }  # fmt: skip


def test_dump_facts_chain_parents_and_count_events() -> None:
    body = _dump(
        (1, 0, "device", None, [(10, 100), (11, 101)]), (1, 1, "host_pinned", 11, [(12, 102)])
    )
    facts, events = dump_facts(body, "m")
    assert events == 2
    assert facts == {
        (1, 0, "device", 10, 100, None),
        (1, 0, "device", 11, 101, 10),
        (1, 1, "host_pinned", 12, 102, 11),
    }
    assert dump_facts(body, "absent") == (set(), 0)


def test_dump_grouping_does_not_change_the_facts() -> None:
    one = dump_facts(_dump((1, 0, "device", None, [(10, 100), (11, 101)])), "m")
    two = dump_facts(
        _dump((1, 0, "device", None, [(10, 100)]), (1, 0, "device", 10, [(11, 101)])), "m"
    )
    assert one[0] == two[0] and (one[1], two[1]) == (1, 2)
    assert compare_dump(one[0], two[0]) == (True, {"blocks": 2}, {"blocks": 2})
    ok, ref, ours = compare_dump(one[0], {(1, 0, "device", 10, 100, None)})
    assert not ok
    assert ref == {"blocks": 2, "only_here": [[1, 0, "device", 11, 101, 10]]}
    assert ours == {"blocks": 1, "only_here": []}


def test_overlap_view_sorts_rows_and_keeps_errors() -> None:
    row = {"device_blocks": 2, "host_pinned_blocks": 3, "disk_blocks": 3,
           "host_pinned_extension_blocks": 1, "disk_extension_blocks": 0}  # fmt: skip
    workers = [{"worker_id": 2, "dp_rank": 0, **row}, {"worker_id": 1, "dp_rank": 1, **row}]
    a = {"num_blocks": 4, "workers": workers}
    b = {**a, "workers": workers[::-1], "shared_cache": {"enabled": False}}
    assert overlap_view(200, a) == overlap_view(200, b)
    assert overlap_view(200, a)["rows"][0] == [1, 1, 2, 3, 3, 1, 0]
    assert overlap_view(503, {"error": "x"}) == [503, {"error": "x"}]


def test_select_compares_tie_sets_and_bodies_per_pick() -> None:
    body = {"worker_id": 1, "dp_rank": 0, "overlap": {"gpu": 8}}
    other = {"worker_id": 2, "dp_rank": 0, "overlap": {"gpu": 8}}
    ref = SelectAnswer(200, {"1/0": body, "2/0": other})
    assert compare_select(ref, SelectAnswer(200, {"2/0": other, "1/0": body}))[0]
    ok, a, b = compare_select(ref, SelectAnswer(200, {"1/0": body}))
    assert not ok and a == {"tied": ["1/0", "2/0"]} and b == {"tied": ["1/0"]}
    ok, a, b = compare_select(ref, SelectAnswer(200, {"1/0": body, "2/0": {**other, "x": 1}}))
    assert not ok and a["pick"] == b["pick"] == "2/0"
    err = SelectAnswer(503, {"error": {"error": "no schedulable workers are available"}})
    ok, a, b = compare_select(err, ref)
    assert not ok and a == [503, {"error": "no schedulable workers are available"}]
    assert compare_select(err, err)[0]


def test_workers_view_ignores_order_and_other_fields() -> None:
    a = [{"worker_id": 2, "lifecycle": "schedulable", "endpoint": "x"},
         {"worker_id": 1, "lifecycle": "incomplete", "not_schedulable_reasons": ["b", "a"]}]  # fmt: skip
    b = [{"worker_id": 1, "lifecycle": "incomplete", "not_schedulable_reasons": ["a", "b"]},
         {"worker_id": 2, "lifecycle": "schedulable"}]  # fmt: skip
    assert workers_view(a) == workers_view(b) == [[1, "incomplete", ["a", "b"]],
                                                  [2, "schedulable", []]]  # fmt: skip


def test_summary_and_report() -> None:
    checks = [
        Check("chain", "live", "stored: dump blocks", True, {"blocks": 4}, {"blocks": 4}),
        Check("chain", "live", "stored: dump events", False, 1, 4),
        Check("tiers", "live", "host: device: overlap b0[:3]+2", True),
        Check("late-joiner", "gap", "joined: workers", False, ["a"], ["b"]),
    ]
    s = summarize(checks)
    assert s["scenarios"] == [
        {"scenario": "chain", "kind": "live", "agreed": 1, "total": 2},
        {"scenario": "tiers", "kind": "live", "agreed": 1, "total": 1},
        {"scenario": "late-joiner", "kind": "gap", "agreed": 0, "total": 1},
    ]
    assert s["totals"] == {"live": {"agreed": 2, "total": 3}, "gap": {"agreed": 0, "total": 1}}
    assert s["families"] == {
        "live": {"dump blocks": {"agreed": 1, "total": 1}, "dump events": {"agreed": 0, "total": 1},
                 "overlap": {"agreed": 1, "total": 1}},
        "gap": {"workers": {"agreed": 0, "total": 1}},
    }  # fmt: skip
    assert [d["name"] for d in s["differences"]] == ["stored: dump events", "joined: workers"]
    report = {"engines": [{"engine": "vllm", "version": "0.33.0", "wheel": "w.whl", **s}]}
    text = render(report)
    assert "  vllm live: 2/3 agree (dump blocks 1/1, dump events 0/1, overlap 1/1)" in text
    assert "  vllm gap: 0/1 agree (workers 0/1)" in text
    assert "  [live] chain / stored: dump events\n      reference: 1\n      ours:      4" in text
    assert text.splitlines()[-1] == "summary: vllm live 2/3, gap 0/1"
    json.dumps(report)  # the --json form
