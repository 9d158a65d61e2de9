"""Whole applications (``create_app``) in this process, sharing a real Redis, driven over ASGI.

For behaviour that lives at the HTTP edge of a replicated instance (readiness gate, waiting
for unknown request ids, durable acknowledgements). Apps run on the real clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI

from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import Settings

MODEL = "m"


class App:
    """One instance: the application and an HTTP client to it."""

    def __init__(self, app: FastAPI, client: httpx.AsyncClient) -> None:
        self.app = app
        self.client = client

    async def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return await self.client.post(path, json=body)

    async def add(self, rid: str, rank: int = 0, tokens: int = 40, **extra: Any) -> int:
        body = {"model_name": MODEL, "request_id": rid, "worker_id": 1, "dp_rank": rank,
                "sequence_hashes": [1, 2, hash(rid) & 0xFFFF], "new_isl_tokens": tokens,
                **extra}  # fmt: skip
        return (await self.post("/add", body)).status_code

    async def call(self, op: str, rid: str) -> httpx.Response:
        return await self.post(f"/{op}", {"model_name": MODEL, "request_id": rid})

    async def loads(self) -> list[dict[str, Any]]:
        rows = (await self.client.get("/loads")).json()
        return [{k: r[k] for k in ("dp_rank", "active_requests", "active_decode_blocks",
                                   "active_prefill_tokens")} for r in rows]  # fmt: skip

    def metric(self, name: str) -> float:
        """A sample of this app's registry (``kv_slot_tracker_<name>``, a counter's total)."""
        value = self.app.state.registry.get_sample_value(f"kv_slot_tracker_{name}")
        return value if value is not None else float("nan")

    @property
    def replication(self) -> Any:
        return self.app.state.replication

    def outbox_empty(self) -> bool:
        return self.replication.status().outbox_depth == 0


@contextlib.asynccontextmanager
async def running_apps(*settings: Settings) -> AsyncIterator[list[App]]:
    """Start one app per settings (lifespans entered, bootstrap settled)."""
    async with contextlib.AsyncExitStack() as stack:
        apps = []
        for s in settings:
            app = create_app(s)
            await stack.enter_async_context(app.router.lifespan_context(app))
            await app.state.replication.settled(10)
            transport = httpx.ASGITransport(app=app)
            client = await stack.enter_async_context(
                httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30)
            )
            apps.append(App(app, client))
        yield apps


async def until(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll an async (or plain) predicate until true; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


async def register(app: App, others: list[App], dp_size: int = 2) -> None:
    """Register worker 1 (``dp_size`` ranks) on ``kv_slot_tracker`` and wait until ``others`` have it."""
    body = {"model_name": MODEL, "worker_id": 1, "block_size": 16, "dp_start": 0,
            "dp_size": dp_size}  # fmt: skip
    assert (await app.post("/register", body)).status_code == 201

    async def everywhere() -> bool:
        for other in others:
            if not (await other.client.get("/workers")).json():
                return False
        return True

    await until(everywhere, what="the worker on every instance")
