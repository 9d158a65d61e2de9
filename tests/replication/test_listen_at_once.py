"""A replicated instance listens at once: while it bootstraps it answers ``/health`` 200 and
``/ready`` 503 with the reason, and every tracker route 503 JSON without changing anything."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import redis
from fastapi import FastAPI

from kv_slot_tracker.main import create_app
from kv_slot_tracker.replication.redis.stream import NamespaceKeys
from kv_slot_tracker.settings import Settings
from tests.replication.helpers import eventually

pytestmark = pytest.mark.redis

REGISTER = {"model_name": "m", "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
ADD = {"model_name": "m", "request_id": "r1", "worker_id": 1, "dp_rank": 0,
       "sequence_hashes": [1, 2], "new_isl_tokens": 7}  # fmt: skip
# every route that reads or writes tracker state, with a body it would accept
STATE_CALLS: list[tuple[str, str, dict | None]] = [
    ("POST", "/register", REGISTER),
    ("POST", "/upsert", REGISTER),
    ("POST", "/unregister", {"model_name": "m", "worker_id": 1}),
    ("POST", "/reconcile", {"model_name": "m", "block_size": 16, "workers": []}),
    ("POST", "/add", ADD),
    ("POST", "/prefill_complete", {"model_name": "m", "request_id": "r1"}),
    ("POST", "/free", {"model_name": "m", "request_id": "r1"}),
    ("POST", "/output_block", {"model_name": "m", "request_id": "r1"}),
    ("POST", "/potential_loads", {"model_name": "m", "sequence_hashes": [1]}),
    ("POST", "/project_loads", {"model_name": "m", "sequence_hashes": [1]}),
    ("POST", "/batch", {"operations": [{"op": "add", **ADD}]}),
    ("GET", "/loads", None),
    ("GET", "/workers", None),
    ("GET", "/lora_counts?model_name=m", None),
    ("GET", "/selection/loads", None),
    ("GET", "/selection/workers", None),
    ("POST", "/selection/select", {"model_name": "m", "sequence_hashes": [1]}),
]


@asynccontextmanager
async def started(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app's lifespan entered (what uvicorn awaits before it listens), and a client."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            yield client


async def test_bootstrapping_instance_listens_at_once_and_refuses_state_calls(
    redis_url: str, redis_namespace: str
) -> None:
    keys = NamespaceKeys.of(redis_namespace)
    admin = redis.Redis.from_url(redis_url)
    # Redis lost data and no snapshot was written since: a starting instance waits for one
    admin.set(keys.reset, "1")
    app = create_app(Settings(redis_url=redis_url, namespace=redis_namespace))
    try:
        # startup must not wait for the bootstrap (which waits up to a minute for a snapshot)
        async with asyncio.timeout(5):
            entered = started(app)
            client = await entered.__aenter__()
        try:
            health = await client.get("/health")
            assert (health.status_code, health.content) == (200, b"")
            ready = await client.get("/ready")
            assert ready.status_code == 503
            assert ready.json()["status"] == "not_ready"
            assert ready.json()["reason"]  # at first "connecting to Redis"

            async def reason() -> str:
                return (await client.get("/ready")).json()["reason"] or ""

            for _ in range(500):
                if (await reason()).startswith("waiting for a snapshot"):
                    break
                await asyncio.sleep(0.01)
            assert (await reason()).startswith("waiting for a snapshot")
            status = (await client.get("/replication")).json()
            assert status["ready"] is False
            for method, path, body in STATE_CALLS:
                r = await client.request(method, path, json=body)
                assert r.status_code == 503, (path, r.status_code, r.text)
                assert r.headers["content-type"] == "application/json"
                assert r.json()["error"].startswith("not ready: waiting for a snapshot"), path

            admin.delete(keys.reset)  # as if a running instance wrote a snapshot
            await eventually(lambda: app.state.replication.ready(), 10, "ready")
            assert (await client.get("/ready")).json() == {"status": "ready", "reason": None}
            # nothing the refused calls carried was applied or published
            assert (await client.get("/loads")).json() == []
            assert (await client.get("/workers")).json() == []
            assert app.state.replication.status().published == 0
            assert admin.xlen(keys.events) == 0
            assert (await client.post("/register", json=REGISTER)).status_code == 201
            assert (await client.post("/add", json=ADD)).status_code == 201
            assert [r["active_requests"] for r in (await client.get("/loads")).json()] == [1]
        finally:
            await entered.__aexit__(None, None, None)
    finally:
        for key in admin.scan_iter(match="{" + redis_namespace + "}:*"):
            admin.delete(key)
        admin.close()


async def test_with_redis_unreachable_at_start_the_log_says_what_the_routes_do(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No Redis at start: the log must not claim the local state is served while it is not."""
    from tests.ports import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    app = create_app(Settings(redis_url=url, namespace="unreachable"))
    caplog.set_level("WARNING", logger="kv_slot_tracker.replication")
    async with started(app) as client:
        await eventually(
            lambda: any("cannot reach Redis" in r.getMessage() for r in caplog.records),
            10,
            "the reader's warning",
        )
        r = await client.get("/loads")
        assert r.status_code == 503 and r.json()["error"].startswith("not ready")
    said = [r.getMessage() for r in caplog.records if "cannot reach Redis" in r.getMessage()]
    assert "every state route answer 503 'not ready' until it is" in said[0]
    assert not any("local state keeps serving" in r.getMessage() for r in caplog.records)
