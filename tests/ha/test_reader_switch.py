"""A reader that resumes on a promoted replica must not skip what the new primary holds.

A primary and its replica on loopback ports; two whole apps in this process, each reaching
Redis through a proxy of its own that the test points at one server or the other (what a DNS
name or a Sentinel does in production). The replica is promoted (``REPLICAOF NO ONE``) while
the old primary keeps taking writes; instance B moves to the new primary first and its
publisher re-sends its records there; instance A's reader read on at the old primary, so its
position is beyond the ids of B's re-sent records on the new one. A's publisher moves and
re-sends too before A's reader gets through (the proxy holds the reader's connections).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kv_slot_tracker.settings import Settings
from tests.ha.conftest import redis_binary
from tests.ha.topology import RedisProcess, wait_for
from tests.replication.apps import App, register, running_apps, until
from tests.replication.helpers import TcpProxy

pytestmark = pytest.mark.redis


class SwitchingProxy(TcpProxy):
    """A ``TcpProxy`` whose target can change, and which can hold back the connections of
    replication readers (their client name ends in ``-rd``) until released."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.released = asyncio.Event()
        self.released.set()

    def switch(self, port: int, hold_readers: bool = False) -> None:
        """From now on connect to ``port``; drop the connections to the old target."""
        self.target_port = port
        if hold_readers:
            self.released.clear()
        self.cut()
        self.restore()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        held = not self.released.is_set()

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, up: bool) -> None:
            nonlocal held
            try:
                while data := await src.read(65536):
                    if up and held and b"SETNAME" in data:  # redis-py names it after HELLO
                        if b"-rd" in data:
                            await self.released.wait()
                        held = False
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))
        self._writers.discard(writer)
        self._writers.discard(up_writer)


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[RedisProcess, RedisProcess]]:
    root = Path(tempfile.mkdtemp(prefix="slot-tracker-switch-"))
    old = RedisProcess(redis_binary(), "old-primary", root)
    new = RedisProcess(redis_binary(), "new-primary", root)
    request.node.ha_redis = [type("Pair", (), {"servers": [old, new]})()]
    try:
        old.start()
        old.wait_up()
        new.start("--replicaof", "127.0.0.1", str(old.port))
        new.wait_up()
        yield old, new
    finally:
        old.kill()
        new.kill()
        shutil.rmtree(root, ignore_errors=True)  # the logs' tails are in a failure's report


async def add_retrying(app: App, rid: str) -> None:
    """As a client does: retry a 503 (an earlier try may have landed: then 409)."""
    for attempt in range(200):
        status = await app.add(rid)
        if status == 201 or (status == 409 and attempt > 0):
            return
        assert status == 503, status
        await asyncio.sleep(0.05)
    raise AssertionError(f"{rid} never acknowledged")


async def active(app: App) -> int:
    return sum(r["active_requests"] for r in await app.loads())


async def test_reader_resuming_on_a_promoted_replica_reads_what_it_holds(
    pair: tuple[RedisProcess, RedisProcess],
) -> None:
    old, new = pair
    pa, pb = SwitchingProxy(old.port), SwitchingProxy(old.port)
    await pa.start()
    await pb.start()
    namespace = f"switch-{uuid.uuid4().hex[:8]}"
    events = f"{{{namespace}}}:events"

    def settings(proxy: TcpProxy) -> Settings:
        return Settings(redis_url=proxy.url(), namespace=namespace, replication_ack="redis",
                        snapshot_interval_seconds=3600,
                        consistency_wait_ms=20_000)  # fmt: skip

    try:
        async with running_apps(settings(pa), settings(pb)) as (a, b):
            await register(a, [b])
            await add_retrying(b, "b0")
            await until(lambda: active(a), what="b0 on a")  # type: ignore[arg-type]

            def synced() -> bool:
                with old.client() as o, new.client() as n:
                    return o.xlen(events) == n.xlen(events)

            wait_for(synced, 10, "the replica to hold every record")
            with new.client() as c:  # promoted; the old primary goes on taking writes
                c.replicaof("NO", "ONE")
            await add_retrying(b, "b1")  # on the old primary only

            async def a_has(n: int) -> bool:
                return await active(a) == n

            await until(lambda: a_has(2), what="b1 on a")
            pb.switch(new.port)  # b moves first: its publisher re-sends b0, b1, then b2
            await add_retrying(b, "b2")
            await add_retrying(a, "a1")  # on the old primary; a's reader reads on past it
            with old.client() as c:
                tail = c.xrevrange(events, count=1)[0][0].decode()
            await until(lambda: a.replication.reader.position == tail, what="a to read a1")
            pa.switch(new.port, hold_readers=True)
            await add_retrying(a, "a2")  # a's publisher re-sends a1, then appends a2
            # b2 is unknown to a: the call waits for a's reader, which is held
            call = asyncio.ensure_future(a.call("prefill_complete", "b2"))
            await asyncio.sleep(0.3)
            assert not call.done(), call.result().text
            pa.released.set()
            r = await call
            assert r.status_code == 200, r.text  # a found b2: it did not skip it
            assert await active(a) == 5
            await until(lambda: b.outbox_empty() and a.outbox_empty(), what="outboxes")

            async def same() -> bool:
                return await a.loads() == await b.loads()

            await until(same, what="a and b to agree")
            assert (await a.client.get("/ready")).status_code == 200
            st = (await a.client.get("/replication")).json()
            assert st["resets"] == 1 and st["gaps"] == 0, st
    finally:
        await pa.close()
        await pb.close()
