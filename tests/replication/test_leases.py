"""Worker leases across instances on a real Redis: a renewal on one instance keeps the worker on
every instance, and a lease that runs out removes the worker everywhere, with its requests."""

from __future__ import annotations

import pytest

from kv_slot_tracker.service import commands as c
from tests.calls import register
from tests.replication.helpers import KEY, Cluster, eventually

pytestmark = pytest.mark.redis

TTL = 30


def worker_ids(node) -> list[int]:
    return sorted({w["worker_id"] for w in node.service.workers(None, None)})


async def test_renewals_travel_and_expiry_is_replicated(cluster: Cluster) -> None:
    a = await cluster.node(worker_ttl_seconds=TTL)
    b = await cluster.node(worker_ttl_seconds=TTL)
    register(a.service, KEY, 1, 16, 0, 1)
    register(a.service, KEY, 2, 16, 0, 1)
    a.add("r1", worker_id=1)
    await eventually(lambda: worker_ids(b) == [1, 2], what="the registrations on b")
    await eventually(lambda: b.service.tracker(KEY).has_request("r1"), what="the add on b")

    cluster.clocks.advance(20)
    a.service.heartbeat(c.Heartbeat(model_name=KEY[0], routing_group=KEY[1], worker_id=1))
    await eventually(
        lambda: (
            b.service.registry.leases.deadline(KEY, 1) == a.service.registry.leases.deadline(KEY, 1)
        ),
        what="the renewal on b",
    )
    cluster.clocks.advance(10)  # worker 2: 30 s since it registered; worker 1 renewed at 20
    assert b.service.expire_leases() == [(KEY, 2)]
    await eventually(lambda: worker_ids(a) == [1], what="b's expiry to reach a")
    assert a.service.expire_leases() == []  # a has nothing left to expire: b's record did it

    cluster.clocks.advance(20)  # worker 1: 30 s since its renewal
    assert a.service.expire_leases() == [(KEY, 1)]
    await eventually(lambda: worker_ids(b) == [], what="a's expiry to reach b")
    assert KEY not in b.service.trackers and KEY not in a.service.trackers
    assert a.service.registry.workers_expired == 1 and b.service.registry.workers_expired == 1
