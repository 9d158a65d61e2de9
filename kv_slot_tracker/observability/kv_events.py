"""The engines' KV events as series, read at scrape time: batches applied and refused per kind,
the listeners' states, the index's size and the index handed over by a peer."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kv_slot_tracker.ingest.peers import IndexPeers
from kv_slot_tracker.ingest.port import WARNING_KINDS
from kv_slot_tracker.ingest.zmq import ZmqIngest
from kv_slot_tracker.observability.labels import KEY_LABELS
from kv_slot_tracker.service.selection.kv_events import KvEvents


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
        "reconnects": "KV-event SUB connections libzmq dropped for good and connected again",
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
        self,
        ingest: ZmqIngest,
        kv_events: KvEvents,
        peers: IndexPeers | None = None,
        silent_seconds: float = 60.0,
    ) -> None:
        self.ingest, self.kv_events, self.peers = ingest, kv_events, peers
        self.silent_seconds = silent_seconds

    def _field_named(self) -> Iterator[Metric]:
        """The families as the field names them (Dynamo's indexer: ``kv_cache_events_applied``,
        ``kv_cache_event_warnings``, ``listeners``), under this service's prefix."""
        counters = self.ingest.counters
        refused = counters.applied["stored_refused"]
        applied = CounterMetricFamily(
            "kv_slot_tracker_kv_cache_events_applied",
            "KV events handed to the index by type; status refused: a store whose parent block "
            "is unknown on the rank or that repeats a hash (nothing stored)",
            labels=["event_type", "status"],
        )
        stored = counters.applied["stored"]
        applied.add_metric(["stored", "ok"], max(stored - refused, 0))
        applied.add_metric(["stored", "refused"], refused)
        applied.add_metric(["removed", "ok"], counters.applied["removed"])
        applied.add_metric(["cleared", "ok"], counters.applied["cleared"])
        yield applied
        warnings = CounterMetricFamily(
            "kv_slot_tracker_kv_cache_event_warnings",
            "Suspicious KV-event messages and stream events by kind: "
            + "; ".join(f"{k}: {v}" for k, v in WARNING_KINDS.items()),
            labels=["warning_kind"],
        )
        for kind in WARNING_KINDS:
            warnings.add_metric([kind], counters.warnings[kind])
        yield warnings
        listeners = GaugeMetricFamily(
            "kv_slot_tracker_kv_events_listeners",
            "KV-event listeners (one per subscribed worker rank) by status: active, silent "
            "(connected, nothing received for kv_events_silent_seconds) or disconnected",
            labels=["status"],
        )
        by_status = Tally(self.ingest.statuses(self.silent_seconds).values())
        for status in ("active", "silent", "disconnected"):
            listeners.add_metric([status], by_status[status])
        yield listeners

    def collect(self) -> Iterator[Metric]:
        yield from self._field_named()
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
    silent_seconds: float = 60.0,
) -> None:
    registry.register(IngestCollector(ingest, kv_events, peers, silent_seconds))
