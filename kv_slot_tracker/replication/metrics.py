"""Prometheus metrics of replication, registered into the app's own registry.

Counters and gauges are read from plain integers at scrape time (the hot path touches no metric
object); only the lag histogram is observed as records are applied. The histogram is registered
first, so the reader can be given it before everything the collector reads exists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kv_slot_tracker.core.types import NS_PER_MS, NS_PER_S
from kv_slot_tracker.replication.port import Batch, OwnReadBack

LAG_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
)  # fmt: skip


# What a party with write access to Redis (or a corrupt record or snapshot) can cause, by the
# reason label of ``kv_slot_tracker_replication_anomalies_total`` and ``/replication``'s
# ``anomalies``: each is detected, counted, logged (rate-limited) and shown as degraded.
ANOMALIES = {
    "seq_jump": "a record whose sequence number lies more than replication_max_seq_jump past "
    "its origin's last applied one (forged or corrupt: rejected, the ledger not moved)",
    "new_origin_gap": "a record of an origin not in the ledger that is not its first, with no "
    "snapshot covering the records before it (applied; no snapshot loaded for it)",
    "origins_evicted": "ledger rows of the longest-silent origins dropped to stay within "
    "replication_max_origins",
    "snapshot_invalid": "a stored snapshot whose stream id is not one or lies beyond the "
    "stream's last generated id (ignored: the stream is read instead)",
    "snapshot_lease_held": "the snapshot lease held longer than a snapshot round (its expiry "
    "cut back to one round)",
    "stream_exhausted": "appends refused: the stream has exhausted the last possible id (an "
    "entry with the largest id was added); see docs/redis-ha.md",
}


@dataclass(slots=True)
class ReplicationCounters:
    published: int = 0  # records appended to the stream
    applied: int = 0  # peers' records handed to the service
    duplicates: int = 0  # records already applied (retried appends, overlap with a snapshot)
    dropped: int = 0  # records refused by a full (or closed) outbox
    gaps: int = 0  # times records were found missing (trimmed away or lost)
    resets: int = 0  # times the stream was found recreated or rolled back
    resent: int = 0  # records appended again after Redis lost them
    malformed: int = 0  # stream entries that were not records (rejected as undecodable)
    last_malformed_ns: int | None = None  # wall time of the newest
    # anomalies by reason (``ANOMALIES``), and the wall time of the newest of each
    anomalies: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ANOMALIES, 0))
    anomaly_at: dict[str, int] = field(default_factory=dict)
    own_skipped: int = 0  # our own records read back
    write_refused: int = 0  # appends Redis refused for lack of memory (maxmemory, noeviction)
    snapshots_written: int = 0
    bootstraps: int = 0

    def anomaly(self, reason: str, wall_ns: int, n: int = 1) -> int:
        """Count ``n`` anomalies of ``reason``; returns how many so far."""
        self.anomalies[reason] = total = self.anomalies.get(reason, 0) + n
        self.anomaly_at[reason] = wall_ns
        return total


_COUNTERS = (
    ("published", "Replica records appended to the Redis stream"),
    ("applied", "Replica records of other instances applied"),
    ("duplicates", "Replica records skipped as already applied"),
    ("dropped", "Replica records dropped because the outbox was full"),
    ("gaps", "Times replica records were found missing from the stream"),
    ("resets", "Times the Redis stream was found recreated or rolled back"),
    ("resent", "Replica records appended again after Redis lost them"),
    ("write_refused", "Appends Redis refused for lack of memory (maxmemory with noeviction)"),
    ("snapshots_written", "State snapshots written to Redis"),
    ("bootstraps", "State loads from a snapshot (start and after a gap)"),
)


class _Collector(Collector):
    def __init__(
        self,
        counters: ReplicationCounters,
        outbox_depth: Callable[[], int],
        connected: Callable[[], bool],
        rejected: Callable[[], dict[str, int]],
    ) -> None:
        self.counters = counters
        self.outbox_depth = outbox_depth
        self.connected = connected
        self.rejected = rejected

    def collect(self) -> Iterator[Metric]:
        for name, doc in _COUNTERS:
            c = CounterMetricFamily(f"kv_slot_tracker_replication_{name}", doc)
            c.add_metric([], getattr(self.counters, name))
            yield c
        rejected = CounterMetricFamily(
            "kv_slot_tracker_replication_records_rejected",
            "Replica records of other instances rejected (skipped), by reason",
            labels=["reason"],
        )
        for reason, count in self.rejected().items():
            rejected.add_metric([reason], count)
        yield rejected
        anomalies = CounterMetricFamily(
            "kv_slot_tracker_replication_anomalies",
            "Replication anomalies detected (forged or corrupt records, snapshots, stream), "
            "by reason",
            labels=["reason"],
        )
        for reason, count in self.counters.anomalies.items():
            anomalies.add_metric([reason], count)
        yield anomalies
        depth = GaugeMetricFamily(
            "kv_slot_tracker_replication_outbox_depth", "Replica records waiting to be published"
        )
        depth.add_metric([], self.outbox_depth())
        yield depth
        up = GaugeMetricFamily(
            "kv_slot_tracker_replication_connected",
            "1 while Redis answers the reader and publisher",
        )
        up.add_metric([], 1 if self.connected() else 0)
        yield up


def lag_histogram(registry: CollectorRegistry) -> Histogram:
    """The one metric observed as records are applied."""
    return Histogram(
        "kv_slot_tracker_replication_lag_seconds",
        "Time from a peer's change (its wall clock) to its application here",
        buckets=LAG_BUCKETS,
        registry=registry,
    )


GROUP_COMMIT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def group_commit_histogram(registry: CollectorRegistry) -> Histogram:
    """``replication_ack = "redis"``: how many waiting calls one append acknowledged."""
    return Histogram(
        "kv_slot_tracker_replication_group_commit_calls",
        "Calls acknowledged by one append to the stream (replication_ack = redis)",
        buckets=GROUP_COMMIT_BUCKETS,
        registry=registry,
    )


def register_collector(
    registry: CollectorRegistry,
    counters: ReplicationCounters,
    outbox_depth: Callable[[], int],
    connected: Callable[[], bool],
    rejected: Callable[[], dict[str, int]],
) -> None:
    """The counters and gauges, read at scrape time (and once now: the registry describes it)."""
    registry.register(_Collector(counters, outbox_depth, connected, rejected))


def count_applied(
    batch: Batch, now_ns: int, counters: ReplicationCounters, observe: Callable[[float], None]
) -> float | None:
    """Count the peers' records of an applied ``batch`` (control messages are not records) and
    observe each one's lag from its producer's time to ``now_ns``; returns the last one's lag
    in ms (None: the batch held no record). For every transport's read path."""
    applied, lag_ns = 0, 0
    for record in batch:
        if isinstance(record, OwnReadBack):
            continue
        applied += 1
        lag_ns = max(0, now_ns - record.ts)
        observe(lag_ns / NS_PER_S)
    counters.applied += applied
    return lag_ns / NS_PER_MS if applied else None
