"""Records written straight into the stream by someone who is not an instance: each kind of bad
record is rejected (counted by reason, logged), the records behind it are applied, no route
answers 5xx, snapshots are still written and an instance started afterwards is healthy.

Whole apps in this process (``tests/replication/apps.py``) on a real Redis."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import redis

from kv_slot_tracker.replication.records import RECORD_FIELD
from kv_slot_tracker.replication.redis.stream import NamespaceKeys
from kv_slot_tracker.settings import Settings
from tests.replication.apps import App, running_apps, until

pytestmark = pytest.mark.redis

PEER = 4242  # an origin no instance has
ROUTES = ["/loads", "/workers", "/metrics", "/replication", "/ready", "/health",
          "/selection/workers", "/selection/loads", "/selection/dump", "/selection/ready"]  # fmt: skip


def settings(redis_url: str, namespace: str) -> Settings:
    return Settings(redis_url=redis_url, namespace=namespace, snapshot_interval_seconds=3600,
                    max_hashes_per_request=64)  # fmt: skip


def tracker_record(topology: Any = None, **envelope: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {"model_name": "m", "routing_group": "default", "block_size": 16,
                           "origin": PEER, "ts": 1}  # fmt: skip
    if topology is not None:
        rec["topology"] = topology
    rec.update(envelope)
    return rec


def upsert(wid: int, dp_size: int = 1, **extra: Any) -> dict[str, Any]:
    return tracker_record({"op": "upsert", "worker_id": wid, "dp_start": 0, "dp_size": dp_size},
                          **extra)  # fmt: skip


def add_event(rid: Any, hashes: list[int], rank: Any = 0) -> dict[str, Any]:
    return {"request_id": rid, "worker": {"worker_id": 9, "dp_rank": rank},
            "data": {"AddRequest": {"token_sequence": hashes, "track_prefill_tokens": True,
                                    "expected_output_tokens": None, "prefill_load_hint": None}},
            "router_id": PEER, "lora_name": None}  # fmt: skip


def spec(**fields: Any) -> dict[str, Any]:
    s: dict[str, Any] = {"worker_id": 77, "model_name": "m", "routing_group": "default",
                         "endpoint": "http://w77", "kv_events_endpoint": None,
                         "kv_events_endpoints": None, "replay_endpoint": None, "block_size": 16,
                         "data_parallel_start_rank": None, "data_parallel_size": None,
                         "max_num_batched_tokens": None, "total_kv_blocks": None,
                         "stable_routing_id": None, "is_eagle": None, "taints": [],
                         "topology_domains": None, "kv_transfer_domain": None,
                         "kv_transfer_enforcement": None, "kv_transfer_preferred_weight": None}  # fmt: skip
    s.update(fields)
    return s


def selection(change: dict[str, Any]) -> dict[str, Any]:
    return {"origin": PEER, "ts": 1, "selection": change}


# (reason, record): each bad in one way, each otherwise well formed
BAD: list[tuple[str, Any]] = [
    ("undecodable", b"\xc1 not msgpack"),
    ("undecodable", msgpack.packb({"origin": "x", "incarnation": 1, "seq": 1, "ts": 1})),
    ("envelope", upsert(1, model_name=7)),  # once answered 500 on every route that lists keys
    ("envelope", upsert(1, routing_group=None)),
    ("envelope", upsert(1, block_size="16")),
    ("envelope", tracker_record()),  # no topology, event or early call
    ("envelope", upsert(1, model_name="m" * 1025)),  # over HTTP a 422: at most 1,024
    ("topology", upsert(1, dp_size=200_000)),  # over HTTP a 400: at most 4,096 per worker
    ("topology", upsert(1, dp_size=0)),
    ("topology", upsert(1, block_size=0)),
    ("topology", tracker_record({"op": "upsert", "worker_id": -1, "dp_start": 0, "dp_size": 1})),
    ("topology", tracker_record({"op": "reconcile", "workers": [[1, 0, 4096]] * 5})),
    ("topology", tracker_record({"op": "reconcile", "workers": [[1, 0, 1], [1, 1, 1]]})),
    ("topology", tracker_record({"op": "drop_everything"})),
    ("topology", tracker_record("upsert")),
    ("event", tracker_record(event=add_event(5, [1, 2]))),
    ("event", tracker_record(event=add_event("r", [1, 2], rank="0"))),
    ("event", tracker_record(event=add_event("r", list(range(65))))),  # max_hashes_per_request
    ("event", tracker_record(event=add_event("r" * 1025, [1]))),
    ("early", tracker_record(early={"op": "explode", "request_id": "r"})),
    ("early", tracker_record(early={"op": "free", "request_id": 3})),
    ("early", tracker_record(early={"op": "free", "request_id": "r" * 1025})),
    ("selection", selection({"op": "put_worker", "spec": spec(model_name=3)})),
    ("selection", selection({"op": "put_worker", "spec": {"worker_id": 1}})),
    ("selection", selection({"op": "put_worker", "spec": spec(endpoint="e" * 4097)})),
    ("selection", selection({"op": "put_worker", "spec": spec(kv_transfer_enforcement="x")})),
    ("selection", selection({"op": "release", "id": "s" * 1025})),
    (
        "selection",
        selection(
            {
                "op": "book",
                "id": "s",
                "m": "m",
                "g": "default",
                "w": [77, 0],
                "bh": list(range(65)),
                "ch": None,
                "cp": False,
            }
        ),
    ),  # fmt: skip
    ("selection", selection({"op": "book", "id": "s"})),
    (
        "selection",
        selection(
            {
                "op": "book",
                "id": "s",
                "m": "m",
                "g": "default",
                "w": [1, 0],
                "bh": None,
                "ch": None,
                "cp": False,
                "s": 7,
            }
        ),
    ),  # session: a string
    (
        "selection",
        selection(
            {
                "op": "book",
                "id": "s",
                "m": "m",
                "g": "default",
                "w": [1, 0],
                "bh": None,
                "ch": None,
                "cp": False,
                "s": "s" * 4097,
            }
        ),
    ),
    ("selection", selection({"op": "teleport"})),
    ("conflict", upsert(2, block_size=32)),  # the tracker of m/default has block size 16
]


class Stream:
    def __init__(self, redis_url: str, namespace: str) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.key = NamespaceKeys.of(namespace).events
        self.seq = 0

    def put(self, rec: Any) -> str:
        if isinstance(rec, dict):
            self.seq += 1
            rec = msgpack.packb({**rec, "incarnation": 1, "seq": self.seq})
        return self.client.xadd(self.key, {RECORD_FIELD: rec}).decode()


async def no_5xx(app: App) -> None:
    for path in ROUTES:
        r = await app.client.get(path)
        assert r.status_code < 500, (path, r.status_code, r.text)


def expected_counts() -> dict[str, int]:
    counts = dict.fromkeys(
        ["undecodable", "seq_jump", "envelope", "topology", "event", "early", "selection",
         "conflict", "snapshot", "released"], 0
    )  # fmt: skip
    for reason, _ in BAD:
        counts[reason] += 1
    return counts


async def test_each_kind_of_bad_record_is_rejected_and_counted_and_nothing_breaks(
    redis_url: str, namespace: str
) -> None:
    stream = Stream(redis_url, namespace)
    async with running_apps(*[settings(redis_url, namespace)] * 2) as apps:
        a, b = apps
        body = {"model_name": "m", "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
        assert (await a.post("/register", body)).status_code == 201
        await until(lambda: b.app.state.service.trackers, what="the worker on the peer")
        for _, rec in BAD:
            stream.put(rec)
        # valid records behind the bad ones: a peer's worker, its request, a selection worker
        stream.put(upsert(9, dp_size=2))
        stream.put(tracker_record(event=add_event("peer-request", [1, 2, 3], rank=1)))
        last = stream.put(selection({"op": "put_worker", "spec": spec()}))

        for app in apps:
            await until(lambda app=app: app.replication.status().stream_position == last,
                        what=f"the reader past every record ({last})")  # fmt: skip
        expected = expected_counts()
        for app in apps:
            await no_5xx(app)
            status = (await app.client.get("/replication")).json()
            assert status["records_rejected"] == expected
            assert status["degraded"] is True
            assert "replica records rejected in the last 5 minutes" in status["degraded_reasons"]
            for reason, count in expected.items():
                sample = app.app.state.registry.get_sample_value(
                    "kv_slot_tracker_replication_records_rejected_total", {"reason": reason}
                )
                assert sample == count, reason
            workers = (await app.client.get("/workers")).json()
            assert sorted((w["worker_id"], w["dp_size"]) for w in workers) == [
                (1, 1),
                (9, 2),
                (77, 1),
            ]
            loads = {(r["worker_id"], r["dp_rank"]): r["active_requests"]
                     for r in (await app.client.get("/loads")).json()}  # fmt: skip
            assert loads == {(1, 0): 0, (9, 0): 0, (9, 1): 1, (77, 0): 0}
            sel = (await app.client.get("/selection/workers")).json()
            assert [w["worker_id"] for w in sel] == [77]
            assert app.app.state.service.trackers.keys() == {("m", "default")}

        snapshots = b.replication.status().snapshots_written
        assert await b.replication.write_snapshot() is True
        assert b.replication.status().snapshots_written == snapshots + 1

        # a bad record after the snapshot is replayed to an instance that starts now
        stream.put(upsert(3, model_name=3))
        last = stream.put(upsert(4))
        async with running_apps(settings(redis_url, namespace)) as (c,):
            await until(lambda: c.replication.status().stream_position == last,
                        what="the new instance past every record")  # fmt: skip
            assert (await c.client.get("/ready")).status_code == 200
            await no_5xx(c)
            workers = (await c.client.get("/workers")).json()
            assert sorted(w["worker_id"] for w in workers) == [1, 4, 9, 77]
            assert c.replication.status().records_rejected["envelope"] == 1
    stream.client.close()


def corrupt_snapshot(client: redis.Redis, namespace: str, change: Any) -> None:
    """Rewrite the stored snapshot's data with ``change`` applied to its first tracker."""
    key = NamespaceKeys.of(namespace).snapshot
    data = msgpack.unpackb(client.hget(key, "data"), raw=False)
    change(data["trackers"][0]["tracker"])
    client.hset(key, "data", msgpack.packb(data))


