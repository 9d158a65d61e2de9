"""A snapshot, the snapshot lease and the stream's ids forged by a party with write access to
Redis: a snapshot whose stream id is not one or lies in the future is ignored (counted, shown,
the stream read instead), a lease held past its round is cut back and shown, and a stream whose
ids are exhausted is named as such (not "Redis unreachable") and recovers once its key is
deleted. Whole apps in this process (``tests/replication/apps.py``) on a real Redis."""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import pytest
import redis

from kv_slot_tracker.replication.records import RECORD_FIELD, encode_entry
from kv_slot_tracker.replication.redis.outbox import EXHAUSTED
from kv_slot_tracker.replication.redis.stream import NamespaceKeys
from kv_slot_tracker.settings import Settings
from tests.replication.apps import App, running_apps, until
from tests.support.records import format_2

pytestmark = pytest.mark.redis

MAX_ID = f"{2**64 - 1}-{2**64 - 1}"


def settings(redis_url: str, namespace: str, **extra: Any) -> Settings:
    extra = {"snapshot_interval_seconds": 3600, **extra}
    return Settings(redis_url=redis_url, namespace=namespace, **extra)


async def register(app: App, wid: int) -> None:
    body = {"model_name": "m", "worker_id": wid, "block_size": 16, "dp_start": 0, "dp_size": 1}
    assert (await app.post("/register", body)).status_code == 201


async def worker_ids(app: App) -> list[int] | None:
    """The ranks an instance serves; None while it answers 503 (re-reading, not ready)."""
    answer = await app.client.get("/workers")
    if answer.status_code == 503:
        return None
    assert answer.status_code == 200, answer.text
    return sorted(w["worker_id"] for w in answer.json())


def set_snapshot_id(client: redis.Redis, namespace: str, stream_id: Any) -> None:
    key = NamespaceKeys.of(namespace).snapshot
    data = msgpack.unpackb(client.hget(key, "data"), raw=False)
    data["stream_id"] = stream_id
    client.hset(key, mapping={"data": msgpack.packb(data), "id": str(stream_id)})


@pytest.mark.parametrize("stream_id", ["99999999999999-0", "not-an-id", 12, MAX_ID + "0"])
async def test_a_snapshot_with_a_bad_stream_id_is_ignored_and_the_stream_read(
    redis_url: str, namespace: str, stream_id: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    client = redis.Redis.from_url(redis_url)
    async with running_apps(settings(redis_url, namespace)) as (a,):
        await register(a, 1)
        await a.replication.settled(10)
        assert await a.replication.write_snapshot() is True
        set_snapshot_id(client, namespace, stream_id)
        async with running_apps(settings(redis_url, namespace)) as (c,):
            assert (await c.client.get("/ready")).status_code == 200
            assert await worker_ids(c) == [1]
            # it reads the stream on: a later record of the legitimate instance arrives
            await register(a, 2)

            async def applied() -> bool:
                return await worker_ids(c) == [1, 2]

            await until(applied, what="worker 2 on the new instance")
            status = (await c.client.get("/replication")).json()
            assert status["anomalies"]["snapshot_invalid"] == 1
            assert status["bootstraps"] == 1  # no loop
            assert status["degraded"] is True
            assert any(r.startswith("snapshot_invalid:") for r in status["degraded_reasons"])
            sample = c.app.state.registry.get_sample_value(
                "kv_slot_tracker_replication_anomalies_total", {"reason": "snapshot_invalid"}
            )
            assert sample == 1
    assert "anomaly snapshot_invalid" in caplog.text
    assert not [r for r in caplog.records if r.exc_info]  # no traceback
    client.close()


async def test_a_snapshot_lease_held_past_its_round_is_cut_back_and_shown(
    redis_url: str, namespace: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    lease = NamespaceKeys.of(namespace).snapshot_lease
    client.set(lease, "forged")  # no expiry: would stop snapshots for good
    async with running_apps(settings(redis_url, namespace, snapshot_interval_seconds=1)) as (a,):
        written = a.replication.status().snapshots_written

        async def shown() -> bool:
            status = (await a.client.get("/replication")).json()
            return status["anomalies"]["snapshot_lease_held"] >= 1 and any(
                r.startswith("snapshot_lease_held:") for r in status["degraded_reasons"]
            )

        await until(shown, what="the held lease shown")
        assert 0 < client.pttl(lease) <= 1000 or not client.exists(lease)
        await until(lambda: a.replication.status().snapshots_written > written, timeout=20,
                    what="snapshots written again")  # fmt: skip
    client.close()


async def test_an_exhausted_stream_is_named_and_recovers_once_its_key_is_deleted(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    client = redis.Redis.from_url(redis_url)
    key = NamespaceKeys.of(namespace).events
    async with running_apps(*[settings(redis_url, namespace)] * 2) as (a, b):
        await register(a, 1)
        await until(lambda: b.app.state.service.trackers, what="worker 1 on the peer")
        record = format_2({"model_name": "m", "routing_group": "default", "block_size": 16,
                           "topology": {"op": "upsert", "worker_id": 666, "dp_start": 0,
                                        "dp_size": 1}})  # fmt: skip
        client.xadd(key, {RECORD_FIELD: encode_entry(4242, 1, 1, 1, record)}, id=MAX_ID)
        await until(lambda: b.replication.status().stream_position == MAX_ID,
                    what="the peer past the entry with the largest id")  # fmt: skip
        await register(a, 2)  # applied locally; its append is refused

        async def named() -> bool:
            status = (await a.client.get("/replication")).json()
            return status["anomalies"]["stream_exhausted"] == 1

        await until(named, what="the exhausted stream named")
        status = (await a.client.get("/replication")).json()
        assert status["connected"] is True
        assert "Redis unreachable" not in status["degraded_reasons"]
        assert EXHAUSTED in status["degraded_reasons"]
        assert "anomaly stream_exhausted" in caplog.text
        assert "Redis unreachable" not in caplog.text
        sample = a.app.state.registry.get_sample_value(
            "kv_slot_tracker_replication_anomalies_total", {"reason": "stream_exhausted"}
        )
        assert sample == 1

        # the way out: a snapshot, then the stream key deleted; it is re-created
        assert await b.replication.write_snapshot() is True
        client.delete(key)

        async def recovered() -> bool:
            return await worker_ids(b) == [1, 2, 666]

        await until(recovered, timeout=30, what="worker 2 on the peer after the re-creation")
        await register(a, 3)

        async def later() -> bool:
            return await worker_ids(b) == [1, 2, 3, 666]

        await until(later, what="worker 3 on the peer")
        status = (await a.client.get("/replication")).json()
        assert EXHAUSTED not in status["degraded_reasons"]  # appends are taken again
    client.close()
