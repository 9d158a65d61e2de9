"""The write path: bounded outbox, batching, retries, flush at stop."""

from __future__ import annotations

import asyncio

import pytest
import redis

from kv_slot_tracker.replication.records import RECORD_FIELD
from kv_slot_tracker.replication.redis.stream import NamespaceKeys, parse_id
from tests.calls import register, upsert
from tests.replication.helpers import KEY, Cluster, RedisServer, eventually
from tests.support.records import entry_view
from tests.support.tracker import request_ranks

pytestmark = pytest.mark.redis


def stream_records(url: str, namespace: str) -> list[dict]:
    client = redis.Redis.from_url(url)
    try:
        entries = client.xrange(NamespaceKeys.of(namespace).events)
    finally:
        client.close()
    return [entry_view(fields[RECORD_FIELD]) for _, fields in entries]


async def test_redis_down_at_start_buffers_drops_newest_then_publishes(
    cluster: Cluster, redis_server: RedisServer
) -> None:
    cluster.redis_url = redis_server.url  # nothing listens there yet
    a = await cluster.node(outbox_capacity=5)  # start() gives up waiting, does not raise
    assert not a.rep.ready()
    st = a.rep.status()
    assert st.connected is False
    assert "Redis" in st.not_ready_reason

    # writes are accepted locally, never blocked
    register(a.service, KEY, 1, 4, 0, 1)
    for i in range(6):
        a.add(f"r{i}", hashes=[i])
    assert len(request_ranks(a.service.tracker(KEY))) == 6
    st = a.rep.status()
    assert st.outbox_depth == 5
    assert st.dropped == 2  # the two newest
    assert st.degraded
    assert "records dropped in the last minute" in st.degraded_reasons
    assert a.registry.get_sample_value("kv_slot_tracker_replication_dropped_total") == 2
    assert a.registry.get_sample_value("kv_slot_tracker_replication_outbox_depth") == 5

    redis_server.start()
    await eventually(a.rep.ready, timeout=10, what="bootstrap once Redis is up")
    await eventually(lambda: a.rep.status().outbox_depth == 0, what="the outbox to drain")
    records = stream_records(redis_server.url, cluster.namespace)
    assert [r["seq"] for r in records] == [1, 2, 3, 4, 5]
    assert {r["incarnation"] for r in records} == {a.rep.incarnation}
    assert {r["origin"] for r in records} == {a.rep.instance_id}
    assert records[0]["topology"]["op"] == "upsert"
    assert [r["event"]["request_id"] for r in records[1:]] == ["r0", "r1", "r2", "r3"]
    assert a.rep.status().published == 5
    assert a.rep.status().connected
    # the instance adopted the shared state: what the cluster got, not the dropped adds
    assert set(request_ranks(a.service.tracker(KEY))) == {"r0", "r1", "r2", "r3"}
    a.service.tracker(KEY).assert_consistent()


async def test_the_outbox_is_bounded_in_bytes_too_newest_dropped(
    cluster: Cluster, redis_server: RedisServer
) -> None:
    """Prompts make the records: beyond ``outbox_max_bytes`` (an entry's bytes and 64) the
    newest record is dropped and counted, as beyond ``outbox_capacity``."""
    cluster.redis_url = redis_server.url  # nothing listens there yet: records queue up
    a = await cluster.node(outbox_capacity=100, outbox_max_bytes=5500)
    register(a.service, KEY, 1, 4, 0, 1)  # a topology record: 205 bytes
    for i in range(6):  # hashes below 0 travel as u64 from 2^63: 9 bytes each
        a.add(f"r{i}", hashes=[-1 - i * 1000 - j for j in range(100)])  # 1,233 bytes each
    st = a.rep.status()
    assert (st.outbox_depth, st.dropped) == (5, 2)  # 205 + 4 * 1,233 = 5,137; a fifth is over
    assert 5500 - 1233 < a.rep.outbox.queued_bytes <= 5500
    assert a.registry.get_sample_value("kv_slot_tracker_replication_dropped_total") == 2
    redis_server.start()
    await eventually(a.rep.ready, timeout=10, what="bootstrap once Redis is up")
    await eventually(lambda: a.rep.status().outbox_depth == 0, what="the outbox to drain")
    records = stream_records(redis_server.url, cluster.namespace)
    assert [r["event"]["request_id"] for r in records[1:]] == ["r0", "r1", "r2", "r3"]
    # drained: the bytes are given back, so records are taken again
    a.add("r9", hashes=list(range(100)))
    assert a.rep.status().dropped == 2


