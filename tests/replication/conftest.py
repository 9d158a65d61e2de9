"""Fixtures for replication tests (helpers live in ``tests/replication/helpers.py``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis

from tests.ports import free_port
from tests.replication.helpers import Clocks, Cluster, RedisServer


@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


@pytest.fixture
async def cluster(redis_url: str, redis_namespace: str, clocks: Clocks) -> AsyncIterator[Cluster]:
    c = Cluster(redis_url, redis_namespace, clocks)
    try:
        yield c
    finally:
        await c.close()
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match="{" + redis_namespace + "}:*"))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture
def redis_server() -> Any:
    binary = os.environ.get("SLOT_TRACKER_TEST_REDIS_SERVER") or shutil.which("redis-server")
    if not binary:
        pytest.fail("no redis-server binary: set SLOT_TRACKER_TEST_REDIS_SERVER or PATH")
    server = RedisServer(binary, free_port())
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def namespace(redis_url: str, redis_namespace: str) -> Any:
    """A namespace of its own on the shared test Redis, emptied at teardown."""
    try:
        yield redis_namespace
    finally:
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match="{" + redis_namespace + "}:*"))
        if keys:
            client.delete(*keys)
        client.close()
