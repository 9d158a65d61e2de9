"""The stream's bounds (``stream_max_entries``, ``stream_retention_seconds``) trim only what the
newest snapshot covers, and an entry trimmed by them is not taken for data Redis lost.

Instances on one real Redis (``tests/replication/helpers.py``), each test in a namespace of its
own; the bound is small so that Redis trims (``~`` trims whole nodes of 100 entries).
"""

from __future__ import annotations

import pytest
import redis

from kv_slot_tracker.replication.redis.stream import NamespaceKeys
from tests.calls import register
from tests.replication.helpers import KEY, Cluster, eventually, proxied

pytestmark = pytest.mark.redis

BOUND = 150


def active(node) -> int:  # type: ignore[no-untyped-def]
    return sum(r["active_requests"] for r in node.loads())


async def test_a_starting_instance_finds_every_entry_after_the_snapshot(
    cluster: Cluster, redis_url: str
) -> None:
    """A snapshot, then many more records than the bound: the entries after the snapshot are
    what a starting instance reads after loading it, so none of them may be trimmed before a
    newer snapshot covers them. The new instance is ready at once, with every request."""
    a = await cluster.node(stream_max_entries=BOUND)
    register(a.service, KEY, 1, 4, 0, 1)
    a.add("first")
    await eventually(lambda: a.rep.outbox.pending() == 0)
    assert await a.rep.write_snapshot()
    events = NamespaceKeys.of(cluster.namespace).events
    client = redis.Redis.from_url(redis_url)
    try:
        for i in range(4 * BOUND):
            a.add(f"r{i}")
            if i % 25 == 24:  # traffic the bound is sized for: snapshots keep up with it
                await eventually(lambda: a.rep.outbox.pending() == 0)
                if client.xlen(events) * 4 >= 3 * BOUND:  # a snapshot was asked for
                    await eventually(lambda: a.rep.status().snapshot_stream_id
                                     == a.rep.outbox.last_appended)  # fmt: skip
    finally:
        client.close()
    await eventually(lambda: a.rep.outbox.pending() == 0, what="a's outbox to drain")
    assert a.rep.status().snapshots_written >= 2
    c = await cluster.node(stream_max_entries=BOUND)
    assert c.rep.ready(), c.rep.status().not_ready_reason
    assert active(c) == active(a) == 4 * BOUND + 1
    assert c.rep.status().gaps == 0


async def test_the_bound_holds_once_snapshots_cover_the_entries(
    cluster: Cluster, redis_url: str
) -> None:
    """At its bound the stream asks for a snapshot (any instance able to write one does), and
    the next appends trim what it covers: the stream stays near its bound."""
    a = await cluster.node(stream_max_entries=BOUND)
    register(a.service, KEY, 1, 4, 0, 1)
    events = NamespaceKeys.of(cluster.namespace).events
    client = redis.Redis.from_url(redis_url)
    try:
        for i in range(10 * BOUND):
            a.add(f"r{i}")
            if i % 50 == 49:
                await eventually(lambda: a.rep.outbox.pending() == 0)
        await eventually(lambda: a.rep.outbox.pending() == 0)
        assert a.rep.status().snapshots_written >= 1
        # the bound holds whatever happens (trimming keeps whole nodes of 100 entries)
        assert client.xlen(events) <= BOUND + 100
        assert a.rep.status().resets == 0 and a.rep.status().resent == 0
    finally:
        client.close()


