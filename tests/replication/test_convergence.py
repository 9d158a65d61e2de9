"""Two (or three) instances in one process, wired through a real Redis, converge."""

from __future__ import annotations

import asyncio

import pytest
import redis

from tests.calls import (
    free,
    potential_loads,
    prefill_complete,
    reconcile,
    register,
    unregister,
    upsert,
)
from tests.replication.helpers import GROUP, KEY, MODEL, Cluster, eventually
from tests.support.tracker import request_ranks, slots

pytestmark = pytest.mark.redis


def workers(node) -> list[dict]:
    return node.service.workers(None, None)


async def test_topology_registered_on_one_appears_on_the_other(cluster: Cluster) -> None:
    a = await cluster.node()
    b = await cluster.node()
    assert a.rep.ready() and b.rep.ready()
    assert a.rep.instance_id != b.rep.instance_id

    register(a.service, KEY, 1, 16, 0, 2)
    register(a.service, KEY, 2, 16, 0, 1)
    await eventually(lambda: workers(b) == workers(a), what="registration to replicate")
    assert [(w["worker_id"], w["dp_size"], w["block_size"]) for w in workers(b)] == [
        (1, 2, 16),
        (2, 1, 16),
    ]

    upsert(b.service, KEY, 2, 16, 0, 4)
    await eventually(lambda: workers(a) == workers(b), what="upsert to replicate")
    assert workers(a)[1]["dp_size"] == 4

    unregister(a.service, KEY, 1)
    await eventually(lambda: workers(b) == workers(a), what="unregister to replicate")
    assert [w["worker_id"] for w in workers(b)] == [2]

    reconcile(b.service, KEY, 16, [(3, 0, 1), (4, 1, 2)])
    await eventually(lambda: workers(a) == workers(b), what="reconcile to replicate")
    assert [w["worker_id"] for w in workers(a)] == [3, 4]


async def test_lifecycle_traffic_converges_to_identical_loads(cluster: Cluster) -> None:
    a = await cluster.node()
    b = await cluster.node()
    register(a.service, KEY, 1, 4, 0, 2)
    register(a.service, KEY, 2, 4, 0, 1)
    await eventually(lambda: len(b.loads()) == 3, what="topology on b")

    expected_live: set[str] = set()
    for i in range(300):
        node = a if i % 2 else b
        rid = f"r{i}"
        node.add(rid, worker_id=1 + i % 2, dp_rank=0, hashes=[i % 7, 100 + i], tokens=10 + i)
        expected_live.add(rid)
        if i % 3 == 0:
            prefill_complete(node.service, KEY, rid)
        if i % 5 == 0 and i > 0:
            # free a request created on the *other* instance once it has arrived here
            victim = f"r{i - 1}"
            await eventually(lambda n=node, v=victim: v in request_ranks(n.service.tracker(KEY)))
            free(node.service, KEY, victim)
            expected_live.discard(victim)

    def same() -> bool:
        return a.loads() == b.loads() and a.rep.status().outbox_depth == 0

    await eventually(same, what="identical loads")
    ta, tb = a.service.tracker(KEY), b.service.tracker(KEY)
    assert set(request_ranks(ta)) == set(request_ranks(tb)) == expected_live
    assert sum(r["active_requests"] for r in a.loads()) == len(expected_live)
    ta.assert_consistent()
    tb.assert_consistent()
    query = [0, 100]
    assert potential_loads(a.service, KEY, query, None, None, 7) == potential_loads(
        b.service, KEY, query, None, None, 7
    )
    sa, sb = a.rep.status(), b.rep.status()
    assert sa.dropped == sb.dropped == 0
    assert sa.gaps == sb.gaps == 0
    assert sa.applied > 0 and sb.applied > 0


