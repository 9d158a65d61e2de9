"""The service's exported series (``series.py``), scraped once per test session for the
dashboard's and the alert rules' checks."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis

from tests.deploy.series import (
    Exported,
    discovery_page,
    memory_limit_page,
    scrape_embedded,
    scrape_replicated,
    unreachable_page,
)


@pytest.fixture(scope="session")
def replicated(redis_url: str) -> Exported:
    """Two replicated instances with traffic and a KV listener, an instance with discovery, one
    without its Redis, and the memory limit under a cgroup limit."""
    namespace = f"test-series-{uuid.uuid4().hex}"
    try:
        exported = asyncio.run(scrape_replicated(redis_url, namespace))
    finally:
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match="{" + namespace + "}:*"))
        if keys:
            client.delete(*keys)
        client.close()
    exported.add_page(discovery_page())
    exported.add_page(unreachable_page())
    exported.add_page(memory_limit_page())
    return exported


@pytest.fixture(scope="session")
def embedded() -> Exported:
    return asyncio.run(scrape_embedded())
