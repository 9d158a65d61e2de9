"""Snapshots in Redis, late instances, trimmed streams."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from prometheus_client import CollectorRegistry

from kv_slot_tracker.replication.redis import RedisReplication
from kv_slot_tracker.replication.redis.stream import NamespaceKeys
from kv_slot_tracker.service import SlotTrackerService
from tests.calls import free, potential_loads, prefill_complete, register, upsert
from tests.fakes import NS_PER_SECOND, FakeClock
from tests.replication.helpers import KEY, Cluster, TcpProxy, eventually
from tests.support.tracker import request_ranks

pytestmark = pytest.mark.redis


def request_ids(node) -> set[str]:
    t = node.service.trackers.get(KEY)
    return set(request_ranks(t)) if t is not None else set()


def traffic(node, prefix: str, n: int, free_every: int = 3) -> None:
    for i in range(n):
        rid = f"{prefix}{i}"
        node.add(rid, worker_id=1 + i % 2, hashes=[1, 2, 100 + i], tokens=50 + i, prefill_ms=800)
        if i % free_every == 1:
            free(node.service, KEY, rid)
        elif i % free_every == 2:
            prefill_complete(node.service, KEY, rid)


def assert_same(a, b) -> None:
    assert a.loads() == b.loads()
    assert a.service.workers(None, None) == b.service.workers(None, None)
    query = [1, 2, 105]
    assert potential_loads(a.service, KEY, query, None, None, 11) == potential_loads(
        b.service, KEY, query, None, None, 11
    )
    assert request_ids(a) == request_ids(b)
    b.service.tracker(KEY).assert_consistent()


async def test_snapshot_round_trip_through_redis(cluster: Cluster) -> None:
    a = await cluster.node()
    register(a.service, KEY, 1, 4, 0, 2)
    register(a.service, KEY, 2, 4, 0, 1)
    traffic(a, "r", 60)
    await eventually(lambda: a.rep.status().outbox_depth == 0)
    await eventually(lambda: a.rep.status().stream_position != "0-0")
    assert await a.rep.write_snapshot()
    assert a.rep.status().snapshot_age_seconds is not None

    cluster.clocks.advance(0.3)  # some decay happened before the late instance starts
    b = await cluster.node()
    assert b.rep.ready()
    st = b.rep.status()
    assert st.bootstraps == 1
    assert st.snapshot_stream_id == a.rep.status().snapshot_stream_id
    assert st.applied == 0  # everything came from the snapshot
    assert_same(a, b)
    assert any(r["active_prefill_tokens"] for r in b.loads())
    assert any(r["modeled_remaining_prefill_ms"] for r in b.loads())
    cluster.clocks.advance(0.4)
    assert_same(a, b)


async def test_late_instance_reads_records_after_the_snapshot(cluster: Cluster) -> None:
    a = await cluster.node()
    register(a.service, KEY, 1, 4, 0, 2)
    register(a.service, KEY, 2, 4, 0, 1)
    traffic(a, "before-", 30)
    await eventually(lambda: a.rep.status().outbox_depth == 0)
    assert await a.rep.write_snapshot()
    traffic(a, "after-", 20)
    free(a.service, KEY, "before-0")
    await eventually(lambda: a.rep.status().outbox_depth == 0)

    b = await cluster.node()
    assert b.rep.ready()
    assert_same(a, b)
    assert b.rep.status().applied == a.rep.status().published - _published_at_snapshot(a)


def _published_at_snapshot(node) -> int:
    # the snapshot covered the registrations and the first traffic() call
    return 2 + _records_of_traffic(30)


def _records_of_traffic(n: int, free_every: int = 3) -> int:
    return sum(1 + (i % free_every in (1, 2)) for i in range(n))


async def test_late_instance_without_snapshot_reads_the_whole_stream(cluster: Cluster) -> None:
    a = await cluster.node()
    register(a.service, KEY, 1, 4, 0, 2)
    register(a.service, KEY, 2, 4, 0, 1)
    traffic(a, "r", 25)
    await eventually(lambda: a.rep.status().outbox_depth == 0)
    b = await cluster.node()
    assert b.rep.ready()
    assert b.rep.status().snapshot_age_seconds is None
    assert b.rep.status().applied == a.rep.status().published
    assert_same(a, b)


async def test_snapshot_taken_before_own_records_reach_the_stream(cluster: Cluster) -> None:
    """State includes records still in the outbox: a loader must not apply them twice."""
    a = await cluster.node()
    register(a.service, KEY, 1, 4, 0, 1)
    register(a.service, KEY, 2, 4, 0, 1)
    await eventually(lambda: a.rep.status().outbox_depth == 0)
    traffic(a, "q", 12)
    # no await in between: the publisher has not run, the records are only in the outbox
    assert a.rep.status().outbox_depth > 0
    assert await a.rep.write_snapshot()
    await eventually(lambda: a.rep.status().outbox_depth == 0)

    b = await cluster.node()
    st = b.rep.status()
    assert st.applied == 0
    assert st.duplicates == _records_of_traffic(12)
    assert_same(a, b)


async def test_trimmed_position_bootstraps_again(cluster: Cluster, redis_url: str) -> None:
    """B is cut off from Redis while A goes on, the stream is trimmed past B's position; on
    reconnecting B finds records missing, reloads the snapshot that covers them, and converges.
    Records B accepted while cut off are published and kept."""
    port = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["port"]
    proxy = TcpProxy(port)
    await proxy.start()
    try:
        a = await cluster.node()
        b = await cluster.node(redis_url=proxy.url())
        register(a.service, KEY, 1, 4, 0, 2)
        register(a.service, KEY, 2, 4, 0, 1)
        traffic(a, "early-", 10)
        await eventually(lambda: request_ids(b) == request_ids(a) and len(b.loads()) == 3)

        proxy.cut()
        await eventually(lambda: not b.rep.status().connected, what="b to notice")
        traffic(a, "missed-", 15)
        b.add("b-offline-1", hashes=[7, 7])
        b.add("b-offline-2", worker_id=2, hashes=[8])
        await eventually(lambda: a.rep.status().outbox_depth == 0)
        assert await a.rep.write_snapshot()
        snapshot_id = a.rep.status().snapshot_stream_id
        traffic(a, "late-", 5)
        await eventually(lambda: a.rep.status().outbox_depth == 0)
        client = redis.Redis.from_url(redis_url)
        ms, seq = (int(x) for x in snapshot_id.split("-"))
        trimmed = client.xtrim(NamespaceKeys.of(cluster.namespace).events, minid=f"{ms}-{seq + 1}")
        client.close()
        assert trimmed > 0

        proxy.restore()
        await eventually(
            lambda: request_ids(a) == request_ids(b) and "b-offline-2" in request_ids(a),
            timeout=10,
            what="convergence after the gap",
        )
        await eventually(lambda: a.loads() == b.loads())
        assert_same(a, b)
        st = b.rep.status()
        assert st.gaps == 1
        assert st.bootstraps == 2
        assert {"missed-0", "late-0", "b-offline-1"} <= request_ids(b)
        assert st.dropped == 0
    finally:
        await proxy.close()


async def test_stream_is_trimmed_by_time(cluster: Cluster) -> None:
    """Entries older than ``stream_retention_seconds`` go once a snapshot covers them."""
    wall = FakeClock(time.time_ns())  # entry ids are the server's real time
    rep = RedisReplication(
        cluster.settings(stream_retention_seconds=60), CollectorRegistry(), wall_clock=wall.now
    )
    service = SlotTrackerService(instance_id=rep.instance_id, replicator=rep)
    await rep.start(service)
    await rep.settled(10)
    try:
        register(service, KEY, 1, 4, 0, 1)
        for i in range(300):
            free(service, KEY, f"none-{i}")  # no-op frees publish nothing
            upsert(service, KEY, 1, 4, 0, 1 + i % 2)
        await eventually(lambda: rep.status().outbox_depth == 0)
        client = redis.Redis.from_url(cluster.redis_url)
        key = NamespaceKeys.of(cluster.namespace).events
        published = rep.status().published
        assert published == 300  # the register and every upsert that changed the range
        assert client.xlen(key) == published
        # the stream ids are the server's (real) time; move our wall clock past the retention
        wall.set(time.time_ns() + 3600 * NS_PER_SECOND)
        upsert(service, KEY, 1, 4, 0, 3)
        await eventually(lambda: rep.status().outbox_depth == 0)
        # no snapshot covers them: a starting instance needs them all, nothing is trimmed
        assert client.xlen(key) == published + 1
        await eventually(lambda: rep.reader.position == rep.outbox.last_appended)
        assert await rep.write_snapshot()
        upsert(service, KEY, 1, 4, 0, 4)
        await eventually(lambda: client.xlen(key) < published, what="old entries to be trimmed")
        client.close()
    finally:
        await rep.stop()


async def test_periodic_snapshots_take_turns_under_a_lease(cluster: Cluster) -> None:
    a = await cluster.node(snapshot_interval_seconds=1)
    b = await cluster.node(snapshot_interval_seconds=1)
    register(a.service, KEY, 1, 4, 0, 1)
    register(a.service, KEY, 2, 4, 0, 1)
    traffic(a, "r", 5)
    written = lambda: a.rep.counters.snapshots_written + b.rep.counters.snapshots_written  # noqa: E731
    await eventually(lambda: written() >= 1, timeout=5, what="a periodic snapshot")
    # the instance that did not write learns the snapshot's age on its next round
    await eventually(
        lambda: all(n.rep.status().snapshot_age_seconds is not None for n in (a, b)),
        timeout=5,
    )
    # a lease lasts one interval: at most one snapshot per interval for the namespace
    assert written() <= 2
    late = await cluster.node()
    assert late.rep.status().bootstraps == 1
    assert_same(a, late)


async def test_snapshot_write_is_fenced_by_the_lease(cluster: Cluster) -> None:
    a = await cluster.node()
    register(a.service, KEY, 1, 4, 0, 1)
    store = a.rep.snapshot_store
    assert await store.try_lease("token-a", 10_000)
    assert not await store.try_lease("token-b", 10_000)
    assert not await a.rep.write_snapshot("token-b")  # lost the lease: nothing written
    assert await store.meta() is None
    assert await a.rep.write_snapshot("token-a")
    assert (await store.meta())[0] == a.rep.status().snapshot_stream_id


async def test_restart_with_a_fixed_instance_id(cluster: Cluster) -> None:
    """A restarted process keeps its instance id but numbers its records afresh; peers and the
    process itself keep everything its previous life published."""
    first = await cluster.node(instance_id=42)
    peer = await cluster.node()
    register(first.service, KEY, 1, 4, 0, 1)
    register(first.service, KEY, 2, 4, 0, 1)
    traffic(first, "old-", 9)
    await eventually(lambda: request_ids(peer) == request_ids(first) != set())
    await first.rep.stop()

    second = await cluster.node(instance_id=42)
    assert second.rep.instance_id == 42
    assert second.rep.incarnation != first.rep.incarnation
    assert request_ids(second) == request_ids(peer)  # its previous life, read back
    second.add("new-0", hashes=[5, 6])
    free(second.service, KEY, "old-0")
    await eventually(lambda: request_ids(peer) == request_ids(second))
    assert "new-0" in request_ids(peer) and "old-0" not in request_ids(peer)
    assert peer.rep.status().gaps == 0
    assert_same(peer, second)


async def test_instance_started_after_a_reset_waits_for_a_snapshot(
    cluster: Cluster, redis_url: str
) -> None:
    """While Redis lost data and no snapshot was written since (the reset marker is set), the
    stream alone may lack records or hold them out of order: a starting instance stays not
    ready until a running one writes a snapshot, then starts from it."""
    a = await cluster.node()
    register(a.service, KEY, 1, 4, 0, 1)
    register(a.service, KEY, 2, 4, 0, 1)
    traffic(a, "r", 9)
    await eventually(lambda: a.rep.status().outbox_depth == 0)
    keys = NamespaceKeys.of(cluster.namespace)
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(keys.reset, "1")  # what an instance does when it notices the loss
        b = await cluster.node(start=False)
        await b.rep.start(b.service)  # returns at once: the bootstrap runs in the background
        starting = asyncio.create_task(b.rep.settled(10))
        await eventually(
            lambda: "waiting for a snapshot" in (b.rep.status().not_ready_reason or ""),
            what="b to wait for a snapshot",
        )
        assert not b.rep.ready()
        assert await a.rep.write_snapshot()
        assert not client.exists(keys.reset)  # a snapshot written after the reset clears it
        await starting
        assert b.rep.ready()
        assert b.rep.status().applied == 0  # everything came from the snapshot
        assert_same(a, b)
    finally:
        client.close()
