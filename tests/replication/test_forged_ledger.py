"""Records forged into the stream by a party with write access to Redis that aim at the ledger
of applied sequence numbers ((origin, incarnation) -> last seq): none of them may make a peer
drop a legitimate instance's records, and each is counted, shown as degraded and logged.

Whole apps in this process (``tests/replication/apps.py``) on a real Redis; the forged entries
are written with ``XADD`` in the service's own encoding (stream formats 1 and 2)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis

from kv_slot_tracker.replication.metrics import ANOMALIES
from kv_slot_tracker.replication.records import RECORD_FIELD, encode_entry, encode_entry_1
from kv_slot_tracker.replication.redis.stream import NamespaceKeys
from kv_slot_tracker.settings import Settings
from tests.replication.apps import App, running_apps, until
from tests.support.records import format_2

pytestmark = pytest.mark.redis

JUMP_REASON = f"seq_jump: {ANOMALIES['seq_jump']}, in the last 5 minutes"


def settings(redis_url: str, namespace: str) -> Settings:
    return Settings(redis_url=redis_url, namespace=namespace, snapshot_interval_seconds=3600)


def upsert(wid: int) -> dict[str, Any]:
    """A format-1 topology record (as the versions before format 2 wrote it) for worker
    ``wid`` of model m."""
    return {"model_name": "m", "routing_group": "default", "block_size": 16,
            "topology": {"op": "upsert", "worker_id": wid, "dp_start": 0, "dp_size": 1}}  # fmt: skip


def forge(
    client: redis.Redis,
    namespace: str,
    origin: int,
    incarnation: int,
    seq: int,
    fmt: int,
    wid: int = 666,
) -> str:
    """XADD one forged record (an upsert of worker ``wid``) claiming ``(origin, incarnation,
    seq)``."""
    record = format_2(upsert(wid))
    encode = encode_entry if fmt == 2 else encode_entry_1
    payload = encode(origin, incarnation, seq, 1, record)
    key = NamespaceKeys.of(namespace).events
    return client.xadd(key, {RECORD_FIELD: payload}).decode()


async def register(app: App, wid: int) -> None:
    body = {"model_name": "m", "worker_id": wid, "block_size": 16, "dp_start": 0, "dp_size": 1}
    assert (await app.post("/register", body)).status_code == 201


async def worker_ids(app: App) -> list[int]:
    return sorted(w["worker_id"] for w in (await app.client.get("/workers")).json())


@pytest.mark.parametrize("fmt", [1, 2])
async def test_a_forged_sequence_jump_does_not_silence_the_instance_it_claims(
    redis_url: str, namespace: str, fmt: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    client = redis.Redis.from_url(redis_url)
    async with running_apps(*[settings(redis_url, namespace)] * 2) as (a, b):
        await register(a, 1)
        await until(lambda: b.app.state.service.trackers, what="worker 1 on the peer")
        key = a.replication.me.own_key
        before = b.replication.reader.applied_seq(key)
        assert before >= 1
        forged = 10**9 + before
        last = forge(client, namespace, key[0], key[1], forged, fmt)
        await until(lambda: b.replication.status().stream_position == last,
                    what="the peer past the forged record")  # fmt: skip
        # not applied, and the ledger did not move
        assert b.replication.reader.applied_seq(key) == before
        assert 666 not in await worker_ids(b)

        # the legitimate instance's later records are still applied on the peer
        await register(a, 2)
        await register(a, 3)

        async def both() -> bool:
            return await worker_ids(b) == [1, 2, 3]

        await until(both, what="workers 2 and 3 on the peer")
        # the same encoding from an origin of its own, in sequence, is applied (the record
        # above was refused for its sequence number alone)
        last = forge(client, namespace, 4242, 1, 1, fmt, wid=667)
        await until(lambda: b.replication.status().stream_position == last,
                    what="the peer past the control record")  # fmt: skip
        assert await worker_ids(b) == [1, 2, 3, 667]
        assert b.replication.reader.applied_seq(key) == before + 2

        status = (await b.client.get("/replication")).json()
        assert status["records_rejected"]["seq_jump"] == 1
        assert status["degraded"] is True
        assert JUMP_REASON in status["degraded_reasons"]
        assert status["anomalies"]["seq_jump"] == 1
        assert (await b.client.get("/ready")).status_code == 200
        for metric in ("records_rejected", "anomalies"):
            sample = b.app.state.registry.get_sample_value(
                f"kv_slot_tracker_replication_{metric}_total", {"reason": "seq_jump"}
            )
            assert sample == 1, metric
        assert any("anomaly seq_jump" in r.getMessage() for r in caplog.records)

        # the ledger written into a snapshot is the true one
        assert await b.replication.write_snapshot() is True
        snapshot = await b.replication.snapshot_store.load_readable()
        assert snapshot is not None
        assert snapshot.seqs.get(key) == before + 2
    client.close()


class CountingLoads:
    """Counts the snapshot loads of one instance's reader (wraps its store's method)."""

    def __init__(self, app: App) -> None:
        self.store = app.replication.reader._store
        self.real = self.store.load_readable
        self.calls = 0
        self.store.load_readable = self.load

    async def load(self) -> Any:
        self.calls += 1
        return await self.real()


async def test_forged_new_origins_far_ahead_cost_no_snapshot_load_each_and_stop_nothing(
    redis_url: str, namespace: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    async with running_apps(*[settings(redis_url, namespace)] * 2) as (a, b):
        await register(a, 1)
        await until(lambda: b.app.state.service.trackers, what="worker 1 on the peer")
        loads = CountingLoads(b)
        for i in range(100):
            last = forge(client, namespace, 10_000 + i, 1, 2**62, 2)
        await register(a, 2)
        await until(lambda: b.replication.status().stream_position >= last,
                    what="the peer past the forged records")  # fmt: skip

        async def applied() -> bool:
            return await worker_ids(b) == [1, 2]

        await until(applied, what="worker 2 on the peer")
        assert loads.calls <= 1  # looked at once in case it covers them, not once a record
        status = b.replication.status()
        assert status.anomalies["seq_jump"] >= 99
        assert status.anomalies["seq_jump"] + loads.calls >= 100
        assert not any(10_000 <= k[0] < 10_100 for k in b.replication.reader.ledger_copy().highest)
        # snapshots go on
        written = status.snapshots_written
        assert await b.replication.write_snapshot() is True
        assert b.replication.status().snapshots_written == written + 1
    client.close()


async def test_the_ledger_keeps_at_most_max_origins_and_a_forgotten_origin_still_applies(
    redis_url: str, namespace: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    bounded = settings(redis_url, namespace).model_copy(update={"replication_max_origins": 50})
    async with running_apps(bounded, bounded) as (a, b):
        await register(a, 1)
        await until(lambda: b.app.state.service.trackers, what="worker 1 on the peer")
        pipe = client.pipeline(transaction=False)
        key = NamespaceKeys.of(namespace).events
        for i in range(500):
            payload = encode_entry(20_000 + i, 1, 1, 1, format_2(upsert(666)))
            pipe.xadd(key, {RECORD_FIELD: payload})
        last = pipe.execute()[-1].decode()
        await until(lambda: b.replication.status().stream_position == last,
                    what="the peer past the forged origins")  # fmt: skip
        ledger = b.replication.reader.ledger_copy()
        assert len(ledger.highest) <= 50
        assert len(ledger.seen_at) == len(ledger.highest)
        evicted = b.replication.status().anomalies["origins_evicted"]
        assert evicted >= 500 - 50

        # worker 1's origin was the longest silent and is forgotten; its next record still
        # applies (an origin met past its first record: counted, applied from there on)
        assert a.replication.me.own_key not in ledger.highest
        await register(a, 2)

        async def applied() -> bool:
            return await worker_ids(b) == [1, 2, 666]

        await until(applied, timeout=20, what="worker 2 on the peer")
        status = (await b.client.get("/replication")).json()
        assert status["anomalies"]["new_origin_gap"] == 1
        assert status["degraded"] is True

        assert await b.replication.write_snapshot() is True
        snapshot = await b.replication.snapshot_store.load_readable()
        assert snapshot is not None
        assert len(snapshot.seqs.highest) <= 50
    client.close()
