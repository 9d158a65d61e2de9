"""Worker discovery (Kubernetes EndpointSlices) as series, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kv_slot_tracker.discovery.kubernetes import KubernetesDiscovery


class DiscoveryCollector(Collector):
    """Kubernetes discovery: the workers it holds, its lists, watches and what it skipped."""

    def __init__(self, discovery: KubernetesDiscovery) -> None:
        self.discovery = discovery

    def collect(self) -> Iterator[Metric]:
        d = self.discovery
        c, a = d.counters, d.applier.counters
        for name, value, doc in (
            ("workers", len(d.applier.applied), "Workers registered by discovery and held now"),
            ("synced", int(d.synced), "1 while the last list or watch of the API server succeeded"),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(f"kv_slot_tracker_discovery_{name}", doc)
            gauge.add_metric([], value)
            yield gauge
        for name, value, doc in (
            ("lists", c.lists, "Full lists of the EndpointSlices (the first one and each start-over)"),
            ("watches", c.watches, "Watches of the EndpointSlices opened (again after each end)"),
            ("events", c.events, "EndpointSlice changes received by the watch"),
            ("errors", c.errors, "List or watch calls that failed (retried after a backoff)"),
            ("invalid_slices", c.invalid_slices,
             "Slices without a name and watch lines that are no event, skipped"),
            ("invalid_endpoints", c.invalid_endpoints,
             "Endpoints skipped: bad kv-slot-tracker/ labels or settings, no pod name or ordinal"),
            ("over_cap", d.discovered.over_cap,
             "Workers skipped because discovery_kubernetes_max_workers were held"),
            ("upserts", a.upserts, "Workers registered or given new ranks by discovery"),
            ("removals", a.removals, "Workers unregistered because their endpoint went or was not ready"),
            ("rejected", a.rejected, "Discovered workers the service refused (block size, capacity)"),
        ):  # fmt: skip
            counter = CounterMetricFamily(f"kv_slot_tracker_discovery_{name}", doc)
            counter.add_metric([], value)
            yield counter


def watch_discovery(registry: CollectorRegistry, discovery: KubernetesDiscovery) -> None:
    registry.register(DiscoveryCollector(discovery))