async def test_prefill_decay_uses_the_producer_time(cluster: Cluster) -> None:
    a = await cluster.node()
    b = await cluster.node()
    register(a.service, KEY, 1, 4, 0, 1)
    await eventually(lambda: len(b.loads()) == 1, what="topology on b")

    # 100 tokens expected to take 10 s, added on a at T
    a.add("p", hashes=[1, 2], tokens=100, prefill_ms=10_000)
    # the record reaches b "3 s later" (fake time): b must anchor it at T, not at receipt
    cluster.clocks.advance(3)
    await eventually(lambda: b.loads()[0]["active_requests"] == 1, what="add to replicate")
    assert a.loads()[0]["active_prefill_tokens"] == 70
    assert b.loads() == a.loads()
    assert b.loads()[0]["modeled_remaining_prefill_ms"] == 7_000
    # request age is the producer's too
    started_a = slots(a.service.tracker(KEY))[(1, 0)].requests["p"].started_at
    started_b = slots(b.service.tracker(KEY))[(1, 0)].requests["p"].started_at
    assert started_a == started_b

    cluster.clocks.advance(4)
    assert a.loads() == b.loads()
    assert b.loads()[0]["active_prefill_tokens"] == 30


async def test_active_sequence_replica_sync_isolated_by_endpoint(
    cluster: Cluster, redis_url: str, redis_namespace: str
) -> None:
    """Port of the seed test: state replicates between trackers of one endpoint only.

    An endpoint maps to a (model, routing group) key within a namespace here; a second
    namespace is a fully separate deployment sharing the Redis server.
    """
    a = await cluster.node()
    a_peer = await cluster.node()
    other_ns = Cluster(redis_url, redis_namespace + "-other", cluster.clocks)
    b_ns = await other_ns.node()
    try:
        key_a, key_b = (MODEL, "generate-a"), (MODEL, "generate-b")
        for node in (a, b_ns):
            register(node.service, key_a, 0, 4, 0, 1)
            register(node.service, key_b, 0, 4, 0, 1)
        await eventually(lambda: len(a_peer.loads()) == 2, what="topology on the peer")

        def blocks(node, key) -> int:
            return node.service.tracker(key).active_blocks()[(0, 0)]

        for i in range(100):
            if blocks(a_peer, key_a) > 0:
                break
            a.add(f"endpoint-a-request-{i}", worker_id=0, hashes=[1, 2, 3, 4], tokens=4, key=key_a)
            await asyncio.sleep(0.05)
        await eventually(lambda: blocks(a_peer, key_a) > 0, what="the peer to see endpoint a")
        assert blocks(a, key_a) > 0

        # nothing leaks to the other endpoint: once the peer applied a marker added after
        # every other record of a (one stream, in order), endpoint b is still empty
        a.add("marker-a", worker_id=0, hashes=[9], tokens=4, key=key_a)
        await eventually(
            lambda: a_peer.service.tracker(key_a).has_request("marker-a"), what="a's marker"
        )
        assert blocks(a_peer, key_b) == 0 and blocks(a, key_b) == 0
        # nor to the other namespace: a's records are all in Redis (the peer read the last),
        # and once b_ns applied a marker of its own namespace written after them, it has read
        # everything that could have leaked into its stream: that marker alone
        b_peer = await other_ns.node()
        await eventually(lambda: len(b_peer.loads()) == 2, what="topology on b's peer")
        b_peer.add("marker-b", worker_id=0, hashes=[9], tokens=4, key=key_a)
        await eventually(
            lambda: b_ns.service.tracker(key_a).has_request("marker-b"), what="b's marker"
        )
        assert blocks(b_ns, key_a) == 1  # the marker's one block, none of a's
        assert blocks(b_ns, key_b) == 0
        assert b_ns.rep.status().applied == 1
    finally:
        await other_ns.close()
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match="{" + other_ns.namespace + "}:*"))
        if keys:
            client.delete(*keys)
        client.close()


async def test_unknown_key_records_are_ignored(cluster: Cluster) -> None:
    """Lifecycle records for a key the receiver has no tracker for are dropped, not created."""
    a = await cluster.node()
    b = await cluster.node()
    register(a.service, KEY, 1, 4, 0, 1)
    await eventually(lambda: len(b.loads()) == 1)
    unregister(b.service, KEY, 1)  # b drops the key and tells a
    await eventually(lambda: a.loads() == [] and b.loads() == [])
    # a registers under another group; the lifecycle under it replicates, KEY stays absent
    other = (MODEL, "other")
    register(a.service, other, 1, 4, 0, 1)
    a.add("x", key=other)
    await eventually(lambda: b.loads() == a.loads() and len(b.loads()) == 1)
    assert b.loads()[0]["routing_group"] == "other"
    assert GROUP not in {r["routing_group"] for r in b.loads()}
