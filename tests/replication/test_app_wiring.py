"""Two applications built by ``create_app`` share state through Redis (HTTP in, HTTP out)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import pytest
import redis
from fastapi import FastAPI

from app.main import create_app
from app.settings import Settings

pytestmark = pytest.mark.redis


@asynccontextmanager
async def running(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            yield client


async def test_two_apps_replicate_over_http(redis_url: str, redis_namespace: str) -> None:
    settings = Settings(redis_url=redis_url, namespace=redis_namespace)
    try:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(running(create_app(settings)))
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
