"""``replication_ack_replicas``: with ``replication_ack = "redis"`` a change is answered only
once ``WAIT`` confirmed that many replicas hold it. A primary and one replica of its own here;
whole apps in this process (``tests/replication/apps.py``)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from kv_slot_tracker.settings import Settings
from tests.ha.conftest import redis_binary
from tests.ha.topology import RedisProcess, wait_for
from tests.replication.apps import register, running_apps

pytestmark = pytest.mark.redis


async def test_acknowledged_only_once_a_replica_holds_it() -> None:
    root = Path(tempfile.mkdtemp(prefix="slot-tracker-wait-"))
    primary = RedisProcess(redis_binary(), "primary", root)
    replica = RedisProcess(redis_binary(), "replica", root)
    try:
        primary.start()
        primary.wait_up()
        replica.start("--replicaof", "127.0.0.1", str(primary.port))
        replica.wait_up()

        def synced() -> bool:
            with replica.client(decode_responses=True) as c:
                return c.info("replication")["master_link_status"] == "up"

        wait_for(synced, 10, "the replica to sync")
        settings = Settings(redis_url=f"redis://127.0.0.1:{primary.port}/0",
                            namespace=f"wait-{uuid.uuid4().hex[:8]}", replication_ack="redis",
                            replication_ack_replicas=1, replication_ack_timeout_ms=1000,
                            snapshot_interval_seconds=3600)  # fmt: skip
        async with running_apps(settings) as (a,):
            await register(a, [])
            assert await a.add("held") == 201
            with replica.client() as c:  # answered, so the replica has it already
                assert c.xlen(f"{{{settings.namespace}}}:events") == 2
            replica.kill()
            # applied here and appended to the primary, but no replica confirms: 503
            r = await a.post("/free", {"model_name": "m", "request_id": "held"})
            assert r.status_code == 503, r.text
            assert r.json()["error"].startswith("not acknowledged"), r.text
            # and for a moment after that, a change is refused before it changes anything
            r = await a.post("/free", {"model_name": "m", "request_id": "other"})
            assert r.status_code == 503, r.text
            assert r.json()["error"] == "not accepted: Redis replicas not confirming; nothing " \
                "was changed", r.text  # fmt: skip
            assert "Redis replicas not confirming appends" in (
                await a.client.get("/replication")).json()["degraded_reasons"]  # fmt: skip
            # a call that changes nothing but whose answer rests on an unconfirmed change (an
            # add retried after a 503 finds the request there: 409, which a client takes as
            # acknowledging its add) is not answered that way either while it is unconfirmed
            await asyncio.sleep(1.1)  # past the moment calls are refused at once
            assert await a.add("retried") == 503  # applied here, not confirmed
            await asyncio.sleep(1.1)
            assert await a.add("retried") == 503  # 409 only once the add is confirmed
            replica.start("--replicaof", "127.0.0.1", str(primary.port))
            replica.wait_up()
            wait_for(synced, 10, "the replica to sync again")
            deadline = time.monotonic() + 10
            statuses = []
            while (status := await a.add("after")) not in (201, 409):  # a client retrying
                assert status == 503 and time.monotonic() < deadline, status
                statuses.append(status)
                await asyncio.sleep(0.1)
            # 409: an attempt answered 503 had been applied (and appended) after all
            assert status == 201 or statuses, status
            key = f"{{{settings.namespace}}}:events"
            with replica.client() as c:  # register, held, its free, retried, after: once each
                wait_for(lambda: c.xlen(key) == 5, 5, "the replica to hold every record")
            assert await a.add("retried") == 409  # confirmed now: answered at once
    finally:
        primary.kill()
        replica.kill()
        shutil.rmtree(root, ignore_errors=True)
