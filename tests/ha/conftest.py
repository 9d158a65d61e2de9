"""Fixtures for Redis as it runs in production (``tests/ha/topology.py``): every server these
tests start is killed at teardown, whatever happened; a failing test's report carries the
service logs and the Redis logs."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.servers import Fleet, ProxyThread
from tests.ha.topology import LocalCluster, SentinelGroup


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    report = yield
    if report.failed and report.when in ("setup", "call"):
        parts = [f"{f.statuses()}\n{f.log_tails()}" for f in getattr(item, "ha_fleets", [])]
        for group in getattr(item, "ha_redis", []):
            for p in [*getattr(group, "servers", []), *getattr(group, "sentinels", []),
                      *getattr(group, "nodes", [])]:  # fmt: skip
                parts.append(f"---- {p.name} (port {p.port}):\n{p.log_tail()}")
        if parts:
            report.sections.append(("service and Redis logs (tail)", "\n".join(parts)))
    return report


def redis_binary() -> str:
    binary = os.environ.get("SLOT_TRACKER_TEST_REDIS_SERVER") or shutil.which("redis-server")
    if not binary:
        pytest.fail("no redis-server binary: set SLOT_TRACKER_TEST_REDIS_SERVER or PATH")
    return binary


@pytest.fixture
def sentinel_group(request: pytest.FixtureRequest) -> Iterator[SentinelGroup]:
    """A primary, one replica and three Sentinels, started; the replica replicates through
    ``group.link`` (a proxy the test can cut: a replication link that breaks)."""
    group = SentinelGroup(redis_binary())
    request.node.ha_redis = [group]
    proxies: list[ProxyThread] = []

    def link(port: int) -> int:
        proxies.append(ProxyThread(port))
        return int(proxies[-1].url.rsplit(":", 1)[1].split("/")[0])

    try:
        group.start(link)
        group.link = proxies[0]
        yield group
    finally:
        group.close()
        for p in proxies:
            p.close()


@pytest.fixture
def local_cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("no redis-cli to create a cluster with")
    cluster = LocalCluster(redis_binary(), cli)
    request.node.ha_redis = [cluster]
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def fleets(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[Fleet]]:
    """Fleets the test appends; every process killed at teardown."""
    made: list[Fleet] = []
    request.node.ha_fleets = made
    try:
        yield made
    finally:
        for fleet in made:
            fleet.close()
