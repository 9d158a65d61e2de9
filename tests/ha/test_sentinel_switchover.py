"""A planned failover (``SENTINEL FAILOVER``): the primary is alive and becomes a replica, so
instances connected to it meet ``READONLY`` on their next write and an unblocked XREAD; they
must find the new primary through the Sentinels, resume reading where they were, apply nothing
twice and lose nothing acknowledged. Two whole applications in this process, knowing only the
Sentinels, with ``replication_ack = "redis"`` and one confirming replica."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from kv_slot_tracker.settings import Settings
from tests.ha.topology import MASTER, SentinelGroup, wait_for
from tests.replication.apps import App, register, running_apps, until
from tests.support.tracker import request_ranks

pytestmark = pytest.mark.redis


async def total(app: App) -> int:
    return sum(r["active_requests"] for r in await app.loads())


async def add_retrying(app: App, rid: str) -> None:
    """As a client does: retry a 503 (an earlier try may have landed: then 409)."""
    for attempt in range(200):
        status = await app.add(rid)
        if status == 201 or (status == 409 and attempt > 0):
            return
        assert status == 503, status
        await asyncio.sleep(0.05)
    raise AssertionError(f"{rid} never acknowledged")


async def test_planned_failover_loses_nothing_and_applies_nothing_twice(
    sentinel_group: SentinelGroup,
) -> None:
    group = sentinel_group
    settings = Settings(redis_url=group.urls, namespace=f"sw-{uuid.uuid4().hex[:8]}",
                        replication_ack="redis", replication_ack_replicas=1,
                        snapshot_interval_seconds=3600)  # fmt: skip
    async with running_apps(settings, settings) as (a, b):
        await register(a, [b])
        for i in range(20):
            await add_retrying(a if i % 2 else b, f"before-{i}")
        old = group.primary_port()
        with group.sentinels[0].client() as c:
            c.execute_command("SENTINEL FAILOVER", MASTER)
        wait_for(lambda: group.primary_port() != old, 30, "the switch-over")
        for i in range(20):
            await add_retrying(a if i % 2 else b, f"after-{i}")

        async def both_hold_all() -> bool:
            return await total(a) == await total(b) == 40

        await until(both_hold_all, 15, "every acknowledged add on both instances")
        for app, applied in ((a, 20), (b, 21)):
            st = (await app.client.get("/replication")).json()
            assert st["connected"] and st["dropped"] == 0, st
            assert st["applied"] == applied, st  # the peer's records, each once
            tracker = app.app.state.service.tracker(("m", "default"))
            assert set(request_ranks(tracker)) == {f"{w}-{i}" for w in ("before", "after")
                                                   for i in range(20)}  # fmt: skip
