"""The slot tracker's state as series, read at scrape time (the hot path updates no metric at
all, and the series of a removed rank disappear with it): per rank loads, per partition
counters, and what keeps replicas consistent (early calls, ``/ready``, ``/replication``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kv_slot_tracker.observability.labels import KEY_LABELS, OTHER, RANK_LABELS, short_label
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service.consistency import ConsistencyCounters
from kv_slot_tracker.service.replica import ReplicaRecords

if TYPE_CHECKING:
    from kv_slot_tracker.replication.port import Replication


class TrackerCollector(Collector):
    """The trackers' series. Bounded whatever clients name things: label values at most
    ``max_label_chars`` (``short_label``), at most ``max_rank_series`` per-rank series per
    metric (the ranks beyond it are added up per tracker, ``worker_id="other"``)."""

    def __init__(
        self, service: SlotTrackerService, max_label_chars: int = 128, max_rank_series: int = 8192
    ) -> None:
        self.service = service
        self.max_label_chars = max_label_chars
        self.max_rank_series = max_rank_series

    def collect(self) -> Iterator[Metric]:
        svc = self.service
        cut = self.max_label_chars
        blocks = GaugeMetricFamily(
            "kv_slot_tracker_active_decode_blocks",
            "Active KV blocks per worker rank",
            labels=RANK_LABELS,
        )
        tokens = GaugeMetricFamily(
            "kv_slot_tracker_active_prefill_tokens",
            "Prefill tokens still to compute per worker rank",
            labels=RANK_LABELS,
        )
        requests = GaugeMetricFamily(
            "kv_slot_tracker_active_requests", "Active requests per worker rank", labels=RANK_LABELS
        )
        registered = GaugeMetricFamily(
            "kv_slot_tracker_worker_registered",
            "1 for every registered worker rank (the series goes away with the rank); "
            'worker_id="other": how many ranks beyond the per-rank series bound',
            labels=RANK_LABELS,
        )
        per_key = svc.rank_loads(None, None)
        room = self.max_rank_series
        for (model, group), rows in per_key:
            model, group = short_label(model, cut), short_label(group, cut)
            shown = rows[:room] if len(rows) > room else rows
            room -= len(shown)
            for row in shown:
                labels = [model, group, str(row.worker_id), str(row.dp_rank)]
                blocks.add_metric(labels, row.active_decode_blocks)
                tokens.add_metric(labels, row.active_prefill_tokens)
                requests.add_metric(labels, row.active_requests)
                registered.add_metric(labels, 1)
            if len(shown) < len(rows):  # the rest of this tracker's ranks, added up
                rest = rows[len(shown) :]
                labels = [model, group, OTHER, OTHER]
                blocks.add_metric(labels, sum(r.active_decode_blocks for r in rest))
                tokens.add_metric(labels, sum(r.active_prefill_tokens for r in rest))
                requests.add_metric(labels, sum(r.active_requests for r in rest))
                registered.add_metric(labels, len(rest))
        yield from (blocks, tokens, requests, registered)

        trackers = GaugeMetricFamily(
            "kv_slot_tracker_trackers", "Live (model, routing group) trackers"
        )
        trackers.add_metric([], len(per_key))
        yield trackers

        added = CounterMetricFamily(
            "kv_slot_tracker_requests_added",
            "Requests added (local and replicated)",
            labels=KEY_LABELS,
        )
        freed = CounterMetricFamily(
            "kv_slot_tracker_requests_freed",
            "Requests freed (local and replicated)",
            labels=KEY_LABELS,
        )
        expired = CounterMetricFamily(
            "kv_slot_tracker_requests_expired", "Requests freed by expiry", labels=KEY_LABELS
        )
        for (model, group), c in svc.counters():
            key = [short_label(model, cut), short_label(group, cut)]
            added.add_metric(key, c.added)
            freed.add_metric(key, c.freed)
            expired.add_metric(key, c.expired)
        yield from (added, freed, expired)

        reg = svc.registry
        refused = CounterMetricFamily(
            "kv_slot_tracker_budget_refusals",
            "Calls refused with 503 because they would grow the state past a global budget",
            labels=["budget"],
        )
        for budget, n in sorted(reg.refusals.items()):
            refused.add_metric([budget], n)
        used = GaugeMetricFamily(
            "kv_slot_tracker_budget_used",
            "What the instance holds, per global budget",
            labels=["budget"],
        )
        limit = GaugeMetricFamily(
            "kv_slot_tracker_budget_limit",
            "The global budgets (resident memory in bytes)",
            labels=["budget"],
        )
        usage, budgets = reg.usage, reg.budgets
        for name, count, most in (
            ("active requests", usage.requests, budgets.active_requests),
            ("worker ranks", usage.ranks, budgets.ranks),
            ("block hashes", usage.hashes, budgets.block_hashes),
            ("selection workers", reg.catalog_size(), budgets.selection_workers),
            ("memory", reg.resident() if reg.resident is not None else 0, budgets.memory_bytes),
        ):
            used.add_metric([name], count)
            limit.add_metric([name], most)
        yield from (refused, used, limit)

        leases = svc.registry.leases
        held = GaugeMetricFamily(
            "kv_slot_tracker_worker_leases", "Workers holding a lease (worker_ttl_seconds)"
        )
        held.add_metric([], len(leases))
        lost = CounterMetricFamily(
            "kv_slot_tracker_workers_expired",
            "Workers unregistered by this instance because their lease ran out",
        )
        lost.add_metric([], svc.registry.workers_expired)
        yield from (held, lost)


def watch_service(
    registry: CollectorRegistry,
    service: SlotTrackerService,
    max_label_chars: int = 128,
    max_rank_series: int = 8192,
) -> None:
    """Expose the service's trackers and counters in ``registry`` (read at scrape time)."""
    registry.register(TrackerCollector(service, max_label_chars, max_rank_series))


