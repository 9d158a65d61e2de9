"""KV events into the selection service's partition indexes: the ingest's sink
(``kv_slot_tracker.ingest.port.KvEventSink``), and the indexes as peer recovery reads and fills
them (``KvIndexHost``).

``KvEvents`` knows the placed workers only through the service's public reads
(``PlacedWorkers``); the service tells it when a worker is placed or leaves, which changes the
subscriptions the ingest wants.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from kv_slot_tracker.core.selection.catalog import WorkerSpec
from kv_slot_tracker.core.selection.kv_blocks import local_hashes
from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.ingest.normalize import EventNormalizer
from kv_slot_tracker.ingest.port import IndexedPartition, RankKey, Subscription
from kv_slot_tracker.ingest.records import AllCleared, BlocksRemoved, BlocksStored, KvBatch
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.selection.types import Partition


class PlacedWorkers(Protocol):
    """What the KV events need of the selection service."""

    @property
    def partitions(self) -> Mapping[Key, Partition]: ...

    def placed_partition(self, worker_id: int) -> Partition | None:
        """The partition ``worker_id`` is a schedulable worker of, if any."""
        ...


class KvEvents:
    def __init__(self, workers: PlacedWorkers, *, enabled: bool) -> None:
        self._workers = workers
        self.enabled = enabled
        self._version = 0  # bumped whenever the wanted subscriptions may change
        self._epochs: dict[int, int] = {}  # worker id -> times it left its partition
        self.stores_refused = 0
        """KV-event stores skipped: parent unknown on the rank, or a hash repeated."""
        self.unrouted = 0
        """KV events for a worker or rank that is not (or no longer) schedulable here."""
        self.filtered = 0
        """KV events skipped for their KV cache group or an ambiguous cache salt."""
        # (worker id, socket rank) -> what the reference's listener remembers of its events
        self._normalizers: dict[RankKey, EventNormalizer] = {}
        self.storing_hook: Callable[[Partition, WorkerWithDpRank, list[int]], None] | None = None
        """Told of every store just before it is applied (the rank and its blocks' local
        hashes): routing receipts check there whether the blocks a selection counted on were
        still held when the rank stored the rest of the prompt."""

    # -- the service's notices -------------------------------------------------------------

    def worker_placed(self) -> None:
        """A worker was placed or re-ranged: its subscriptions may have changed."""
        self._version += 1

    def worker_left(self, worker_id: int) -> None:
        """A worker left its partition: a later return subscribes it afresh."""
        self._version += 1
        self._epochs[worker_id] = self._epochs.get(worker_id, 0) + 1
        for key in [k for k in self._normalizers if k[0] == worker_id]:
            del self._normalizers[key]

    # -- the ingest's sink -----------------------------------------------------------------

    @property
    def kv_subscriptions_version(self) -> int:
        return self._version

    def kv_subscriptions(self) -> dict[RankKey, Subscription]:
        """Every rank of every schedulable worker and its engine's publisher (KV events on)."""
        if not self.enabled:
            return {}
        out: dict[RankKey, Subscription] = {}
        for part in self._workers.partitions.values():
            for wid, spec in part.workers.items():
                endpoints = kv_endpoints(spec)
                epoch = self._epochs.get(wid, 0)
                ranks = range(spec.dp_start, spec.dp_start + spec.dp_size)
                for rank in ranks:
                    endpoint = endpoints.get(rank)
                    if endpoint:
                        # each rank asks its own replay socket (``replay_endpoints``), or the
                        # one ``replay_endpoint`` of a worker of one rank
                        replay = spec.replay_for(rank)
                        out[wid, rank] = Subscription(endpoint, replay, epoch, ranks)
        return out

    def apply_kv_batch(self, worker_id: int, dp_rank: int, batch: KvBatch) -> None:
        """One engine batch into the worker's partition index, in one synchronous call. The
        batch's own ``data_parallel_rank`` wins over the socket's rank (as the reference)."""
        part = self._workers.placed_partition(worker_id)
        if part is None:
            self.unrouted += len(batch.events)
            return
        # the batch's rank is indexed even when the worker did not declare it (as the
        # reference); it is listed by /overlap_scores but is no candidate
        rank_no = dp_rank if batch.dp_rank is None else batch.dp_rank
        rank = WorkerWithDpRank(worker_id, rank_no)
        normalizer = self._normalizers.get((worker_id, dp_rank))
        if normalizer is None:
            normalizer = self._normalizers[worker_id, dp_rank] = EventNormalizer()
        index, bs = part.index, part.block_size
        for raw in batch.events:
            ev = normalizer.normalize(raw, rank_no)
            if ev is None:
                self.filtered += 1
            elif isinstance(ev, BlocksStored):
                locals_ = local_hashes(
                    ev.token_ids, ev.block_size, len(ev.block_hashes), bs, ev.lora_name,
                    ev.cache_salt, ev.eagle,
                )  # fmt: skip
                blocks = list(zip(ev.block_hashes, locals_, strict=False))
                if self.storing_hook is not None and locals_:
                    self.storing_hook(part, rank, locals_)
                if not index.store(rank, ev.tier, ev.parent_hash, blocks):
                    self.stores_refused += 1
            elif isinstance(ev, BlocksRemoved):
                index.remove(rank, ev.tier, ev.block_hashes)
            elif isinstance(ev, AllCleared):
                index.clear_rank(rank)

    def clear_kv_rank(self, worker_id: int, dp_rank: int) -> None:
        """The listener's own clear (a publisher restarting from sequence 0, a gap cleared):
        the runs nobody holds then are dropped, so the engine's new hashes for the same tokens
        index again (``KvIndex.clear_rank``)."""
        part = self._workers.placed_partition(worker_id)
        if part is not None:
            part.index.clear_rank(WorkerWithDpRank(worker_id, dp_rank), prune=True)

    def kv_indexed_blocks(self) -> dict[Key, int]:
        return {key: len(part.index) for key, part in self._workers.partitions.items()}

    def kv_partitions(self) -> dict[Key, IndexedPartition]:
        """Every partition's index and schedulable ranks (peer recovery: ``KvIndexHost``)."""
        return {
            key: IndexedPartition(
                part.block_size,
                part.index,
                {w: range(s.dp_start, s.dp_start + s.dp_size) for w, s in part.workers.items()},
            )
            for key, part in self._workers.partitions.items()
        }


def kv_endpoints(spec: WorkerSpec) -> dict[int, str]:
    """The rank -> publisher map of a worker, as the reference reads it: ``kv_events_endpoints``
    when non-empty (keys are ranks), else ``kv_events_endpoint`` for a worker of one rank."""
    if spec.kv_events_endpoints:
        out = {}
        for rank, endpoint in spec.kv_events_endpoints.items():
            try:
                out[int(rank)] = endpoint
            except ValueError:
                continue
        return out
    if spec.dp_size == 1 and spec.kv_events_endpoint is not None:
        return {spec.dp_start: spec.kv_events_endpoint}
    return {}
