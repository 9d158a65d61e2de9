"""Redis goes away mid-traffic and comes back empty: nothing is lost, instances agree."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import pytest
import redis

from kv_slot_tracker.core.types import NS_PER_S
from kv_slot_tracker.replication.redis.stream import NamespaceKeys
from tests.calls import free, register
from tests.replication.helpers import KEY, Cluster, Node, RedisServer, TcpProxy, eventually
from tests.support.tracker import request_ranks

pytestmark = pytest.mark.redis


class Traffic:
    """Adds and frees on several instances; remembers which requests should be live."""

    def __init__(self, nodes: list[Node], seed: int = 1) -> None:
        self.nodes = nodes
        self.rng = random.Random(seed)
        self.live: dict[str, Node] = {}
        self.n = 0

    def step(self) -> None:
        node = self.nodes[self.n % len(self.nodes)]
        rid = f"r{self.n}"
        node.add(rid, worker_id=1 + self.n % 2, hashes=[1, 2, self.n], tokens=20)
        self.live[rid] = node
        if self.n % 3 == 0:  # free an older request created on this same instance
            mine = [r for r, owner in self.live.items() if owner is node and r != rid]
            if mine:
                victim = self.rng.choice(mine)
                free(node.service, KEY, victim)
                del self.live[victim]
        self.n += 1

    async def run(self, steps: int, pause: float = 0.002) -> None:
        for _ in range(steps):
            self.step()
            await asyncio.sleep(pause)


def requests(node: Node) -> set[str]:
    return set(request_ranks(node.service.tracker(KEY)))


@contextlib.asynccontextmanager
async def b_behind_a_proxy(
    cluster: Cluster, redis_url: str
) -> AsyncIterator[tuple[Node, Node, TcpProxy, redis.Redis]]:
    """Instances A and B on ``redis_url``, B through a proxy that can cut it off, and a plain
    client of the server."""
    port = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["port"]
    proxy = TcpProxy(port)
    await proxy.start()
    client = redis.Redis.from_url(redis_url)
    try:
        a = await cluster.node()
        b = await cluster.node(redis_url=proxy.url())
        yield a, b, proxy, client
    finally:
        client.close()
        await proxy.close()


async def test_redis_restart_mid_traffic_loses_nothing(
    cluster: Cluster, redis_server: RedisServer
) -> None:
    redis_server.start()
    cluster.redis_url = redis_server.url
    a = await cluster.node()
    b = await cluster.node()
    register(a.service, KEY, 1, 4, 0, 1)
    register(a.service, KEY, 2, 4, 0, 1)
    await eventually(lambda: len(b.loads()) == 2)

    traffic = Traffic([a, b])
    await traffic.run(100)
    running = asyncio.create_task(traffic.run(300))
    await asyncio.sleep(0.2)
    redis_server.stop()  # SIGKILL: no persistence, the stream and snapshot are gone
    await eventually(
        lambda: not a.rep.status().connected and not b.rep.status().connected,
        what="both instances to notice",
    )
    # the traffic keeps writing into the outboxes while Redis is down
    await eventually(lambda: a.rep.status().outbox_depth > 0, what="records held in a's outbox")
    redis_server.start()  # same port, empty
    await running
    await traffic.run(50)

    def agreed() -> bool:
        return (
            requests(a) == requests(b) == set(traffic.live)
            and a.rep.status().outbox_depth == 0
            and b.rep.status().outbox_depth == 0
        )

    await eventually(agreed, timeout=15, what="both instances to hold every live request")
    await eventually(lambda: a.loads() == b.loads())
    for node in (a, b):
        st = node.rep.status()
        assert st.connected
        assert st.dropped == 0
        assert st.gaps == 0
        node.service.tracker(KEY).assert_consistent()
    # the loss was noticed: the publishers re-sent what Redis forgot
    assert a.rep.status().resent > 0 and b.rep.status().resent > 0


async def test_lost_stream_is_detected_read_again_and_snapshotted(
    cluster: Cluster, redis_url: str
) -> None:
    """The stream and snapshot vanish (Redis lost its data) while B is cut off: on reconnecting
    B reads the new stream from its start, A re-sends what it had recently published, and a
    fresh snapshot is written without waiting for the interval."""
    port = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["port"]
    proxy = TcpProxy(port)
    await proxy.start()
    try:
        a = await cluster.node()
        b = await cluster.node(redis_url=proxy.url())
        register(a.service, KEY, 1, 4, 0, 1)
        register(a.service, KEY, 2, 4, 0, 1)
        await eventually(lambda: len(b.loads()) == 2)
        traffic = Traffic([a, b])
        for _ in range(20):
            traffic.step()
        await eventually(lambda: requests(a) == requests(b) == set(traffic.live))
        assert await a.rep.write_snapshot()

        proxy.cut()
        await eventually(lambda: not b.rep.status().connected)
        keys = NamespaceKeys.of(cluster.namespace)
        client = redis.Redis.from_url(redis_url)
        client.delete(keys.events, keys.snapshot)
        proxy.restore()
        await eventually(lambda: b.rep.status().resets == 1, what="b to notice the reset")
        assert b.rep.status().stream_position == "0-0"

        for _ in range(10):
            traffic.step()
        await eventually(lambda: requests(a) == requests(b) == set(traffic.live))
        assert a.rep.status().resent > 0
        assert b.rep.status().gaps == 0
        # someone wrote a new snapshot right away (the interval is an hour in these tests)
        await eventually(lambda: client.hget(keys.snapshot, "id") is not None, timeout=5)
        client.close()
    finally:
        await proxy.close()


async def test_stream_recreated_by_a_peer_is_detected_by_the_own_last_entry(
    cluster: Cluster, redis_url: str
) -> None:
    """Redis loses the stream while B is cut off, and A's next append recreates it: its ids are
    newer than B's position, so only B's own last entry being gone tells B that this is not the
    stream it was reading. B reads it from its start and asks for a snapshot."""
    async with b_behind_a_proxy(cluster, redis_url) as (a, b, proxy, client):
        keys = NamespaceKeys.of(cluster.namespace)
        register(a.service, KEY, 1, 4, 0, 1)
        register(a.service, KEY, 2, 4, 0, 1)
        await eventually(lambda: len(b.loads()) == 2)
        traffic = Traffic([a, b])
        for _ in range(20):
            traffic.step()
        await eventually(lambda: requests(a) == requests(b) == set(traffic.live))

        proxy.cut()
        await eventually(lambda: not b.rep.status().connected)
        client.delete(keys.events, keys.snapshot)
        a.add("after-the-loss", hashes=[9])
        traffic.live["after-the-loss"] = a
        await eventually(lambda: a.rep.status().outbox_depth == 0 and client.exists(keys.events))
        proxy.restore()
        await eventually(lambda: b.rep.status().resets == 1, what="b to notice the reset")
        await eventually(lambda: requests(a) == requests(b) == set(traffic.live))
        assert b.rep.status().gaps == 0
        await eventually(lambda: client.hget(keys.snapshot, "id") is not None, timeout=5)
        await eventually(lambda: not client.exists(keys.reset), timeout=5)


async def test_an_entry_of_another_instance_at_the_own_last_id_is_not_taken_for_the_own(
    cluster: Cluster, redis_url: str
) -> None:
    """After a failover the new primary's stream can hold, at the very id of B's last entry,
    an entry of another instance (ids are milliseconds, and two primaries hand out the same
    ones). B must see that the entry is not its own and re-send its recent records."""
    async with b_behind_a_proxy(cluster, redis_url) as (a, b, proxy, client):
        keys = NamespaceKeys.of(cluster.namespace)
        register(a.service, KEY, 1, 4, 0, 1)
        await eventually(lambda: len(b.loads()) == 1)
        b.add("b-before", hashes=[7])
        await eventually(lambda: b.rep.status().outbox_depth == 0 and "b-before" in requests(a))
        own = b.rep.outbox.last_appended
        (_, foreign), *_ = client.xrange(keys.events, count=1)  # a's record, not b's

        proxy.cut()
        await eventually(lambda: not b.rep.status().connected)
        client.delete(keys.events)
        client.xadd(keys.events, foreign, id=own)  # the failed-over stream: another's entry
        proxy.restore()
        b.add("b-after", hashes=[8])
        await eventually(lambda: b.rep.status().outbox_depth == 0)
        assert b.rep.status().resent >= 1  # it knew the entry at its id was not its own
        entries = client.xrange(keys.events)
        assert [e for _, e in entries].count(foreign) == 1
        assert len(entries) >= 3  # the foreign entry, b-before re-sent, b-after
        await eventually(lambda: requests(a) == requests(b) == {"b-before", "b-after"})
        assert a.rep.status().gaps == 0


@pytest.mark.parametrize("first", ["freeing", "adding"])
async def test_a_free_re_sent_before_its_add_after_redis_lost_its_data_still_frees(
    cluster: Cluster, redis_url: str, first: str
) -> None:
    """B adds R and A frees it while C's reader is cut off; Redis loses its data, and the
    publishers re-send their recent records as each next appends: the rebuilt stream may hold
    A's free before B's add. C re-reads it from its start and must end without R, as A and B
    do (a peer's free of an id not active here is kept as a tombstone for its add)."""
    async with b_behind_a_proxy(cluster, redis_url) as (a, c, proxy, client):
        b = await cluster.node()
        for node in (a, b, c):  # as an instance sharing Redis runs (``main``)
            node.service.replica.use_early_calls(10_000, 600 * NS_PER_S, 1 << 20)
        register(a.service, KEY, 1, 4, 0, 2)
        await eventually(lambda: len(b.loads()) == len(c.loads()) == 2, what="the topology")
        b.add("warm", hashes=[1])
        await eventually(lambda: all("warm" in requests(n) for n in (a, b, c)))

        proxy.cut()
        await eventually(lambda: not c.rep.status().connected, what="c cut off")
        b.add("R", worker_id=1, dp_rank=1, hashes=[11, 12, 13])
        await eventually(lambda: "R" in requests(a), what="a to read b's add")
        free(a.service, KEY, "R")  # a holds R: a plain free, no tombstone
        await eventually(lambda: "R" not in requests(b), what="b to read a's free")
        await eventually(lambda: a.rep.status().outbox_depth == 0)

        keys = NamespaceKeys.of(cluster.namespace)
        client.delete(keys.events, keys.snapshot)  # Redis restarted empty
        order = [(a, "after-a", 3), (b, "after-b", 4)]
        if first == "adding":
            order.reverse()
        for node, rid, h in order:  # each publisher re-sends when it next appends
            node.add(rid, hashes=[h])
            await eventually(lambda node=node: node.rep.status().resent > 0, what=f"{rid} sent")

        proxy.restore()
        await eventually(lambda: c.rep.status().resets >= 1, what="c to notice the reset")
        live = {"warm", "after-a", "after-b"}
        await eventually(
            lambda: requests(a) == requests(b) == requests(c) == live,
            timeout=10,
            what="every instance to hold the live requests only",
        )
        assert c.rep.status().gaps == 0
        early = c.service.replica.early
        assert early is not None
        assert early.counters.out_of_order == (1 if first == "freeing" else 0)
        assert early.counters.tombstones_applied == (1 if first == "freeing" else 0)
        c.service.tracker(KEY).assert_consistent()
