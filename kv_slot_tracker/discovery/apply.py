"""The discovered workers applied to the service, through its topology commands.

A wanted worker is upserted (``/upsert``: registered, or its ranks replaced), one no longer
wanted is unregistered (``/unregister``: with its requests), so each change leaves as the
replica records of those calls and every instance applies it. Only the workers this applier
registered are ever removed: one registered by a client stays until that client removes it.
With worker leases (``worker_ttl_seconds``), :meth:`Applier.renew` renews the workers it
holds, as their heartbeat would.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from kv_slot_tracker.core.errors import TrackerError
from kv_slot_tracker.discovery.endpoints import DiscoveredSet, Worker, WorkerKey
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service import commands as c
from kv_slot_tracker.service.errors import ServiceError, UnknownWorker

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ApplyCounters:
    upserts: int = 0  # upserts that registered a worker or changed its ranks
    removals: int = 0  # discovered workers unregistered
    rejected: int = 0  # upserts the service refused (block size, capacity, trackers)


class Applier:
    def __init__(self, service: SlotTrackerService) -> None:
        self.service = service
        self.applied: dict[WorkerKey, Worker] = {}
        self.counters = ApplyCounters()

    def apply(
        self, discovered: DiscoveredSet, touched: Iterable[WorkerKey], *, force=False
    ) -> None:
        """Make the service hold what ``discovered`` wants for the ``touched`` workers;
        ``force``: upsert a wanted worker even when already applied (after a full list: it may
        have been removed meanwhile by a client or a lease)."""
        for key in sorted(touched):
            want = discovered.wanted(key)
            have = self.applied.get(key)
            if want is None:
                if have is not None:
                    self._remove(key, have)
            elif force or have is None or not want.same_ranks(have):
                self._upsert(key, want)

    def _upsert(self, key: WorkerKey, w: Worker) -> None:
        (model_name, routing_group), worker_id = key
        try:
            created = self.service.upsert(
                c.Upsert(
                    model_name=model_name,
                    routing_group=routing_group,
                    worker_id=worker_id,
                    block_size=w.block_size,
                    dp_start=w.dp_start,
                    dp_size=w.dp_size,
                )
            )
        except (ServiceError, TrackerError) as e:
            self.counters.rejected += 1
            log.warning(
                "discovery: worker %d (pod %s) of model=%s routing_group=%s not registered: %s",
                worker_id, w.pod, model_name, routing_group, e,
            )  # fmt: skip
            return
        have = self.applied.get(key)
        self.applied[key] = w
        if created or have is None or not w.same_ranks(have):
            self.counters.upserts += 1
            log.info(
                "discovery: worker %d (pod %s) of model=%s routing_group=%s registered "
                "(block_size %d, dp ranks %d..%d)",
                worker_id, w.pod, model_name, routing_group, w.block_size,
                w.dp_start, w.dp_start + w.dp_size - 1,
            )  # fmt: skip

    def _remove(self, key: WorkerKey, w: Worker) -> None:
        del self.applied[key]
        (model_name, routing_group), worker_id = key
        try:
            self.service.unregister(
                c.Unregister(
                    model_name=model_name, routing_group=routing_group, worker_id=worker_id
                )
            )
        except UnknownWorker:
            return  # already gone (a client, a lease, another instance's discovery)
        self.counters.removals += 1
        log.info(
            "discovery: worker %d (pod %s) of model=%s routing_group=%s removed: its endpoint "
            "is gone or not ready",
            worker_id, w.pod, model_name, routing_group,
        )  # fmt: skip

    def renew(self) -> None:
        """Renew the lease of every worker held (``worker_ttl_seconds``); one removed meanwhile
        by someone else is let go (a later full list registers it again if still wanted)."""
        for key in list(self.applied):
            (model_name, routing_group), worker_id = key
            try:
                self.service.heartbeat(
                    c.Heartbeat(
                        model_name=model_name, routing_group=routing_group, worker_id=worker_id
                    )
                )
            except UnknownWorker:
                del self.applied[key]