BAD_SNAPSHOTS = [
    # a prompt longer than ``/add`` takes (max_hashes_per_request = 64)
    ("prompt", lambda t: t["slots"][0]["requests"][0].__setitem__(1, list(range(1, 101)))),
    # a request id longer than MAX_ID_LENGTH
    ("request id", lambda t: t["slots"][0]["requests"][0].__setitem__(0, "r" * 1025)),
    # a worker range beyond the rank limit
    ("range", lambda t: t.__setitem__("ranges", [[1, 0, 5000]])),
    # a hash that is not a u64
    ("hash", lambda t: t["slots"][0]["requests"][0].__setitem__(1, [1, -5])),
]


@pytest.mark.parametrize("what,change", BAD_SNAPSHOTS, ids=[b[0] for b in BAD_SNAPSHOTS])
async def test_a_bad_snapshot_is_rejected_counted_and_the_stream_replayed(
    redis_url: str, namespace: str, what: str, change: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A snapshot in Redis is input like a record: one that breaks the record rules is not
    restored; the instance that boots from it counts it (reason ``snapshot``), logs it and
    replays the stream instead, ending with the state the stream describes."""
    client = redis.Redis.from_url(redis_url)
    async with running_apps(settings(redis_url, namespace)) as (a,):
        body = {"model_name": "m", "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
        assert (await a.post("/register", body)).status_code == 201
        for rid, hashes in (("r1", [1, 2, 3]), ("r2", [1, 2, 4, 5])):
            add = {"model_name": "m", "request_id": rid, "worker_id": 1, "dp_rank": 0,
                   "sequence_hashes": hashes}  # fmt: skip
            assert (await a.post("/add", add)).status_code == 201
        await a.replication.settled(10)
        assert await a.replication.write_snapshot() is True
        want = (await a.client.get("/loads")).json()
    corrupt_snapshot(client, namespace, change)
    async with running_apps(settings(redis_url, namespace)) as (c,):

        async def replayed() -> bool:
            return (await c.client.get("/loads")).json() == want

        await until(replayed, what="the stream's state, replayed")
        assert (await c.client.get("/ready")).status_code == 200
        status = (await c.client.get("/replication")).json()
        assert status["records_rejected"]["snapshot"] == 1, what
        sample = c.app.state.registry.get_sample_value(
            "kv_slot_tracker_replication_records_rejected_total", {"reason": "snapshot"}
        )
        assert sample == 1
        assert "rejected a replica record (snapshot)" in caplog.text
    client.close()