async def test_an_own_entry_trimmed_by_the_bound_is_not_taken_for_lost_data(
    cluster: Cluster, redis_url: str
) -> None:
    """A's last entry is trimmed while a peer appends (a snapshot covers it): A's next append
    must go on as usual, not re-send its records, set the reset marker and ask for urgent
    snapshots as when Redis lost data.

    Snapshots are no sign either way: the stream is still near its bound, so appends (A's
    included) keep asking for one that covers them, and one asked for during the loop may be
    written after it. What tells the lost-data path is that it re-sends A's recent records
    (the simulated wall clock stands still, so "from-a" is always within the re-send window)
    and counts a reset."""
    a = await cluster.node(stream_max_entries=BOUND)
    b = await cluster.node(stream_max_entries=BOUND)
    register(a.service, KEY, 1, 4, 0, 1)
    a.add("from-a")
    await eventually(lambda: a.rep.outbox.pending() == 0)
    own = a.rep.outbox.last_appended
    await eventually(lambda: active(b) == 1, what="b to read a's add")
    keys = NamespaceKeys.of(cluster.namespace)
    client = redis.Redis.from_url(redis_url)
    try:
        for i in range(4 * BOUND):
            b.add(f"b{i}")
            if i % 50 == 49:
                await eventually(lambda: b.rep.outbox.pending() == 0)
                if not client.xrange(keys.events, own, own):
                    break
        await eventually(lambda: b.rep.outbox.pending() == 0)
        assert not client.xrange(keys.events, own, own), "a's entry was not trimmed"
        duplicates = b.rep.status().duplicates
        a.add("again")
        await eventually(lambda: a.rep.outbox.pending() == 0)
        await eventually(lambda: active(b) == active(a), what="b to read a's second add")
        st = a.rep.status()
        assert st.resent == 0, st
        assert not client.exists(keys.reset)
        assert st.resets == b.rep.status().resets == 0
        assert b.rep.status().duplicates == duplicates  # "from-a" was not appended again
    finally:
        client.close()


async def test_a_reader_whose_position_was_trimmed_reads_on_without_a_reset(
    cluster: Cluster, redis_url: str
) -> None:
    """B is cut off while A appends past the bound and snapshots cover it: B's position is
    trimmed away. Reconnecting, B must not take that for a stream Redis lost (no reset, no
    re-reading from the start): it loads the snapshot that covers the gap and reads on."""
    port = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["port"]
    async with proxied(f"redis://127.0.0.1:{port}/0") as proxy:
        a = await cluster.node(stream_max_entries=BOUND)
        b = await cluster.node(stream_max_entries=BOUND, redis_url=proxy.url())
        register(a.service, KEY, 1, 4, 0, 1)
        a.add("first")
        await eventually(lambda: active(b) == 1, what="b to read the first add")
        position = b.rep.reader.position
        proxy.cut()
        await eventually(lambda: not b.rep.status().connected)
        events = NamespaceKeys.of(cluster.namespace).events
        client = redis.Redis.from_url(redis_url)
        try:
            for i in range(10 * BOUND):
                a.add(f"r{i}")
                if i % 50 == 49:
                    await eventually(lambda: a.rep.outbox.pending() == 0)
            await eventually(lambda: a.rep.outbox.pending() == 0)
            assert a.rep.status().snapshots_written >= 1
            assert not client.xrange(events, position, position), "b's position is still there"
        finally:
            client.close()
        assert await a.rep.write_snapshot()  # one that covers everything, for b's gap
        proxy.restore()
        await eventually(lambda: active(b) == active(a), what="b to catch up")
        st = b.rep.status()
        assert st.resets == 0 and st.connected, st
        assert b.rep.ready()


async def test_a_snapshot_id_that_is_not_an_id_does_not_stop_appends(
    cluster: Cluster, redis_url: str
) -> None:
    """Whoever can write to Redis can write the snapshot's ``id``: the append script reads it
    to bound trimming, and must take garbage there for no snapshot, not fail every append."""
    a = await cluster.node(stream_max_entries=BOUND)
    keys = NamespaceKeys.of(cluster.namespace)
    client = redis.Redis.from_url(redis_url)
    try:
        client.hset(keys.snapshot, mapping={"id": "not-an-id", "at": "1"})
        register(a.service, KEY, 1, 4, 0, 1)
        for i in range(3):
            a.add(f"r{i}")
        await eventually(lambda: a.rep.outbox.pending() == 0, what="the appends")
        assert client.xlen(keys.events) == 4
        assert a.rep.status().connected
    finally:
        client.close()
