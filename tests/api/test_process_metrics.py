"""``/metrics``: the series operators alert on besides the trackers' own.

* the standard ``process_*`` series of the serving process (CPU, resident memory, open file
  descriptors), and every other series named with the service's prefix, in embedded and in
  replicated mode;
* ``kv_slot_tracker_ready`` and ``kv_slot_tracker_replication_degraded`` say what ``/ready``
  and ``/replication`` say: 0 and 1 (with the reason) while Redis is not there at start, 1 and 0
  once a real Redis is started where the instance looks for it;
* ``kv_slot_tracker_memory_limit_bytes``: the container's cgroup limit (v2 and v1), and no
  series without a limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kv_slot_tracker.main import create_app
from kv_slot_tracker.observability.process import MemoryLimitCollector
from kv_slot_tracker.settings import Settings, load_settings
from tests.api.test_metrics import Scrape, scrape

PREFIX = "kv_slot_tracker_"
PROCESS_SERIES = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
)


def own_series(m: Scrape) -> set[str]:
    return {name for name, _ in m.samples}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process_* needs /proc")
async def test_process_series_describe_this_process(client: httpx.AsyncClient) -> None:
    m = await scrape(client)
    for name in PROCESS_SERIES:
        assert m.value(name) is not None, name
    assert m.families["process_cpu_seconds"].type == "counter"
    # this very process: five more open files are five more descriptors
    before = m.value("process_open_fds")
    with contextlib.ExitStack() as stack:
        for _ in range(5):
            stack.enter_context(open(os.devnull, "rb"))  # noqa: SIM115
        assert (await scrape(client)).value("process_open_fds") == before + 5
    started = m.value("process_start_time_seconds")
    assert started is not None and started <= time.time()
    assert m.value("process_resident_memory_bytes") > 10 * 2**20  # a Python interpreter at least
    assert m.value("process_cpu_seconds_total") > 0


async def test_every_series_but_the_process_ones_carries_the_prefix(
    client: httpx.AsyncClient,
) -> None:
    await client.get("/loads")  # an HTTP series
    m = await scrape(client)
    names = own_series(m)
    assert f"{PREFIX}http_requests_total" in names
    assert f"{PREFIX}http_request_duration_seconds_count" in names
    assert f"{PREFIX}ready" in names
    strays = sorted(n for n in names if not n.startswith((PREFIX, "process_")))
    assert strays == []


async def test_replicated_series_carry_the_prefix_too(
    redis_url: str, redis_namespace: str, make_client
) -> None:
    async with make_client(
        redis_url=redis_url, namespace=redis_namespace, replication_ack="redis"
    ) as (_, client):
        await client.get("/loads")
        m = await scrape(client)
    names = own_series(m)
    assert f"{PREFIX}replication_connected" in names
    assert f"{PREFIX}consistency_ack_waits_total" in names
    assert sorted(n for n in names if not n.startswith((PREFIX, "process_"))) == []
    assert m.value(f"{PREFIX}ready") == 1
    assert m.value(f"{PREFIX}replication_degraded") == 0
    assert m.series(f"{PREFIX}replication_degraded_reason") == []


async def test_an_embedded_instance_is_ready_and_not_degraded(client: httpx.AsyncClient) -> None:
    m = await scrape(client)
    assert (await client.get("/ready")).status_code == 200
    assert m.value(f"{PREFIX}ready") == 1
    assert m.value(f"{PREFIX}replication_degraded") == 0


async def eventually(
    predicate: Callable[[], Awaitable[bool]], what: str, timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


async def test_ready_and_degraded_follow_redis_coming_up(tmp_path: Path) -> None:
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        pytest.fail("redis-server is not installed (the suite needs it: scripts/with_redis.sh)")
    sock = tmp_path / "redis.sock"  # nothing there yet
    app = create_app(Settings(redis_url=f"unix://{sock}", namespace="ops-ready"))
    async with app.router.lifespan_context(app):
        await app.state.replication.settled(10)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            m = await scrape(client)
            assert (await client.get("/ready")).status_code == 503
            assert m.value(f"{PREFIX}ready") == 0
            assert m.value(f"{PREFIX}replication_degraded") == 1
            reasons = (await client.get("/replication")).json()["degraded_reasons"]
            assert "Redis unreachable" in reasons
            assert {s["reason"] for s in m.series(f"{PREFIX}replication_degraded_reason")} == set(
                reasons
            )
            assert m.value(f"{PREFIX}replication_connected") == 0

            server = subprocess.Popen(
                [redis_server, "--port", "0", "--unixsocket", str(sock), "--save", "",
                 "--appendonly", "no", "--dir", str(tmp_path)],
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
            try:

                async def serving() -> bool:
                    m = await scrape(client)
                    return (
                        m.value(f"{PREFIX}ready") == 1
                        and m.value(f"{PREFIX}replication_degraded") == 0
                    )

                await eventually(serving, "ready 1 and degraded 0 once Redis is there")
                assert (await client.get("/ready")).status_code == 200
                m = await scrape(client)
                assert m.series(f"{PREFIX}replication_degraded_reason") == []
                assert m.value(f"{PREFIX}replication_connected") == 1
            finally:
                server.terminate()
                server.wait(10)


# --- the memory limit ------------------------------------------------------------------------


def limit_of(root: Path) -> float | None:
    registry = CollectorRegistry()
    registry.register(MemoryLimitCollector(root))
    return Scrape(generate_latest(registry).decode()).value(f"{PREFIX}memory_limit_bytes")


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"memory.max": "1073741824\n"}, 2**30),  # cgroup v2
        ({"memory.max": "max\n"}, None),
        ({"memory/memory.limit_in_bytes": "805306368\n"}, 768 * 2**20),  # cgroup v1
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # v1: no limit
        ({}, None),  # no memory controller to read
    ],
    ids=["v2", "v2-max", "v1", "v1-unlimited", "none"],
)
def test_memory_limit_from_the_cgroup(
    tmp_path: Path, files: dict[str, str], expected: int | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert limit_of(tmp_path) == expected


def test_the_default_registry_reads_the_real_cgroup() -> None:
    """Whatever this machine's limit is, the app's registry reports exactly that."""
    app = create_app(load_settings(api_key="", redis_url=""))
    text = generate_latest(app.state.registry).decode()
    real = MemoryLimitCollector().limit_bytes()
    value = Scrape(text).value(f"{PREFIX}memory_limit_bytes")
    assert value == (None if real is None else float(real))
