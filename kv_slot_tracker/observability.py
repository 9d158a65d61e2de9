"""Prometheus metrics: HTTP metrics from prometheus-fastapi-instrumentator, and tracker and
selection state read at scrape time by custom collectors (so the hot path updates no metric at
all, and the series of a removed rank disappear with it).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import orjson
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from kv_slot_tracker.core.selection.catalog import INCOMPLETE, SCHEDULABLE, UNSCHEDULABLE
from kv_slot_tracker.discovery.kubernetes import KubernetesDiscovery
from kv_slot_tracker.ingest.peers import IndexPeers
from kv_slot_tracker.ingest.zmq import ZmqIngest
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.consistency import ConsistencyCounters
from kv_slot_tracker.service.replica import ReplicaRecords
from kv_slot_tracker.service.selection.kv_events import KvEvents
from kv_slot_tracker.service.selection.service import SelectionService
from kv_slot_tracker.service.selection.types import SELECTION_OUTCOMES

RANK_LABELS = ["model_name", "routing_group", "worker_id", "dp_rank"]
KEY_LABELS = ["model_name", "routing_group"]


class TrackerCollector(Collector):
    def __init__(self, service: SlotTrackerService) -> None:
        self.service = service

    def collect(self) -> Iterator:
        svc = self.service
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
        per_key = svc.rank_loads(None, None)
        for (model, group), rows in per_key:
            for row in rows:
                labels = [model, group, str(row.worker_id), str(row.dp_rank)]
                blocks.add_metric(labels, row.active_decode_blocks)
                tokens.add_metric(labels, row.active_prefill_tokens)
                requests.add_metric(labels, row.active_requests)
                registered.add_metric(labels, 1)
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
            added.add_metric([model, group], c.added)
            freed.add_metric([model, group], c.freed)
            expired.add_metric([model, group], c.expired)
        yield from (added, freed, expired)

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


class SelectionCollector(Collector):
    """The selection API's state, read at scrape time: O(catalog workers + partitions) per
    scrape (reservations are tallied as they change), nothing per call."""

    def __init__(self, service: SelectionService) -> None:
        self.service = service

    def collect(self) -> Iterator:
        svc = self.service
        workers = GaugeMetricFamily(
            "kv_slot_tracker_selection_workers",
            "Selection catalog workers by lifecycle: schedulable (a candidate), incomplete "
            "(cannot be scheduled yet), unschedulable (schedulable, but its ranks were removed "
            "through /unregister)",
            labels=[*KEY_LABELS, "lifecycle"],
        )
        by_lifecycle: dict[Key, Tally[str]] = {}
        for record in svc.catalog.values():
            key = record.spec.key
            lifecycle = record.lifecycle
            if record.schedulable:
                t = svc.registry.find(key)
                if t is None or not t.has_worker(record.spec.worker_id):
                    lifecycle = UNSCHEDULABLE
            by_lifecycle.setdefault(key, Tally())[lifecycle] += 1
        for (model, group), tally in sorted(by_lifecycle.items()):
            for lifecycle in (SCHEDULABLE, INCOMPLETE, UNSCHEDULABLE):
                workers.add_metric([model, group, lifecycle], tally[lifecycle])
        yield workers

        reservations = GaugeMetricFamily(
            "kv_slot_tracker_selection_reservations",
            "Reservation ids held per partition: active (booked) or lingering (their worker or "
            "rank was removed; the id stays taken until a call on it answers 404)",
            labels=[*KEY_LABELS, "state"],
        )
        held = svc.reservations.held
        keys = sorted(svc.partitions.keys() | {key for key, _ in held})
        for model, group in keys:
            for state, lingering in (("active", False), ("lingering", True)):
                reservations.add_metric(
                    [model, group, state], held.get(((model, group), lingering), 0)
                )
        yield reservations

        blocks = GaugeMetricFamily(
            "kv_slot_tracker_selection_cached_blocks",
            "Approximate-cache entries (rank, block) per partition, expired ones not yet swept "
            "included",
            labels=KEY_LABELS,
        )
        for (model, group), part in sorted(svc.partitions.items()):
            blocks.add_metric([model, group], len(part.cache))
        yield blocks

        made = CounterMetricFamily(
            "kv_slot_tracker_selections",
            "Successful selections and bookings per partition: select, select_and_reserve, and "
            "POST /reservations replaying a pending selection (replay) or naming a rank (explicit)",
            labels=[*KEY_LABELS, "outcome"],
        )
        counted = svc.counters.made
        for model, group in sorted(svc.partitions.keys() | {key for key, _ in counted}):
            for outcome in SELECTION_OUTCOMES:
                made.add_metric([model, group, outcome], counted.get(((model, group), outcome), 0))
        yield made

        pending = GaugeMetricFamily(
            "kv_slot_tracker_selection_pending",
            "Pending selections (select with a selection_id) held for a later booking, expired "
            "ones not yet swept included",
        )
        pending.add_metric([], len(svc.pending))
        yield pending
        for name, value, doc in (
            ("pending_evicted", svc.pending.evicted,
             "Pending selections evicted unclaimed because the cache was full (entries or bytes)"),
            ("pending_expired", svc.pending.expired,
             "Pending selections dropped unclaimed after selection_cache_ttl_seconds"),
            ("lingering_dropped", svc.reservations.lingering_dropped,
             "Lingering reservation ids dropped by the sweep after the request expiry"),
            ("stale_dropped", svc.reservations.stale_dropped,
             "Reservation ids dropped because their request was freed elsewhere (slot-tracker "
             "routes, expiry)"),
        ):  # fmt: skip
            counter = CounterMetricFamily(f"kv_slot_tracker_selection_{name}", doc)
            counter.add_metric([], value)
            yield counter


class IngestCollector(Collector):
    """KV events: what the listeners received and how each rank's publisher is doing; the
    counters are totals kept by the ingest, read at scrape time."""

    _DOCS = {
        "batches": "KV-event batches applied to the index (live and replayed)",
        "events": "KV events in the applied batches",
        "bytes": "Bytes of live KV-event messages received (all frames)",
        "malformed": "KV-event messages skipped because they did not decode",
        "stale": "KV-event batches skipped: sequence number not above the last one applied",
        "gaps": "Sequence gaps in a rank's KV-event stream",
        "replays": "Sequence gaps filled from the engine's replay socket",
        "replayed_batches": "KV-event batches received through replays",
        "gaps_lost": "Sequence gaps that could not be replayed (the rank's index was cleared)",
        "restarts": "KV-event publishers seen restarting at sequence 0 (the rank was cleared)",
        "heap_trims": "Heap trims after a burst of KV events drained (free C-heap pages returned)",
    }

    _RECOVERY_DOCS = {
        "peer_failures": "KV index recovery: attempts on a peer that gave no whole dump",
        "ranks": "KV index recovery: ranks loaded from a peer",
        "ranks_skipped": "KV index recovery: ranks whose worker is elsewhere here, or never came",
        "blocks": "KV index recovery: blocks loaded from a peer",
        "blocks_refused": "KV index recovery: blocks the index could not place (skipped)",
        "malformed": "KV index recovery: dump lines or entries that did not validate (skipped)",
    }

    def __init__(
        self, ingest: ZmqIngest, kv_events: KvEvents, peers: IndexPeers | None = None
    ) -> None:
        self.ingest, self.kv_events, self.peers = ingest, kv_events, peers

    def collect(self) -> Iterator:
        for name, value in self.ingest.counters.as_dict().items():
            counter = CounterMetricFamily(f"kv_slot_tracker_kv_events_{name}", self._DOCS[name])
            counter.add_metric([], value)
            yield counter
        for name, value, doc in (
            ("stores_refused", self.kv_events.stores_refused,
             "KV-event stores skipped: parent block unknown on the rank, or a hash repeated"),
            ("unrouted", self.kv_events.unrouted,
             "KV events for a worker or rank that is not schedulable here"),
        ):  # fmt: skip
            counter = CounterMetricFamily(f"kv_slot_tracker_kv_events_{name}", doc)
            counter.add_metric([], value)
            yield counter
        blocks = GaugeMetricFamily(
            "kv_slot_tracker_kv_indexed_blocks",
            "Blocks (rank, tier, block) the KV-event index holds per partition",
            labels=KEY_LABELS,
        )
        for (model, group), n in sorted(self.kv_events.kv_indexed_blocks().items()):
            blocks.add_metric([model, group], n)
        yield blocks
        silent = GaugeMetricFamily(
            "kv_slot_tracker_kv_events_silent_seconds",
            "Seconds since each subscribed rank's publisher last sent a message (-1: nothing yet)",
            labels=["worker_id", "dp_rank"],
        )
        for (wid, rank), secs in sorted(self.ingest.silent_for().items()):
            silent.add_metric([str(wid), str(rank)], -1.0 if secs is None else secs)
        yield silent
        connected = GaugeMetricFamily(
            "kv_slot_tracker_kv_events_connected",
            "1 while a subscribed rank's SUB socket holds a connection to its publisher, else 0",
            labels=["worker_id", "dp_rank"],
        )
        for (wid, rank), (_, listener, _) in sorted(self.ingest.listeners.items()):
            connected.add_metric([str(wid), str(rank)], 1.0 if listener.connected else 0.0)
        yield connected
        if self.peers is None:
            return
        recovering = GaugeMetricFamily(
            "kv_slot_tracker_kv_index_recovering",
            "1 while the KV index is being loaded from indexer_peers at start, else 0",
        )
        recovering.add_metric([], 1.0 if self.peers.recovering else 0.0)
        yield recovering
        for name, value in self.peers.counters.as_dict().items():
            counter = CounterMetricFamily(
                f"kv_slot_tracker_kv_index_recovery_{name}", self._RECOVERY_DOCS[name]
            )
            counter.add_metric([], value)
            yield counter


def watch_ingest(
    registry: CollectorRegistry,
    ingest: ZmqIngest,
    kv_events: KvEvents,
    peers: IndexPeers | None = None,
) -> None:
    registry.register(IngestCollector(ingest, kv_events, peers))


class DiscoveryCollector(Collector):
    """Kubernetes discovery: the workers it holds, its lists, watches and what it skipped."""

    def __init__(self, discovery: KubernetesDiscovery) -> None:
        self.discovery = discovery

    def collect(self) -> Iterator:
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


class ConsistencyCollector(Collector):
    """Replicated mode: lifecycle calls that waited for their add, and early calls kept."""

    def __init__(self, counters: ConsistencyCounters, replica: ReplicaRecords) -> None:
        self.counters = counters
        self.replica = replica

    def collect(self) -> Iterator:
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


def build_registry() -> CollectorRegistry:
    """A registry of this app's own (never the process-global one)."""
    return CollectorRegistry(auto_describe=True)