class ConsistencyCollector(Collector):
    """Replicated mode: lifecycle calls that waited for their add, and early calls kept."""

    def __init__(self, counters: ConsistencyCounters, replica: ReplicaRecords) -> None:
        self.counters = counters
        self.replica = replica

    def collect(self) -> Iterator[Metric]:
        early = self.replica.early
        assert early is not None
        c, e = self.counters, early.counters
        for name, value, doc in (
            ("barrier_waits", c.barrier_waits,
             "Lifecycle calls that waited for the add of a request id unknown here"),
            ("barrier_timeouts", c.barrier_timeouts,
             "Such waits whose read barrier could not be confirmed in time (Redis away)"),
            ("tombstones_created", e.tombstones_created,
             "Frees of ids still unknown after the wait, kept and replicated as tombstones"),
            ("tombstones_applied", e.tombstones_applied,
             "Adds cancelled and active copies freed by a tombstone"),
            ("marks_created", e.marks_created,
             "Prefill completions of ids still unknown after the wait (pending marks)"),
            ("marks_applied", e.marks_applied, "Prefills completed by a pending mark"),
            ("out_of_order", e.out_of_order,
             "Peers' frees and prefill completions of ids not active here, kept for their add"),
            ("early_dropped", e.dropped,
             "Tombstones and pending marks dropped by age or capacity before their add came"),
            ("output_blocks_dropped", c.output_blocks_dropped,
             "Output blocks for ids still unknown after the wait"),
            ("ack_waits", c.ack_waits,
             "replication_ack = redis: calls that waited for their records to reach Redis"),
            ("ack_timeouts", c.ack_timeouts,
             "... answered 503 because Redis did not take them in time (applied here)"),
            ("ack_refused", c.ack_refused,
             "... refused with 503 before applying: Redis known unreachable"),
            ("duplicate_adds", self.replica.duplicate_adds,
             "Adds of an id already active here, resolved by stream order (first add wins)"),
        ):  # fmt: skip
            counter = CounterMetricFamily(f"kv_slot_tracker_consistency_{name}", doc)
            counter.add_metric([], value)
            yield counter
        kept = GaugeMetricFamily(
            "kv_slot_tracker_consistency_early_calls",
            "Tombstones and pending marks kept, waiting for their add",
        )
        kept.add_metric([], len(early))
        yield kept


def watch_consistency(
    registry: CollectorRegistry, counters: ConsistencyCounters, replica: ReplicaRecords
) -> None:
    registry.register(ConsistencyCollector(counters, replica))


class StatusCollector(Collector):
    """What ``/ready`` and ``/replication`` say, as series an alert can watch: whether this
    process may serve, and whether its replication is degraded (and why)."""

    def __init__(self, replication: Replication) -> None:
        self.replication = replication

    def collect(self) -> Iterator[Metric]:
        status = self.replication.status()
        ready = GaugeMetricFamily(
            "kv_slot_tracker_ready",
            "1 while the instance may serve (GET /ready answers 200), 0 while it is catching up "
            "with its peers or cannot reach Redis at start",
        )
        ready.add_metric([], 1.0 if status.ready else 0.0)
        yield ready
        degraded = GaugeMetricFamily(
            "kv_slot_tracker_replication_degraded",
            "1 while GET /replication answers degraded (Redis unreachable, outbox full or "
            "nearly full, replicas not confirming, records dropped or rejected lately), else 0",
        )
        degraded.add_metric([], 1.0 if status.degraded else 0.0)
        yield degraded
        reasons = GaugeMetricFamily(
            "kv_slot_tracker_replication_degraded_reason",
            "1 for each reason GET /replication gives for being degraded (none while it is not)",
            labels=["reason"],
        )
        for reason in dict.fromkeys(status.degraded_reasons):
            reasons.add_metric([reason], 1.0)
        yield reasons


def watch_status(registry: CollectorRegistry, replication: Replication) -> None:
    registry.register(StatusCollector(replication))
