"""Prometheus metrics: HTTP metrics from prometheus-fastapi-instrumentator, and tracker state
read at scrape time by a custom collector (so the hot path updates no metric at all, and the
series of a removed rank disappear with it).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from app.service import SlotTrackerService

RANK_LABELS = ["model_name", "routing_group", "worker_id", "dp_rank"]
KEY_LABELS = ["model_name", "routing_group"]


class TrackerCollector(Collector):
    def __init__(self, service: SlotTrackerService) -> None:
        self.service = service

    def collect(self) -> Iterator:
        svc = self.service
        now = svc.clock()
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
            "1 for every registered worker rank (the series goes away with the rank)",
            labels=RANK_LABELS,
        )
        for (model, group), t in sorted(svc.trackers.items()):
            for w in t.workers():
                labels = [model, group, str(w.worker_id), str(w.dp_rank)]
                slot = t.slots[w]
                blocks.add_metric(labels, t.blocks[w])
                tokens.add_metric(labels, slot.prefill.active_tokens(now))
                requests.add_metric(labels, len(slot.requests))
                registered.add_metric(labels, 1)
        yield from (blocks, tokens, requests, registered)

        trackers = GaugeMetricFamily(
            "kv_slot_tracker_trackers", "Live (model, routing group) trackers"
        )
        trackers.add_metric([], len(svc.trackers))
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
        for (model, group), c in sorted(svc.stats.counters.items()):
            added.add_metric([model, group], c.added)
            freed.add_metric([model, group], c.freed)
            expired.add_metric([model, group], c.expired)
        yield from (added, freed, expired)


def build_registry(service: SlotTrackerService) -> CollectorRegistry:
    """A registry of this app's own (never the process-global one)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(TrackerCollector(service))
    return registry