def watch_service(registry: CollectorRegistry, service: SlotTrackerService) -> None:
    """Expose the service's trackers and counters in ``registry`` (read at scrape time)."""
    registry.register(TrackerCollector(service))


def watch_selection(registry: CollectorRegistry, service: SelectionService) -> None:
    """Expose the selection API's catalog, reservations, caches and counters in ``registry``."""
    registry.register(SelectionCollector(service))


ACCESS_LOGGER = "kv_slot_tracker.access"


def access_logged(
    observe: Callable[[str, str, int, float], None],
) -> Callable[[str, str, int, float], None]:
    """``observe`` that also writes one JSON line per request to the ``kv_slot_tracker.access`` logger:
    time, method, route (its template), status, duration in ms and a request id unique in
    this process. Installed only when ``access_log`` is on: off, the hot paths pay nothing."""
    log = logging.getLogger(ACCESS_LOGGER)
    prefix = f"{os.getpid():x}-"
    ids = itertools.count(1)

    def observe_and_log(method: str, handler: str, status: int, seconds: float) -> None:
        observe(method, handler, status, seconds)
        line = {
            "ts": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "method": method,
            "route": handler,
            "status": status,
            "duration_ms": round(seconds * 1000, 3),
            "request_id": prefix + str(next(ids)),
        }
        log.info("%s", orjson.dumps(line).decode())

    return observe_and_log


