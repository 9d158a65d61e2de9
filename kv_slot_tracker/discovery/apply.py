"""The discovered workers applied to the service, through its topology commands.

A wanted worker is upserted (``/upsert``: registered, or its ranks replaced), one no longer
wanted is unregistered (``/unregister``: with its requests), so each change leaves as the
replica records of those calls and every instance applies it. A selection worker
(``Worker.api``) is put in the selection API's catalog instead (``POST /selection/workers``,
``DELETE /selection/workers/{id}``), replicated likewise. Only the workers this applier
registered are ever removed: one registered by a client stays until that client removes it.
With worker leases (``worker_ttl_seconds``), :meth:`Applier.renew` renews the workers it
holds, as their heartbeat would.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from kv_slot_tracker.core.errors import TrackerError
from kv_slot_tracker.core.selection.catalog import SCHEDULABLE, WorkerSpec
from kv_slot_tracker.core.selection.errors import CatalogWorkerNotFound
from kv_slot_tracker.discovery.endpoints import DiscoveredSet, Worker, WorkerKey
from kv_slot_tracker.service import SlotTrackerService, commands
from kv_slot_tracker.service.errors import ServiceError, UnknownWorker
from kv_slot_tracker.service.selection import commands as selection_commands
from kv_slot_tracker.service.selection.service import SelectionService

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ApplyCounters:
    upserts: int = 0  # upserts that registered a worker or changed its ranks
    removals: int = 0  # discovered workers unregistered
    rejected: int = 0  # upserts the service refused (block size, capacity, trackers)
    incomplete: int = 0  # selection workers put in the catalog but not schedulable (why: logged)


class Applier:
    def __init__(
        self, service: SlotTrackerService, selection: SelectionService | None = None
    ) -> None:
        self.service = service
        self.selection = selection
        self.applied: dict[WorkerKey, Worker] = {}
        self.counters = ApplyCounters()

    def apply(
        self, discovered: DiscoveredSet, touched: Iterable[WorkerKey], *, force: bool = False
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
        if w.api == "selection":
            self._put_selection(key, w)
            return
        try:
            created = self.service.upsert(
                commands.Upsert(
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

    def _put_selection(self, key: WorkerKey, w: Worker) -> None:
        if self.selection is None:
            self.counters.rejected += 1
            log.warning("discovery: worker %d (pod %s): no selection API here", w.worker_id, w.pod)
            return
        kv_events = {str(rank): address for rank, address in w.kv_events}
        record = self.selection.upsert_worker(
            selection_commands.UpsertWorker(
                spec=WorkerSpec(
                    worker_id=w.worker_id,
                    model_name=w.model_name,
                    routing_group=w.routing_group,
                    endpoint=w.endpoint,
                    kv_events_endpoints=kv_events or None,
                    # one rank: the reference's field; several: one socket per rank
                    replay_endpoint=w.replay[0] if len(w.replay) == 1 else None,
                    replay_endpoints=w.replay if len(w.replay) > 1 else None,
                    block_size=w.block_size,
                    data_parallel_start_rank=w.dp_start,
                    data_parallel_size=w.dp_size,
                )
            )
        )
        have = self.applied.get(key)
        self.applied[key] = w
        if have is not None and w.same_ranks(have):
            return
        self.counters.upserts += 1
        if record.lifecycle == SCHEDULABLE:
            log.info(
                "discovery: selection worker %d (pod %s) of model=%s routing_group=%s at %s, "
                "KV events %s",
                w.worker_id, w.pod, w.model_name, w.routing_group, w.endpoint,
                ", ".join(a for _, a in w.kv_events) or "none",
            )  # fmt: skip
        else:
            self.counters.incomplete += 1
            log.warning(
                "discovery: selection worker %d (pod %s) of model=%s routing_group=%s is %s: %s",
                w.worker_id, w.pod, w.model_name, w.routing_group, record.lifecycle,
                "; ".join(record.reasons),
            )  # fmt: skip

    def _remove(self, key: WorkerKey, w: Worker) -> None:
        del self.applied[key]
        (model_name, routing_group), worker_id = key
        if w.api == "selection":
            if self.selection is None:
                return
            try:
                self.selection.delete_worker(selection_commands.DeleteWorker(worker_id=worker_id))
            except CatalogWorkerNotFound:
                return  # already gone (a client, another instance's discovery)
            self.counters.removals += 1
            log.info("discovery: selection worker %d (pod %s) removed", worker_id, w.pod)
            return
        try:
            self.service.unregister(
                commands.Unregister(
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
        for key, w in list(self.applied.items()):
            if w.api == "selection":
                continue  # the catalog has no leases
            (model_name, routing_group), worker_id = key
            try:
                self.service.heartbeat(
                    commands.Heartbeat(
                        model_name=model_name, routing_group=routing_group, worker_id=worker_id
                    )
                )
            except UnknownWorker:
                del self.applied[key]
