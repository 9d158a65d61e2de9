"""``loadtest/kv_engines.py``: what a simulated engine rank caches and the events it sends.

* a prompt's blocks are stored once, chained to the cached prefix they extend, and decode as
  the service's ingest decodes an engine's batch;
* past the capacity the least recently used blocks no cached block extends are evicted, so the
  cache stays a tree (every cached block's parent is cached) and popular prefixes stay;
* the process publishes on every rank once a subscriber joined, and reports what it published.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import zmq

from kv_slot_tracker.ingest.records import BlocksRemoved, BlocksStored, decode_batch
from loadtest.kv_engines import RankCache, block_hash, system_prompts

ROOT = Path(__file__).resolve().parents[2]
BS = 4


def blocks(*ids: int) -> list[int]:
    """Tokens of blocks whose tokens are all ``id``."""
    return [i for i in ids for _ in range(BS)]


def decoded(events: list) -> tuple:
    return decode_batch(0, msgpack.packb([0.0, events, 0])).events


def test_a_prompt_is_stored_once_chained_to_its_cached_prefix() -> None:
    cache = RankCache(capacity=100)
    events, evicted = cache.prefill(blocks(1, 2, 3) + [9], BS)  # the partial block is not kept
    h1 = block_hash(0, blocks(1))
    h2 = block_hash(h1, blocks(2))
    h3 = block_hash(h2, blocks(3))
    assert evicted == [] and decoded(events) == (
        BlocksStored((h1, h2, h3), None, tuple(blocks(1, 2, 3)), BS, 0, None),
    )
    assert cache.prefill(blocks(1, 2, 3), BS) == ([], [])  # all cached: nothing to send
    events, _ = cache.prefill(blocks(1, 2, 7), BS)  # shares two blocks
    h7 = block_hash(h2, blocks(7))
    assert decoded(events) == (BlocksStored((h7,), h2, tuple(blocks(7)), BS, 0, None),)


def test_eviction_takes_the_least_recently_used_leaves() -> None:
    cache = RankCache(capacity=4)
    cache.prefill(blocks(1, 2), BS)  # a shared prefix ...
    cache.prefill(blocks(1, 2, 5), BS)  # ... extended twice
    cache.prefill(blocks(1, 2, 6), BS)
    h1 = block_hash(0, blocks(1))
    h2 = block_hash(h1, blocks(2))
    events, evicted = cache.prefill(blocks(1, 2, 7), BS)  # a fifth block: 5 goes (oldest leaf)
    assert evicted == [block_hash(h2, blocks(5))]
    assert decoded(events)[1] == BlocksRemoved(tuple(evicted), 0)
    _, evicted = cache.prefill(blocks(8, 9), BS)  # two more: 6, then 7 (the prefix is older
    assert evicted == [block_hash(h2, blocks(6)), block_hash(h2, blocks(7))]  # but not a leaf)
    assert set(cache.nodes) == {h1, h2, block_hash(0, blocks(8)),
                                block_hash(block_hash(0, blocks(8)), blocks(9))}  # fmt: skip


def test_the_cache_stays_a_tree_within_its_capacity() -> None:
    import random

    from loadtest.kv_engines import make_prompt

    rng = random.Random(7)
    prompts = system_prompts(4, 8, BS)
    cache = RankCache(capacity=60)
    for _ in range(300):
        cache.prefill(make_prompt(rng, prompts, BS), BS)
        assert len(cache.nodes) <= 60 + 8 * 2  # at most the prompt just stored beyond it
        for h, node in cache.nodes.items():
            assert node.parent == 0 or node.parent in cache.nodes, h
            children = sum(1 for n in cache.nodes.values() if n.parent == h)
            assert node.children == children and (children == 0) == (h in cache.leaves)


def test_the_process_publishes_once_subscribed_and_reports() -> None:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "loadtest" / "kv_engines.py"), "--ranks", "2", "--dp-size",
         "2", "--block-size", str(BS), "--rate", "50", "--capacity", "20"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    ctx = zmq.Context()
    try:
        assert proc.stdout is not None and proc.stdin is not None
        endpoints = json.loads(proc.stdout.readline())["endpoints"]
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for endpoint in endpoints:
            sub.connect(endpoint)
        seen: dict[int, list[int]] = {0: [], 1: []}  # dp rank -> sequence numbers
        deadline = time.monotonic() + 30  # a bound against a hang
        while min(len(s) for s in seen.values()) < 5:
            assert time.monotonic() < deadline, seen
            if sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                batch = decode_batch(int.from_bytes(seq, "big"), payload)
                assert batch.events and batch.dp_rank in seen
                seen[batch.dp_rank].append(batch.seq)
        for seqs in seen.values():  # each rank numbers its batches from 0, none skipped
            assert seqs == list(range(len(seqs)))
        proc.stdin.close()
        figures = json.loads(proc.stdout.read().strip().splitlines()[-1])
        assert proc.wait(10) == 0
        assert figures["batches"] >= 10 and figures["waiting_ranks"] == 0, figures
        assert figures["removed_blocks"] > 0, figures  # 20 blocks a rank: evicted already
    finally:
        if proc.poll() is None:
            proc.kill()
        ctx.destroy(linger=0)


def test_the_load_test_needs_the_runtime_install_and_locust_only() -> None:
    """What loadtest/ imports (with bench/kv_publisher.py) is the standard library, the
    service, its runtime dependencies and the ``loadtest`` extra."""
    import ast
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {d.split(">")[0].split("[")[0].split("<")[0].strip() for d in project["dependencies"]}
    assert project["optional-dependencies"]["loadtest"] == ["locust>=2.32"]
    allowed = {"kv_slot_tracker", "bench", "kv_engines", "locust", "gevent"}  # gevent: locust's
    allowed |= {"zmq" if n == "pyzmq" else n for n in runtime}
    imported = set()
    for path in [*ROOT.glob("loadtest/*.py"), ROOT / "bench" / "kv_publisher.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    outside = sorted(m for m in imported - allowed if m not in sys.stdlib_module_names)
    assert outside == [], outside
    assert {"zmq", "msgpack", "locust"} <= imported
