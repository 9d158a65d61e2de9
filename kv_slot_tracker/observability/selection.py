"""The selection API's state as series, read at scrape time: its catalog, reservations and
caches (``SelectionCollector``) and the router's decisions (``DecisionCollector``)."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kv_slot_tracker.core.selection.catalog import INCOMPLETE, SCHEDULABLE, UNSCHEDULABLE
from kv_slot_tracker.core.selection.decision_stats import FUNNEL, DecisionStats, Histogram
from kv_slot_tracker.core.selection.receipts import REASONS
from kv_slot_tracker.observability.labels import KEY_LABELS, OTHER, short_label
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.selection.service import SelectionService
from kv_slot_tracker.service.selection.types import SELECTION_OUTCOMES


class SelectionCollector(Collector):
    """The selection API's state, read at scrape time: O(catalog workers + partitions) per
    scrape (reservations are tallied as they change), nothing per call."""

    def __init__(self, service: SelectionService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        svc = self.service
        workers = GaugeMetricFamily(
            "kv_slot_tracker_selection_workers",
            "Selection catalog workers by lifecycle: schedulable (a candidate), incomplete "
            "(cannot be scheduled yet), unschedulable (schedulable, but its ranks were removed "
            'through /unregister); model_name="other": the workers of names without a partition',
            labels=[*KEY_LABELS, "lifecycle"],
        )
        by_lifecycle: dict[Key, Tally[str]] = {}
        partitions = svc.partitions
        for record in svc.catalog.values():
            key = record.spec.key
            if key not in partitions:  # any name a client may invent: one series for them all
                key = (OTHER, OTHER)
            lifecycle = record.lifecycle
            if record.schedulable:
                t = svc.registry.find(key)
                if t is None or not t.has_worker(record.spec.worker_id):
                    lifecycle = UNSCHEDULABLE
            by_lifecycle.setdefault(key, Tally())[lifecycle] += 1
        for (model, group), tally in sorted(by_lifecycle.items()):
            for lifecycle in (SCHEDULABLE, INCOMPLETE, UNSCHEDULABLE):
                workers.add_metric(
                    [short_label(model, 128), short_label(group, 128), lifecycle], tally[lifecycle]
                )
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
                    [short_label(model, 128), short_label(group, 128), state],
                    held.get(((model, group), lingering), 0),
                )
        yield reservations

        blocks = GaugeMetricFamily(
            "kv_slot_tracker_selection_cached_blocks",
            "Approximate-cache entries (rank, block) per partition, expired ones not yet swept "
            "included",
            labels=KEY_LABELS,
        )
        for (model, group), part in sorted(svc.partitions.items()):
            blocks.add_metric([short_label(model, 128), short_label(group, 128)], len(part.cache))
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
                made.add_metric(
                    [short_label(model, 128), short_label(group, 128), outcome],
                    counted.get(((model, group), outcome), 0),
                )
        yield made

        pending = GaugeMetricFamily(
            "kv_slot_tracker_selection_pending",
            "Pending selections (select with a selection_id) held for a later booking, expired "
            "ones not yet swept included",
        )
        pending.add_metric([], len(svc.pending))
        yield pending
        tombstones = svc.reservations.tombstones
        kept = GaugeMetricFamily(
            "kv_slot_tracker_selection_reservation_tombstones",
            "Released reservation ids remembered (a late booking of one is refused), ones past "
            "reservation_tombstone_ttl_seconds not yet swept included",
        )
        kept.add_metric([], len(tombstones))
        yield kept
        counts = tombstones.counters
        for name, value, doc in (
            ("reservation_tombstones_created", counts.created,
             "Released reservation ids remembered (releases here and peers')"),
            ("reservation_tombstones_refused", counts.refused,
             "Bookings of a released reservation id refused here (409)"),
            ("reservation_tombstones_dropped", counts.dropped,
             "Released reservation ids forgotten: after the ttl, or oldest first beyond the "
             "count or bytes bound"),
        ):  # fmt: skip
            counter = CounterMetricFamily(f"kv_slot_tracker_selection_{name}", doc)
            counter.add_metric([], value)
            yield counter
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


class DecisionCollector(Collector):
    """Decision quality of this instance's selections (routing receipts), per partition, read
    at scrape time: Dynamo's router metric names where it has them, with this service's
    prefix. Local to the instance (receipts are not replicated): sum them over instances."""

    def __init__(self, service: SelectionService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        ring = self.service.receipts
        if ring is None:
            return
        stats = sorted(ring.stats.items())

        def counter(name: str, doc: str, value: Callable[[DecisionStats], int]) -> Metric:
            c = CounterMetricFamily(f"kv_slot_tracker_router_{name}", doc, labels=KEY_LABELS)
            for (model, group), s in stats:
                c.add_metric([model, group], value(s))
            return c

        yield counter("decisions", "Selections decided (select and select_and_reserve)",
                      lambda s: s.decisions)  # fmt: skip
        yield counter(
            "decision_kv_optimal",
            "Selections that took a rank with the most cached prefix of the prompt",
            lambda s: s.max_overlap_decisions,
        )
        non_max = CounterMetricFamily(
            "kv_slot_tracker_router_non_max_overlap_selections",
            "Selections that did not take a rank with the most cached prefix, by reason: load "
            "(the cost preferred a less loaded rank), tie, temperature, pin, session, allowed",
            labels=[*KEY_LABELS, "reason"],
        )
        for (model, group), s in stats:
            for reason in REASONS:
                non_max.add_metric([model, group, reason], s.non_max.get(reason, 0))
        yield non_max
        yield counter(
            "overlap_blocks_lost",
            "Cached prompt blocks given up: the most overlap on any candidate minus the chosen "
            "rank's, summed over selections",
            lambda s: s.overlap_blocks_lost,
        )
        funnel = CounterMetricFamily(
            "kv_slot_tracker_router_cache_funnel_blocks",
            "The cache-loss funnel in blocks: prompt, cached on any rank (the most), cached on "
            "the chosen rank, reported cached by the client (reported selections only)",
            labels=[*KEY_LABELS, "stage"],
        )
        for (model, group), s in stats:
            for stage, value in zip(FUNNEL, s.funnel, strict=True):
                funnel.add_metric([model, group, stage], value)
        yield funnel
        yield counter("reported_outcomes",
                      "Selections whose cached tokens a client reported", lambda s: s.reported)  # fmt: skip
        yield counter(
            "reported_prompt_blocks",
            "Prompt blocks of the selections with a reported outcome",
            lambda s: s.reported_prompt_blocks,
        )
        yield counter(
            "reported_predicted_blocks",
            "Blocks predicted cached on the chosen rank, of the selections with a reported outcome",
            lambda s: s.reported_predicted_blocks,
        )
        yield counter(
            "reported_predicted_cached_tokens",
            "Cached tokens predicted on the chosen rank, of the selections with a reported outcome",
            lambda s: s.reported_predicted_tokens,
        )
        yield counter(
            "reported_cached_tokens",
            "Cached tokens the clients reported (their engines' usage.prompt_tokens_details)",
            lambda s: s.reported_cached_tokens,
        )
        histograms: tuple[tuple[str, str, Callable[[DecisionStats], Histogram]], ...] = (
            ("kv_hit_rate",
             "Predicted KV hit rate of each selection: the chosen rank's cached blocks over the "
             "prompt's blocks at decision time", lambda s: s.predicted_hit_rate),
            ("observed_kv_hit_rate",
             "Observed KV hit rate: the cached tokens a client reported over the prompt's tokens",
             lambda s: s.observed_hit_rate),
            ("kv_hit_prediction_error_tokens",
             "Predicted minus reported cached tokens per reported selection",
             lambda s: s.prediction_error),
        )  # fmt: skip
        for name, doc, pick in histograms:
            h = HistogramMetricFamily(f"kv_slot_tracker_router_{name}", doc, labels=KEY_LABELS)
            for (model, group), s in stats:
                hist = pick(s)
                h.add_metric([model, group], hist.cumulative(), hist.total)
            yield h
        kv = CounterMetricFamily(
            "kv_slot_tracker_router_kv_check_blocks",
            "KV events: when the chosen rank stored the rest of a prompt, the blocks predicted "
            "cached (predicted) and those it still held (still_held)",
            labels=[*KEY_LABELS, "kind"],
        )
        for (model, group), s in stats:
            kv.add_metric([model, group, "predicted"], s.kv_predicted_blocks)
            kv.add_metric([model, group, "still_held"], s.kv_still_held_blocks)
        yield kv
        kept = GaugeMetricFamily(
            "kv_slot_tracker_selection_receipts", "Routing receipts kept on this instance"
        )
        kept.add_metric([], len(ring))
        yield kept
        size = GaugeMetricFamily(
            "kv_slot_tracker_selection_receipts_bytes",
            "Estimated bytes of the routing receipts kept (bounded by selection_receipts_max_bytes)",
        )
        size.add_metric([], ring.bytes)
        yield size
        evicted = CounterMetricFamily(
            "kv_slot_tracker_selection_receipts_evicted",
            "Routing receipts dropped to keep the ring within its count and byte bounds",
        )
        evicted.add_metric([], ring.evicted)
        yield evicted


def watch_selection(registry: CollectorRegistry, service: SelectionService) -> None:
    """Expose the selection API's catalog, reservations, caches and counters in ``registry``."""
    registry.register(SelectionCollector(service))
    registry.register(DecisionCollector(service))