async def test_batches_are_capped_and_keep_order(cluster: Cluster) -> None:
    a = await cluster.node(replication_batch_events=256)
    calls: list[int] = []
    append = a.rep.outbox.append

    async def counting_append(keys, args):
        calls.append(len(args) - 4)  # last own id, trim horizon, max entries, last digest
        return await append(keys=keys, args=args)

    a.rep.outbox.append = counting_append
    register(a.service, KEY, 1, 4, 0, 1)
    for i in range(600):
        upsert(a.service, KEY, 1, 4, 0, 2 + i % 2)
    await eventually(lambda: a.rep.status().outbox_depth == 0)
    assert calls == [256, 256, 89]
    records = stream_records(cluster.redis_url, cluster.namespace)
    assert [r["seq"] for r in records] == list(range(1, 602))
    assert [r["topology"]["dp_size"] for r in records[1:]] == [2 + i % 2 for i in range(600)]


async def test_stop_flushes_the_outbox(cluster: Cluster) -> None:
    a = await cluster.node()
    register(a.service, KEY, 1, 4, 0, 1)
    for i in range(100):
        a.add(f"r{i}")
    assert a.rep.status().outbox_depth == 101
    await a.rep.stop()
    assert len(stream_records(cluster.redis_url, cluster.namespace)) == 101
    a.add("after-stop")  # still answered locally; the record is dropped quietly
    assert a.rep.status().dropped == 1


async def test_stop_with_redis_down_returns_promptly(
    cluster: Cluster, redis_server: RedisServer
) -> None:
    cluster.redis_url = redis_server.url
    a = await cluster.node()
    register(a.service, KEY, 1, 4, 0, 1)
    await asyncio.wait_for(a.rep.stop(), 30)  # returns, publishing nothing (a hang guard)
    assert not a.rep.status().connected


async def test_stream_is_bounded_by_entries_as_well_as_age(cluster: Cluster) -> None:
    """``stream_max_entries``: every append trims the stream to at most about that many
    entries (whole nodes of up to 100 entries); below that, to what the newest snapshot covers
    (``test_stream_bounds.py``)."""
    a = await cluster.node(stream_max_entries=150, replication_batch_events=50)
    register(a.service, KEY, 1, 4, 0, 1)
    for i in range(1200):
        upsert(a.service, KEY, 1, 4, 0, 2 + i % 2)
    await eventually(lambda: a.rep.status().outbox_depth == 0)
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        length = client.xlen(NamespaceKeys.of(cluster.namespace).events)
    finally:
        client.close()
    assert 0 < length < 150 + 100, length
    records = stream_records(cluster.redis_url, cluster.namespace)
    assert records[-1]["seq"] == 1201  # the newest are kept
    assert [r["seq"] for r in records] == list(range(1202 - len(records), 1202))


async def test_stream_is_bounded_by_bytes(cluster: Cluster) -> None:
    """``stream_max_bytes``: the entries kept are lowered to what fits the budget at the mean
    record size, so Redis's own count of the stream's memory stays within it (plus the
    approximate trim's slack of up to one node of 100 entries)."""
    budget = 64 * 1024
    a = await cluster.node(stream_max_entries=0, stream_max_bytes=budget,
                           replication_batch_events=50)  # fmt: skip
    register(a.service, KEY, 1, 4, 0, 1)
    for i in range(3000):
        upsert(a.service, KEY, 1, 4, 0, 2 + i % 2)
    await eventually(lambda: a.rep.status().outbox_depth == 0)
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        keys = NamespaceKeys.of(cluster.namespace)
        length, used = client.xlen(keys.events), client.memory_usage(keys.events, samples=0)
        first = client.xrange(keys.events, count=1)[0][0]
        snapshot = client.hget(keys.snapshot, "id")
    finally:
        client.close()
    per_entry = used / length
    assert length < 3001 and used <= budget + 100 * per_entry, (length, used)
    if used < budget / 2:
        # trimmed far below the budget: only entries a snapshot covers may go that way (the
        # publisher asks for one at three quarters of the bound, and it may land meanwhile)
        assert snapshot is not None and parse_id(first) <= parse_id(snapshot), (length, used)
    records = stream_records(cluster.redis_url, cluster.namespace)
    assert records[-1]["seq"] == 3001  # the newest are kept
