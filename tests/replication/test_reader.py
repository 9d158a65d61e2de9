"""The read path: entries written straight into the stream, then what the instance makes of them."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
import redis

from kv_slot_tracker.core.events import ActiveSequenceEvent, AddRequest, event_to_wire
from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.replication.records import RECORD_FIELD
from kv_slot_tracker.replication.redis.stream import NamespaceKeys
from tests.replication.helpers import GROUP, KEY, MODEL, WALL_START_NS, Cluster, eventually
from tests.support.tracker import active_request_counts, request_ranks

pytestmark = pytest.mark.redis

PEER = 7


def record(origin: int, incarnation: int, seq: int, **body) -> dict:
    return {
        "model_name": MODEL,
        "routing_group": GROUP,
        "block_size": 4,
        "origin": origin,
        "ts": WALL_START_NS,
        **body,
        "incarnation": incarnation,
        "seq": seq,
    }


def upsert(worker_id: int = 1) -> dict:
    return {"topology": {"op": "upsert", "worker_id": worker_id, "dp_start": 0, "dp_size": 1}}


def add(rid: str, origin: int, hashes: list[int] | None = None) -> dict:
    ev = ActiveSequenceEvent(
        rid, WorkerWithDpRank(1, 0), AddRequest(hashes or [1, 2], True, None, None), origin
    )
    return {"event": msgspec.to_builtins(event_to_wire(ev))}


class Stream:
    def __init__(self, cluster: Cluster) -> None:
        self.client = redis.Redis.from_url(cluster.redis_url)
        self.key = NamespaceKeys.of(cluster.namespace).events

    def put(self, rec: dict) -> str:
        return self.client.xadd(self.key, {RECORD_FIELD: msgpack.packb(rec)}).decode()

    def put_raw(self, payload: bytes) -> str:
        return self.client.xadd(self.key, {RECORD_FIELD: payload}).decode()

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def stream(cluster: Cluster):
    s = Stream(cluster)
    yield s
    s.close()


async def test_applies_peers_skips_duplicates_and_own_records(cluster: Cluster, stream: Stream):
    b = await cluster.node()
    own, inc = b.rep.instance_id, b.rep.incarnation
    stream.put(record(PEER, 1, 1, **upsert()))
    stream.put(record(PEER, 1, 2, **add("r1", PEER)))
    stream.put(record(PEER, 1, 2, **add("r1", PEER)))  # a retried append
    stream.put(record(PEER, 1, 1, **upsert()))  # older still
    stream.put(record(own, inc, 1, **add("mine", own)))  # our own, already applied locally
    # our instance id, but a previous life (restart with a fixed instance id): applied
    stream.put(record(own, 99, 1, **add("previous-life", own, [5])))
    stream.put_raw(b"\xc1 not msgpack")
    last = stream.put(record(PEER, 1, 3, **add("r3", PEER, [1, 9])))

    await eventually(lambda: b.rep.status().stream_position == last, what="reader to catch up")
    t = b.service.tracker(KEY)
    assert set(request_ranks(t)) == {"r1", "previous-life", "r3"}
    assert t.active_blocks() == {(1, 0): 4}  # [1,2], [5], [1,9] share hash 1
    st = b.rep.status()
    assert st.applied == 4
    assert st.duplicates == 2
    assert st.gaps == 0
    assert b.rep.counters.own_skipped == 1
    assert b.rep.counters.malformed == 1
    assert st.last_applied_lag_ms is not None
    registry = b.registry
    assert registry.get_sample_value("kv_slot_tracker_replication_applied_total") == 4
    assert registry.get_sample_value("kv_slot_tracker_replication_duplicates_total") == 2
    assert registry.get_sample_value("kv_slot_tracker_replication_lag_seconds_count") == 4


async def test_each_read_reply_is_applied_as_one_batch(cluster: Cluster, stream: Stream):
    stream.put(record(PEER, 1, 1, **upsert()))
    for i in range(2, 7):
        stream.put(record(PEER, 1, i, **add(f"r{i}", PEER, [i])))
    b = await cluster.node(start=False)
    batches: list[int] = []
    apply_remote = b.service.apply_remote

    def spy(records):
        batches.append(len(records))
        return apply_remote(records)

    b.service.apply_remote = spy
    await b.rep.start(b.service)
    await b.rep.settled(10)
    assert b.rep.ready()
    assert batches == [6]  # one reply, one apply (one flush of effects per tracker)
    assert active_request_counts(b.service.tracker(KEY)) == {(1, 0): 5}


async def test_missing_records_without_a_snapshot_count_a_gap(cluster: Cluster, stream: Stream):
    b = await cluster.node()
    stream.put(record(PEER, 1, 1, **upsert()))
    stream.put(record(PEER, 1, 2, **add("r2", PEER)))
    last = stream.put(record(PEER, 1, 5, **add("r5", PEER, [3])))  # 3 and 4 never arrive
    await eventually(lambda: b.rep.status().stream_position == last)
    st = b.rep.status()
    assert st.gaps == 1
    assert set(request_ranks(b.service.tracker(KEY))) == {"r2", "r5"}
    # numbering goes on from there: the next record is not another gap
    last = stream.put(record(PEER, 1, 6, **add("r6", PEER, [4])))
    await eventually(lambda: b.rep.status().stream_position == last)
    assert b.rep.status().gaps == 1
    assert "r6" in request_ranks(b.service.tracker(KEY))


async def test_records_for_other_keys_or_block_sizes_are_dropped(cluster: Cluster, stream):
    b = await cluster.node()
    stream.put(record(PEER, 1, 1, **upsert()))
    other = record(PEER, 1, 2, **add("x", PEER))
    other["routing_group"] = "elsewhere"
    stream.put(other)
    wrong_size = record(PEER, 1, 3, **add("y", PEER))
    wrong_size["block_size"] = 8
    last = stream.put(wrong_size)
    await eventually(lambda: b.rep.status().stream_position == last)
    assert list(b.service.trackers) == [KEY]
    assert request_ranks(b.service.tracker(KEY)) == {}
