"""KV-index recovery from a peer (``indexer_peers``), with real processes.

Three ``python -m kv_slot_tracker`` processes on one Redis namespace and one real publisher process
speaking vLLM's KV-event format, registered with NO replay endpoint: a batch an instance missed
can only come back through a peer. ``a`` starts first (its only peer answers nothing: it starts
from the engines alone and says so), ``b`` next; the engine publishes; ``c`` starts after that and
loads the index from a peer (the first one it is given is down); ``b`` is stopped, misses a batch,
and comes back from a peer. After the publisher's last batch, all three answer the same overlap
scores, the numbers the batches make, and no instance ever had to clear a rank.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from bench.kv_publisher import PublisherProcess, removed, stored
from tests.e2e.conftest import FleetFactory
from tests.e2e.servers import ServerProcess, wait_until
from tests.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

SEL = "/selection"
BS = 4
TOKENS = list(range(100, 124))  # six blocks


def overlap(s: ServerProcess) -> list[tuple[int, int, int]]:
    r = httpx.post(s.url + SEL + "/overlap_scores", json={"token_ids": TOKENS}, timeout=5)
    assert r.status_code == 200, r.text
    return [(w["worker_id"], w["dp_rank"], w["device_blocks"]) for w in r.json()["workers"]]


def selection_ready(s: ServerProcess) -> tuple[int, dict[str, Any]]:
    r = httpx.get(s.url + SEL + "/ready", timeout=5)
    return r.status_code, r.json()


def metric(s: ServerProcess, name: str) -> float:
    text = httpx.get(s.url + "/metrics", timeout=5).text
    m = re.search(rf"^kv_slot_tracker_{name} (\S+)$", text, re.M)
    assert m is not None, f"no {name} on {s.name}"
    return float(m.group(1))


def all_show(servers: list[ServerProcess], want: list[tuple[int, int, int]], what: str) -> None:
    wait_until(
        lambda: all(overlap(s) == want for s in servers),
        15,
        what,
        0.05,
        lambda: "\n".join(f"{s.name}: {overlap(s)}" for s in servers),
    )


def dump_facts(body: dict) -> list[tuple]:
    """``/dump`` as one fact per block: (partition, worker, rank, tier, block, tokens, parent)."""
    out = []
    for part, v in body.items():
        for e in v["events"]:
            stored_ = e["event"]["data"]["stored"]
            parent = stored_["parent_hash"]
            for b in stored_["blocks"]:
                out.append((part, e["worker_id"], e["event"]["dp_rank"], e["storage_tier"],
                            b["block_hash"], b["tokens_hash"], parent))  # fmt: skip
                parent = b["block_hash"]
    return sorted(out, key=repr)


def test_late_and_restarted_instances_load_the_index_from_a_peer(
    fleet_factory: FleetFactory,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with PublisherProcess(ranks=1) as pub:
        fleet = fleet_factory(env={"ROUTER_USE_KV_EVENTS": "true"})
        (a,) = fleet.spawn(1, INDEXER_PEERS=dead, INDEXER_PEERS_TIMEOUT_SECONDS="1")
        (b,) = fleet.spawn(1, INDEXER_PEERS=a.url)
        r = httpx.post(a.url + SEL + "/workers", json={
            "worker_id": 1, "endpoint": "http://w1", "block_size": BS,
            "kv_events_endpoint": pub.endpoints[0],
        }, timeout=5)  # fmt: skip
        assert r.json()["lifecycle"] == "schedulable"
        pub.wait_subscribers(0, 2)  # b learnt the worker through Redis
        pub.publish(0, [stored([1, 2, 3], TOKENS[:12], BS)])  # seq 0
        pub.publish(0, [stored([4], TOKENS[12:16], BS, parent=3)])  # seq 1
        pub.publish(0, [stored([5, 6], TOKENS[16:24], BS, parent=4)])  # seq 2
        all_show([a, b], [(1, 0, 6)], "a and b indexed the stores")

        # a's only peer answered nothing: it started from the engines alone, and said so
        status, body = selection_ready(a)
        assert status == 200
        assert body["kv_events"]["recovered_from"] is None
        assert body["kv_events"]["recovering"] is False
        assert "no peer of " + dead + " gave its index" in a.log_tail(400)
        assert metric(a, "kv_index_recovery_peer_failures_total") >= 1

        # c starts after the engine published: its first peer is down, the second gives the index
        (c,) = fleet.spawn(1, INDEXER_PEERS=f"{dead},{a.url},{b.url}")
        wait_until(lambda: selection_ready(c)[0] == 200, 15, "c ready", 0.05, c.log_tail)
        assert selection_ready(c)[1]["kv_events"]["recovered_from"] == a.url
        assert overlap(c) == [(1, 0, 6)]  # before any further batch
        assert metric(c, "kv_index_recovery_blocks_total") == 6
        pub.wait_subscribers(0, 3)

        # b stops, misses seq 3, and comes back from a peer
        b.kill()
        pub.publish(0, [removed([6])])  # seq 3
        all_show([a, c], [(1, 0, 5)], "a and c applied the removal")
        fleet.restart(b, INDEXER_PEERS=f"{a.url},{c.url}")
        wait_until(lambda: selection_ready(b)[0] == 200, 15, "b ready", 0.05, b.log_tail)
        assert selection_ready(b)[1]["kv_events"]["recovered_from"] == a.url
        assert overlap(b) == [(1, 0, 5)]
        pub.wait_subscribers(0, 4)

        pub.publish(0, [removed([5])])  # seq 4
        pub.publish(0, [stored([7], TOKENS[16:20], BS, parent=4)])  # seq 5, the last
        all_show([a, b, c], [(1, 0, 5)], "all three agree after the last batch")
        for s in (a, b, c):
            assert metric(s, "kv_events_gaps_total") == 0, s.name  # each continued in sequence
            assert metric(s, "kv_events_gaps_lost_total") == 0, s.name
        # and the same blocks, not only the same count (how /dump groups them into chains
        # follows each index's history, as the reference's tree does)
        dumps = [dump_facts(httpx.get(s.url + SEL + "/dump", timeout=5).json()) for s in (a, b, c)]
        assert dumps[0] == dumps[1] == dumps[2]
        assert len(dumps[0]) == 5
