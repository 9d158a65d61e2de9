"""Fixtures for end-to-end tests: real service processes sharing a real Redis.

``fleet_factory`` makes ``Fleet``s (see ``tests/e2e/servers.py``), each on its own namespace,
and kills their processes at teardown whatever happened. When a test fails, the tail of every
instance's log and its ``/replication`` status are added to the failure report.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.e2e.servers import Fleet
from tests.ports import free_port
from tests.replication.helpers import RedisServer

FleetFactory = Callable[..., Fleet]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    report = yield
    fleets: list[Fleet] = getattr(item, "e2e_fleets", [])
    if report.failed and report.when in ("setup", "call") and fleets:
        text = "\n".join(f"{f.statuses()}\n{f.log_tails()}" for f in fleets)
        report.sections.append(("server logs (tail) and replication status", text))
    return report


def _drop_namespace(url: str, namespace: str) -> None:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
        keys = list(client.scan_iter(match="{" + namespace + "}:*"))
        if keys:
            client.delete(*keys)
        client.close()
    except redis.RedisError:
        pass  # a throwaway server that is gone already


@pytest.fixture
def fleet_factory(
    request: pytest.FixtureRequest, redis_url: str, tmp_path: Path
) -> Iterator[FleetFactory]:
    """``make(redis_url=..., namespace=..., snapshot_interval_seconds=..., env=...)`` -> a new
    ``Fleet`` (no process started yet) on a namespace of its own unless one is given."""
    fleets: list[Fleet] = []
    request.node.e2e_fleets = fleets

    def make(*, redis_url: str = redis_url, namespace: str | None = None, **options: Any) -> Fleet:
        ns = namespace or f"e2e-{uuid.uuid4().hex[:12]}"
        fleet = Fleet(redis_url, ns, tmp_path / "logs", **options)
        fleets.append(fleet)
        return fleet

    try:
        yield make
    finally:
        for fleet in fleets:
            fleet.close()
        for fleet in fleets:
            _drop_namespace(fleet.redis_url, fleet.namespace)


@pytest.fixture
def fleet(fleet_factory: FleetFactory) -> Fleet:
    """Three ready instances on the shared test Redis, on a namespace of their own."""
    f = fleet_factory()
    f.spawn(3)
    return f


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A throwaway ``redis-server`` (no persistence) that the test may stop and start."""
    binary = os.environ.get("SLOT_TRACKER_TEST_REDIS_SERVER") or shutil.which("redis-server")
    if not binary:
        pytest.fail("no redis-server binary: set SLOT_TRACKER_TEST_REDIS_SERVER or PATH")
    server = RedisServer(binary, free_port())
    server.start()
    try:
        yield server
    finally:
        server.cleanup()