class HttpMetrics:
    """HTTP request counts and latencies, shared by the FastAPI routes (through the
    instrumentator) and the lean paths, so every request lands in the same series.

    Every request is observed, so an observation is two list updates (``bisect`` finds the
    bucket in C) with no locks: the event loop is the only writer. The Prometheus families
    (``http_requests_total`` by status class, ``http_request_duration_seconds``) are built from
    these cells when scraped, in O(method x route x status seen).
    """

    BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

    def __init__(self, registry: CollectorRegistry) -> None:
        # (method, handler, status) -> [count per bucket..., count above the last, seconds]
        self._cells: dict[tuple[str, str, int], list[Any]] = {}
        self._created: dict[tuple[str, str, int], float] = {}
        registry.register(_HttpCollector(self))

    def observe(self, method: str, handler: str, status: int, seconds: float) -> None:
        key = (method, handler, status)
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = [0] * (len(self.BUCKETS) + 1) + [0.0]
            self._created[key] = time.time()
        cell[bisect_left(self.BUCKETS, seconds)] += 1
        cell[-1] += seconds

    def instrumentation(self, info) -> None:
        """A prometheus-fastapi-instrumentator instrumentation function."""
        status = info.response.status_code if info.response is not None else 500
        self.observe(info.method, info.modified_handler, status, info.modified_duration)


