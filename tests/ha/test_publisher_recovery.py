"""A publisher cut off from Redis finds its way back by itself, whatever the traffic.

With durable acknowledgements, a change is refused (503 "not accepted") while the publisher is
known to be cut off from Redis, so nothing new waits for an append: the publisher must
reconnect on its own schedule, or the refusal never ends. A primary and one replica of its
own here (no Sentinel); whole apps in this process (``tests/replication/apps.py``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kv_slot_tracker.settings import Settings
from tests.ha.conftest import redis_binary
from tests.ha.topology import RedisProcess, wait_for
from tests.replication.apps import App, register, running_apps, until
from tests.replication.helpers import proxied

pytestmark = pytest.mark.redis


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[RedisProcess, RedisProcess]]:
    """A primary and its replica, linked, on free loopback ports."""
    root = Path(tempfile.mkdtemp(prefix="slot-tracker-pub-"))
    primary = RedisProcess(redis_binary(), "primary", root)
    replica = RedisProcess(redis_binary(), "replica", root)
    request.node.ha_redis = [type("Pair", (), {"servers": [primary, replica]})()]
    try:
        primary.start()
        primary.wait_up()
        replica.start("--replicaof", "127.0.0.1", str(primary.port))
        replica.wait_up()

        def synced() -> bool:
            with replica.client(decode_responses=True) as c:
                return c.info("replication")["master_link_status"] == "up"

        wait_for(synced, 10, "the replica to sync")
        yield primary, replica
    finally:
        for p in (primary, replica):
            if p.proc is not None:
                os.kill(p.proc.pid, signal.SIGCONT)  # a stopped process ignores SIGKILL's wait
            p.kill()
        shutil.rmtree(root, ignore_errors=True)  # the logs' tails are in a failure's report


def publisher_clients(server: RedisProcess, app: App) -> list[dict[str, str]]:
    name = f"slot-tracker-{app.replication.instance_id}-pub"
    with server.client(decode_responses=True) as c:
        return [x for x in c.client_list() if x.get("name") == name]


async def accepted_again(app: App, rid: str, timeout: float) -> list[int]:
    """Retry an add as a client does until it is accepted (201, or 409 after a 503 that was
    applied after all); the statuses seen before."""
    deadline = time.monotonic() + timeout
    statuses: list[int] = []
    while (status := await app.add(rid)) not in (201, 409):
        assert status == 503, status
        statuses.append(status)
        if time.monotonic() > deadline:
            raise AssertionError(f"writes still refused after {timeout} s: {statuses[-3:]}")
        await asyncio.sleep(0.1)
    return statuses


async def test_writes_accepted_again_after_a_failed_idle_confirmation(
    pair: tuple[RedisProcess, RedisProcess],
) -> None:
    """The replica stops, so WAIT falls short; an add is answered 503 at its timeout; the
    publisher's connection is killed while its idle re-confirming WAIT runs; the replica comes
    back. Nothing waits any more and every new change is refused up front, yet the instance
    must accept changes again without any client's help."""
    primary, replica = pair
    settings = Settings(redis_url=f"redis://127.0.0.1:{primary.port}/0",
                        namespace=f"pub-{uuid.uuid4().hex[:8]}", replication_ack="redis",
                        replication_ack_replicas=1, replication_ack_timeout_ms=2000,
                        snapshot_interval_seconds=3600)  # fmt: skip
    async with running_apps(settings) as (a,):
        await register(a, [])
        assert await a.add("before") == 201
        assert replica.proc is not None
        os.kill(replica.proc.pid, signal.SIGSTOP)
        try:
            # applied here, WAIT fell short: 503 at the timeout, while the publisher, idle,
            # asks the replicas again (that WAIT runs past the call's timeout)
            assert await a.add("unconfirmed") == 503

            def confirming() -> list[dict[str, str]]:
                return [c for c in publisher_clients(primary, a)
                        if c.get("cmd") == "wait" and "b" in c.get("flags", "")]  # fmt: skip

            (client,) = confirming()
            with primary.client() as c:  # the connection dies in the middle of that WAIT
                c.client_kill_filter(_id=client["id"])
            await until(lambda: a.replication.outbox.connected is False, 5,
                        "the publisher to notice")  # fmt: skip
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        await accepted_again(a, "after", 15)
        assert publisher_clients(primary, a), "no publisher connection to Redis"
        ready = await a.client.get("/ready")
        assert ready.status_code == 200, ready.text
        st = (await a.client.get("/replication")).json()
        assert st["connected"], st


async def test_ready_says_writes_are_refused_until_redis_answers_again(
    redis_url: str, redis_namespace: str
) -> None:
    """With durable acknowledgements, an instance that refuses every change is not ready for
    traffic: ``/ready`` answers 503 with the reason while it lasts, 200 once Redis is back,
    with no call made meanwhile."""
    async with proxied(redis_url) as proxy:
        settings = Settings(redis_url=proxy.url(), namespace=redis_namespace,
                            replication_ack="redis", replication_ack_timeout_ms=500,
                            snapshot_interval_seconds=3600)  # fmt: skip
        async with running_apps(settings) as (a,):
            await register(a, [])
            assert (await a.client.get("/ready")).status_code == 200
            proxy.cut()
            assert await a.add("cut") == 503  # applied here, the append fails

            async def refusing() -> bool:
                r = await a.client.get("/ready")
                return r.status_code == 503 and r.json() == {
                    "status": "not_ready", "reason": "writes refused: Redis unreachable"}  # fmt: skip

            await until(refusing, 10, "/ready to say writes are refused")
            # reads are still answered from local state
            assert (await a.client.get("/loads")).status_code == 200
            proxy.restore()

            async def ready() -> bool:
                return (await a.client.get("/ready")).status_code == 200

            await until(ready, 10, "/ready to say ready again")
            assert await a.add("back") == 201
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match="{" + redis_namespace + "}:*"))
    if keys:
        client.delete(*keys)
    client.close()
