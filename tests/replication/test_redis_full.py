"""Redis at ``maxmemory`` with ``noeviction`` (what the manifests ship): appends are refused, and
the service says so instead of waiting. With durable acknowledgements a change is answered 503
at once, naming the cause; records stay in the outbox and nothing acknowledged is lost once
Redis has room again."""

from __future__ import annotations

import asyncio

import redis

from kv_slot_tracker.settings import Settings
from tests.replication.apps import running_apps
from tests.replication.helpers import eventually

REGISTER = {"model_name": "m", "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 1}


def add(i: int) -> dict:
    hashes = list(range(i * 64, i * 64 + 64))
    return {"model_name": "m", "request_id": f"r{i}", "worker_id": 1, "dp_rank": 0,
            "sequence_hashes": hashes}  # fmt: skip


async def test_a_full_redis_refuses_changes_with_503_and_loses_nothing(redis_server) -> None:
    redis_server.start()
    admin = redis.Redis(port=redis_server.port)
    settings = [
        Settings(redis_url=redis_server.url, namespace="full", replication_ack="redis",
                 replication_ack_timeout_ms=1000, snapshot_interval_seconds=3600)
        for _ in range(2)
    ]  # fmt: skip
    async with running_apps(*settings) as (a, b):
        assert (await a.post("/register", REGISTER)).status_code == 201
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", used + 200_000)
        acknowledged, refused = [], None
        for i in range(2000):
            r = await a.post("/add", add(i))
            if r.status_code == 201:
                acknowledged.append(f"r{i}")
                continue
            refused = r
            break
        assert refused is not None, "Redis never filled up"
        # the call that met the full Redis was applied here but not acknowledged in time ...
        assert refused.status_code == 503, refused.text
        # ... and from then on changes are refused before anything is applied, naming the cause
        again = await a.post("/add", add(9999))
        assert again.status_code == 503
        assert again.json()["error"] == (
            "not accepted: Redis is out of memory (maxmemory, noeviction) and refuses appends; "
            "nothing was changed"
        )
        assert not a.app.state.service.tracker(("m", "default")).has_request("r9999")
        status = (await a.client.get("/replication")).json()
        assert status["degraded"] is True and any(
            "out of memory" in r for r in status["degraded_reasons"]
        )
        metrics = (await a.client.get("/metrics")).text
        line = [
            m
            for m in metrics.splitlines()
            if m.startswith("kv_slot_tracker_replication_write_refused_total")
        ]
        assert line and float(line[0].split()[-1]) >= 1

        admin.config_set("maxmemory", 0)  # room again
        await eventually(
            lambda: a.replication.status().outbox_depth == 0, 15, "the outbox to drain"
        )
        assert (await a.post("/add", add(10_000))).status_code == 201
        acknowledged.append("r10000")

        async def everywhere() -> bool:
            rows = (await b.client.get("/loads")).json()
            return rows and rows[0]["active_requests"] >= len(acknowledged)

        for _ in range(500):
            if await everywhere():
                break
            await asyncio.sleep(0.02)
        tracker = b.app.state.service.tracker(("m", "default"))
        assert all(tracker.has_request(rid) for rid in acknowledged)
        assert not (await a.client.get("/replication")).json()["degraded"]
    admin.close()