class _HttpCollector(Collector):
    def __init__(self, metrics: HttpMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        cells, created = self.metrics._cells, self.metrics._created
        requests: dict[tuple[str, str, str], list[float]] = {}  # [count, first created]
        latency: dict[tuple[str, str], list[Any]] = {}  # [bucket counts..., seconds, created]
        for key, cell in list(cells.items()):
            method, handler, status = key
            n = sum(cell[:-1])
            row = requests.setdefault((method, handler, f"{status // 100}xx"), [0, created[key]])
            row[0] += n
            row[1] = min(row[1], created[key])
            hist = latency.get((method, handler))
            if hist is None:
                latency[(method, handler)] = [*cell, created[key]]
            else:
                for i, v in enumerate(cell):
                    hist[i] += v
                hist[-1] = min(hist[-1], created[key])
        total = CounterMetricFamily(
            "http_requests_total",
            "HTTP requests by method, route and status class",
            labels=["method", "handler", "status"],
        )
        for labels, (n, since) in requests.items():
            total.add_metric(list(labels), n, created=since)
        yield total
        hist_family = HistogramMetricFamily(
            "http_request_duration_seconds",
            "HTTP request latency by method and route",
            labels=["method", "handler"],
        )
        bounds = [*(floatToGoString(b) for b in HttpMetrics.BUCKETS), "+Inf"]
        for route, hist in latency.items():
            counts, seconds = hist[: len(bounds)], hist[len(bounds)]
            cumulative, running = [], 0
            for bound, count in zip(bounds, counts, strict=True):
                running += count
                cumulative.append((bound, running))
            hist_family.add_metric(list(route), cumulative, seconds)
            method, handler = route
            hist_family.samples.append(
                Sample(
                    "http_request_duration_seconds_created",
                    {"method": method, "handler": handler},
                    hist[-1],
                )
            )
        yield hist_family
