"""Applications built by ``create_app``: the replication port wired to the service, and two of
them sharing state through Redis (HTTP in, HTTP out)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import pytest
import redis
from fastapi import FastAPI

from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import Settings

STATUS_KEYS = [
    "mode", "instance_id", "namespace", "redis", "ready", "not_ready_reason", "connected", "degraded",
    "degraded_reasons", "stream_position", "outbox_depth", "outbox_capacity", "published",
    "applied", "duplicates", "dropped", "records_rejected", "anomalies", "gaps", "resets", "resent", "bootstraps",
    "snapshots_written", "last_applied_lag_ms", "snapshot_age_seconds", "snapshot_stream_id",
    "hub",
]  # fmt: skip


@asynccontextmanager
async def running(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        await app.state.replication.settled(10)  # the lifespan does not wait for the bootstrap
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            yield client


async def test_embedded_app_is_wired_in_one_phase() -> None:
    app = create_app(Settings(instance_id=42))
    assert app.state.replication.instance_id == 42
    assert app.state.service.instance_id == 42
    assert app.state.service.replicator is None  # nothing to replicate: no replica events
    async with running(app) as client:
        r = await client.get("/replication")
        assert (await client.get("/ready")).json() == {"status": "ready", "reason": None}
    assert r.content == (
        b'{"mode":"embedded","instance_id":42,"namespace":null,"redis":null,"ready":true,'
        b'"not_ready_reason":null,"connected":null,"degraded":false,"degraded_reasons":[],'
        b'"stream_position":null,"outbox_depth":0,"outbox_capacity":0,"published":0,'
        b'"applied":0,"duplicates":0,"dropped":0,"records_rejected":{},"anomalies":{},"gaps":0,"resets":0,'
        b'"resent":0,'
        b'"bootstraps":0,"snapshots_written":0,"last_applied_lag_ms":null,'
        b'"snapshot_age_seconds":null,"snapshot_stream_id":null,"hub":null}'
    )


@pytest.mark.redis
async def test_two_apps_replicate_over_http(redis_url: str, redis_namespace: str) -> None:
    settings = Settings(redis_url=redis_url, namespace=redis_namespace)
    try:
        async with AsyncExitStack() as stack:
            app_a = create_app(settings)
            assert app_a.state.service.replicator is app_a.state.replication
            assert app_a.state.service.instance_id == app_a.state.replication.instance_id != 0
            a = await stack.enter_async_context(running(app_a))
            b = await stack.enter_async_context(running(create_app(settings)))
            assert (await a.get("/ready")).status_code == 200
            body = {
                "model_name": "m",
                "worker_id": 1,
                "block_size": 16,
                "dp_start": 0,
                "dp_size": 2,
            }
            assert (await a.post("/register", json=body)).is_success
            add = {"model_name": "m", "request_id": "r1", "worker_id": 1, "dp_rank": 1,
                   "sequence_hashes": [1, 2, 3], "new_isl_tokens": 40}  # fmt: skip
            assert (await a.post("/add", json=add)).is_success

            async def loads(client: httpx.AsyncClient) -> list[dict]:
                return (await client.get("/loads")).json()

            seen: list[dict] = []

            async def poll() -> bool:
                seen[:] = await loads(b)
                return any(r["active_requests"] for r in seen)

            for _ in range(500):
                if await poll():
                    break
                await asyncio.sleep(0.01)
            assert [r["active_decode_blocks"] for r in seen] == [0, 3]
            status_a = (await a.get("/replication")).json()
            status_b = (await b.get("/replication")).json()
            assert list(status_a) == list(status_b) == STATUS_KEYS
            assert status_a["mode"] == status_b["mode"] == "redis"
            assert status_a["instance_id"] != status_b["instance_id"]
            assert status_a["published"] == 2 and status_b["applied"] == 2
            metrics = (await b.get("/metrics")).text
            assert "kv_slot_tracker_replication_applied_total 2.0" in metrics
    finally:
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match="{" + redis_namespace + "}:*"))
        if keys:
            client.delete(*keys)
        client.close()
