"""Test helpers for replication: instances wired through a real Redis on fake tracker clocks,
bounded polling, a throwaway redis-server and a TCP proxy that can cut one instance off.

Services run on fake clocks (decay and request ages are exact and never slept for); the
replication machinery itself runs on real time, since it talks to a real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from prometheus_client import CollectorRegistry

from kv_slot_tracker.replication.redis import RedisReplication
from kv_slot_tracker.replication.redis.bootstrap import START_WAIT_S
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.settings import Settings
from tests.calls import AddCall
from tests.fakes import NS_PER_SECOND, FakeClock

MODEL = "llama"
GROUP = "default"
KEY = (MODEL, GROUP)
WALL_START_NS = 1_800_000_000 * NS_PER_SECOND


class Clocks:
    """A monotonic and a wall clock that advance together (one simulated machine time)."""

    def __init__(self) -> None:
        self.mono = FakeClock()
        self.wall = FakeClock(WALL_START_NS)

    def advance(self, seconds: float) -> None:
        self.mono.advance(seconds)
        self.wall.advance(seconds)


@dataclass
class Node:
    """One instance: a service and its Redis replication."""

    service: SlotTrackerService
    rep: RedisReplication
    registry: CollectorRegistry

    def loads(self) -> list[dict[str, Any]]:
        return self.service.loads(None, None)

    def add(
        self,
        request_id: str,
        worker_id: int = 1,
        dp_rank: int = 0,
        hashes: list[int] | None = None,
        tokens: int = 0,
        prefill_ms: float | None = None,
        key: tuple[str, str] = KEY,
        lora: str | None = None,
    ) -> None:
        self.service.add(
            AddCall(
                key[0],
                key[1],
                request_id,
                worker_id,
                dp_rank,
                sequence_hashes=list(hashes) if hashes is not None else [1, 2, 3],
                new_isl_tokens=tokens,
                expected_prefill_ms=prefill_ms,
                lora_name=lora,
            )
        )


@dataclass
class Cluster:
    redis_url: str
    namespace: str
    clocks: Clocks
    nodes: list[Node] = field(default_factory=list)

    def settings(self, **overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "redis_url": self.redis_url,
            "namespace": self.namespace,
            "snapshot_interval_seconds": 3600,  # tests write snapshots explicitly
        }
        values.update(overrides)
        return Settings(**values)

    async def node(self, *, start: bool = True, clocks: Clocks | None = None, **overrides) -> Node:
        clocks = clocks or self.clocks
        registry = CollectorRegistry()
        settings = self.settings(**overrides)
        rep = RedisReplication(settings, registry)
        service = SlotTrackerService(
            clock=clocks.mono.now,
            wall_clock=clocks.wall.now,
            instance_id=rep.instance_id,
            worker_ttl_seconds=settings.worker_ttl_seconds,
            replicator=rep,
        )
        node = Node(service, rep, registry)
        self.nodes.append(node)
        if start:
            await rep.start(service)
            await rep.settled(START_WAIT_S)
        return node

    async def close(self) -> None:
        for node in self.nodes:
            await node.rep.stop()


async def eventually(
    predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout`` seconds (real time)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


class RedisServer:
    """A throwaway ``redis-server`` without persistence that can be stopped and restarted."""

    def __init__(self, binary: str, port: int) -> None:
        self.binary = binary
        self.port = port
        self.dir = tempfile.mkdtemp(prefix="slot-tracker-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
                client.ping()
                client.close()
                return
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class TcpProxy:
    """Forwards a local port to Redis; ``cut()`` drops every connection and refuses new ones
    until ``restore()``, which partitions one instance from Redis while others keep going."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.open = True
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

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

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.discard(writer)
        self._writers.discard(up_writer)

    def cut(self) -> None:
        self.open = False
        for w in list(self._writers):
            w.close()
        self._writers.clear()

    def restore(self) -> None:
        self.open = True

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@contextlib.asynccontextmanager
async def proxied(redis_url: str) -> AsyncIterator[TcpProxy]:
    """A started ``TcpProxy`` to the Redis server of ``redis_url``, closed afterwards."""
    proxy = TcpProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
