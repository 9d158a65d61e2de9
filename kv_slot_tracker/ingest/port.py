"""The seam between the KV-event ingest and the selection service, and the ingest's counters."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Protocol

from kv_slot_tracker.core.selection.kv_index import KvIndex

from .records import KvBatch


@dataclass(frozen=True, slots=True)
class Subscription:
    """One worker rank's event source, as the worker registered it."""

    endpoint: str
    """The engine's ZMQ PUB address (``kv_events_endpoint(s)``)."""
    replay_endpoint: str | None
    """The engine's ZMQ ROUTER address serving missed batches, when it has one."""
    epoch: int
    """Changes when the worker leaves and comes back: its listener then starts afresh."""
    ranks: range = range(0, 1 << 32)
    """The worker's dp ranks: a batch naming another rank is rejected (counted)."""


RankKey = tuple[int, int]
"""``(worker_id, dp_rank)``."""


class KvEventSink(Protocol):
    """What the ingest needs of the selection service."""

    @property
    def kv_subscriptions_version(self) -> int:
        """Changes whenever ``kv_subscriptions`` may have changed (read every poll, O(1))."""
        ...

    def kv_subscriptions(self) -> dict[RankKey, Subscription]:
        """The ranks whose events the index wants: every rank of every schedulable worker,
        when KV events are on (empty when off)."""
        ...

    def apply_kv_batch(self, worker_id: int, dp_rank: int, batch: KvBatch) -> None:
        """Apply one decoded batch published on the socket of ``(worker_id, dp_rank)``."""
        ...

    def clear_kv_rank(self, worker_id: int, dp_rank: int) -> None:
        """Forget what the rank holds (its events were lost)."""
        ...

    @property
    def stores_refused(self) -> int:
        """Stores the index refused so far (parent unknown on the rank, or a hash repeated)."""
        ...


PartitionKey = tuple[str, str]
"""``(model_name, routing_group)``."""


@dataclass(frozen=True, slots=True)
class IndexedPartition:
    """One partition's KV-event index, as peer recovery reads and fills it."""

    block_size: int
    index: KvIndex
    ranks: Mapping[int, range]
    """The ranks of each worker schedulable in the partition (worker id -> ranks)."""


class KvIndexHost(Protocol):
    """What peer recovery (``kv_slot_tracker.ingest.peers``) needs of the selection service."""

    def kv_partitions(self) -> dict[PartitionKey, IndexedPartition]:
        """Every partition's index (built afresh on each call, O(partitions + workers))."""
        ...


@dataclass(slots=True)
class IngestCounters:
    """Totals since start (read by the metrics at scrape time)."""

    batches: int = 0
    """Batches applied (live and replayed)."""
    bytes: int = 0
    """Bytes of the live messages received (all frames; what libzmq may have queued)."""
    events: int = 0
    """Events in those batches."""
    malformed: int = 0
    """Messages skipped because they did not decode (wrong framing, msgpack, event shape)."""
    stale: int = 0
    """Batches skipped because their sequence number was not above the last one applied."""
    gaps: int = 0
    """Sequence gaps seen (including a first batch after sequence 0 was missed)."""
    replays: int = 0
    """Gaps answered by the engine's replay socket."""
    replayed_batches: int = 0
    """Batches received through replays."""
    gaps_lost: int = 0
    """Gaps that could not be replayed: the rank's index was cleared."""
    restarts: int = 0
    """Publishers seen starting again at sequence 0: the rank's index was cleared."""
    heap_trims: int = 0
    """Free C-heap pages handed back after a burst of messages drained (``gc_tuning``)."""
    reconnects: int = 0
    """SUB connections libzmq dropped for good (an oversized or broken message) and the
    listener connected again."""
    applied: Counter[str] = field(default_factory=Counter)
    """Events handed to the index, by type (``stored``, ``removed``, ``cleared``), and the
    stores it refused (``stored_refused``)."""
    warnings: Counter[str] = field(default_factory=Counter)
    """Suspicious messages and stream events, by kind (``WARNING_KINDS``)."""

    def as_dict(self) -> dict[str, int]:
        """The plain totals (the per-kind counts are read from ``applied`` and ``warnings``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.type == "int"}


WARNING_KINDS = {
    "malformed_frames": "a live message without the three frames (topic, seq, payload)",
    "malformed_seq": "a sequence-number frame that is not 8 bytes",
    "malformed_payload": "a payload that does not decode (msgpack, batch or event shape)",
    "dp_rank_out_of_range": "a batch naming a dp rank the worker does not have (rejected)",
    "batch_too_large": "a batch carrying more blocks than kv_events_max_batch_blocks (rejected)",
    "seq_out_of_line": "a sequence number far from the stream's (held until the next confirms it)",
    "stale": "a batch at or below the last sequence number applied (skipped)",
    "gap": "a sequence gap (batches missed)",
    "replay_incomplete": "a gap the replay socket did not fill, or no replay endpoint",
    "gap_cleared": "a rank cleared after a lost gap (kv_events_gap_policy clear)",
    "publisher_restart": "a publisher starting again at sequence 0 (the rank is cleared)",
    "connection_dropped": "a SUB connection libzmq dropped for good (reconnected)",
}
"""Every ``warning_kind`` of ``kv_cache_event_warnings`` (all exported, zeros included)."""
