"""Fixtures shared by every test directory.

Tests that need Redis request ``redis_url``; ``scripts/with_redis.sh`` (run by ``make test``)
provides one through ``SLOT_TRACKER_TEST_REDIS_URL``. A missing or unreachable server is a
failure, not a skip, so a broken setup can never pass silently.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

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


# Under pytest-xdist (``make test`` runs ``-n CORES+1 --dist loadgroup``) the tests of one group run
# on one worker, one after another, while the other workers run the rest. A group holds the
# tests that start many processes at once and whose outcome depends on those getting the CPU in
# time (Redis Sentinel failovers with a 1 s down-after, a Cluster, several service processes),
# so that two of them never compete with each other. Every other test module is a unit of its
# own, so its module-scoped servers start once. Ports are safe in any case (tests/ports.py).
GROUPS = {
    "ha": "redis-ha",  # Sentinel, TLS, Cluster: a dozen redis-server processes each
    "e2e": "processes",  # several service processes and their own redis-server
    "browser": "browser",  # one headless Chromium per module
}
TESTS = Path(__file__).resolve().parent


def work_unit(nodeid: str) -> str:
    """What xdist sends to one worker as a whole: ``name@group`` (an ``xdist_group`` mark, where
    xdist still appends it) goes with its group, a test of a grouped directory with the
    directory's group, any other test with its module."""
    at, bracket = nodeid.rfind("@"), nodeid.rfind("]")
    if at > bracket:
        return nodeid[at + 1 :]
    path = nodeid.split("::", 1)[0]
    parts = Path(path).parts
    if len(parts) > 2 and parts[0] == TESTS.name and parts[1] in GROUPS:
        return GROUPS[parts[1]]
    return path


# The longest units (a minute or more on 2 busy cores), handed out first so that they do not
# start last and run alone at the end; the other tests follow in their order.
LONG_UNITS = (
    "processes",
    "redis-ha",
    "tests/test_packaging.py",  # builds the sdist and wheel, installs them into new virtualenvs
    "tests/test_typecheck.py",  # mypy; minutes without its cache (a fresh clone)
    "browser",
    "tests/loadtest/test_locust.py",
    "tests/test_dockerfile.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # (a worker has its dist set to "no" and xdist's loadgroup flag set instead)
    if not getattr(config.option, "loadgroup", False):
        return
    order = {unit: i for i, unit in enumerate(LONG_UNITS)}
    items.sort(key=lambda item: order.get(work_unit(item.nodeid), len(order)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` by ``work_unit`` (xdist's own loadgroup reads the group from the
    node id, which pytest 9 no longer lets a plugin change), in collection order."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # (by test count, not by length)

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return Units(config, log)
