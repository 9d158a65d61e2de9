"""Worker leases: the lease book, and the service renewing, keeping and expiring workers.

Time is a ``FakeClock``: ttl 30 s, renewals and sweeps at exact instants.
"""

from __future__ import annotations

import pytest

from kv_slot_tracker.core.types import NS_PER_S, WorkerDpRange
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service import commands as c
from kv_slot_tracker.service.errors import UnknownWorker
from kv_slot_tracker.service.leases import Leases
from tests.fakes import FakeClock

TTL = 30
K = ("m", "default")


def test_the_book_expires_each_lease_once_at_its_deadline() -> None:
    book = Leases(TTL * NS_PER_S)
    book.renew(K, 1, 0)
    book.renew(K, 2, 10 * NS_PER_S)
    book.renew(K, 1, 20 * NS_PER_S)  # renewed: its first deadline is stale
    assert book.due(30 * NS_PER_S - 1) == []
    assert book.due(30 * NS_PER_S) == []  # worker 1's old deadline, superseded
    assert book.due(40 * NS_PER_S) == [(K, 2)]
    assert book.due(40 * NS_PER_S) == []
    book.renew(K, 1, 5 * NS_PER_S)  # a late (replayed) renewal never shortens a lease
    assert book.deadline(K, 1) == 50 * NS_PER_S
    book.forget(K, 1)
    assert book.due(100 * NS_PER_S) == [] and len(book) == 0


def test_off_means_no_lease() -> None:
    book = Leases(0)
    book.renew(K, 1, 0)
    assert not book.enabled and len(book) == 0 and book.due(10**18) == []


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def service(clock: FakeClock, ttl: int = TTL) -> SlotTrackerService:
    return SlotTrackerService(clock=clock.now, worker_ttl_seconds=ttl)


def reg(worker_id: int, dp_size: int = 1) -> c.Register:
    return c.Register(model_name="m", worker_id=worker_id, block_size=4, dp_size=dp_size)


def workers(svc: SlotTrackerService) -> list[int]:
    return sorted({row["worker_id"] for row in svc.workers(None, None)})


def test_a_worker_not_renewed_is_unregistered_with_its_requests(clock: FakeClock) -> None:
    svc = service(clock)
    svc.register(reg(1, dp_size=2))
    svc.register(reg(2))
    svc.add(c.Add(model_name="m", request_id="r", worker_id=1, dp_rank=1, sequence_hashes=[7]))
    clock.advance(20)
    svc.heartbeat(c.Heartbeat(model_name="m", worker_id=2))
    clock.advance(10)  # worker 1: 30 s since it registered
    assert svc.expire_leases() == [(K, 1)]
    assert workers(svc) == [2]
    assert not svc.tracker(K).has_request("r")
    clock.advance(19.999)
    assert svc.expire_leases() == []
    clock.advance(0.001)
    assert svc.expire_leases() == [(K, 2)]
    assert workers(svc) == [] and K not in svc.trackers  # the last worker took the tracker
    assert svc.registry.workers_expired == 2


def test_upsert_and_reconcile_renew_and_unregister_forgets(clock: FakeClock) -> None:
    svc = service(clock)
    svc.register(reg(1))
    svc.register(reg(2))
    svc.register(reg(3))
    clock.advance(25)
    svc.upsert(c.Upsert(model_name="m", worker_id=1, block_size=4))  # unchanged: still renews
    svc.reconcile(
        c.Reconcile(
            model_name="m", block_size=4, workers=[WorkerDpRange(2, 0, 1), WorkerDpRange(1, 0, 1)]
        )
    )
    assert svc.registry.leases.deadline(K, 3) is None  # removed by the reconcile
    clock.advance(29)
    assert svc.expire_leases() == []
    svc.unregister(c.Unregister(model_name="m", worker_id=2))
    clock.advance(1)
    assert svc.expire_leases() == [(K, 1)]
    assert workers(svc) == []


def test_heartbeat_of_an_unknown_worker_is_refused(clock: FakeClock) -> None:
    svc = service(clock)
    with pytest.raises(UnknownWorker):
        svc.heartbeat(c.Heartbeat(model_name="m", worker_id=1))
    svc.register(reg(1))
    with pytest.raises(UnknownWorker):
        svc.heartbeat(c.Heartbeat(model_name="m", worker_id=2))


def test_without_a_ttl_workers_stay(clock: FakeClock) -> None:
    svc = service(clock, ttl=0)
    svc.register(reg(1))
    svc.heartbeat(c.Heartbeat(model_name="m", worker_id=1))  # accepted, changes nothing
    clock.advance(10**6)
    assert svc.expire_leases() == [] and workers(svc) == [1]
