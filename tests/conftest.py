"""Fixtures shared by every test directory.

Tests that need Redis request ``redis_url``; ``scripts/with_redis.sh`` (run by ``make test``)
provides one through ``SLOT_TRACKER_TEST_REDIS_URL``. A missing or unreachable server is a
failure, not a skip, so a broken setup can never pass silently.
"""

from __future__ import annotations

import os
import uuid

import pytest
import redis

REDIS_URL_ENV = "SLOT_TRACKER_TEST_REDIS_URL"

# The suites written for the selection API's approximate cache (KV events off) run in that mode:
# every app and server process the tests build reads this setting unless it is given explicitly.
# Tests of the KV-events mode pass router_use_kv_events=True (an explicit setting wins over the
# environment) or set the variable in their child's environment.
os.environ.setdefault("SLOT_TRACKER_ROUTER_USE_KV_EVENTS", "false")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """URL of a Redis server the tests may write to (keys under ``redis_namespace``)."""
    url = os.environ.get(REDIS_URL_ENV, "")
    if not url:
        pytest.fail(
            f"{REDIS_URL_ENV} is not set: run the tests with `make test` "
            f"(or scripts/with_redis.sh CMD), or export {REDIS_URL_ENV}=redis://HOST:PORT/DB",
            pytrace=False,
        )
    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis at {REDIS_URL_ENV}={url} is unreachable: {exc}", pytrace=False)
    finally:
        client.close()
    return url


@pytest.fixture
def redis_namespace() -> str:
    """A namespace no other test uses, so tests sharing one Redis never see each other's keys."""
    return f"test-{uuid.uuid4().hex}"
