"""Prometheus series of host-local replication, besides those every mode has
(``replication.metrics``): the position this process applied, and the hub's figures as last
heard. The hub is one per supervisor, so every process reports the same hub series: take
``max without (process)``, not a sum."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

HUB_HELP = {
    "head": "The newest position the supervisor's hub gave a frame",
    "kept_from": "The oldest position of the frames the supervisor's hub keeps",
    "kept_bytes": "Bytes of frames the supervisor's hub keeps (bounded)",
    "processes": "Processes connected to the supervisor's hub",
    "frames": "Frames the supervisor's hub sequenced",
    "frame_bytes": "Bytes of records in the frames the supervisor's hub sequenced",
    "oversized": "Frames the supervisor's hub refused for their size",
    "cut": "Connections to the supervisor's hub that ended in the middle of a frame",
    "refused": "Connections the supervisor's hub dropped for a frame it does not accept",
    "joins": "States the supervisor's hub handed to (re)starting processes",
    "exports": "States the supervisor's hub asked of a process for a sibling",
    "resyncs": "Processes the supervisor's hub told to load a state again (fell behind)",
    "lost_joins": "Processes started from the kept frames alone (no process held the state)",
    "snapshots": "States the supervisor's hub took from a process for itself",
    "snapshot_joins": "Processes started from the supervisor's hub's own snapshot (none held a state)",
    "barriers": "Read barriers the supervisor's hub answered (after every sibling sent its outbox)",
    "barriers_dropped": "Read barriers the supervisor's hub dropped unanswered (too many waiting)",
    "snapshot_position": "The position of the supervisor's hub's own snapshot (0: none)",
    "snapshot_bytes": "Bytes of the supervisor's hub's own snapshot",
}


class _LocalCollector(Collector):
    def __init__(
        self, position: Callable[[], int], hub: Callable[[], dict[str, int] | None]
    ) -> None:
        self.position = position
        self.hub = hub

    def collect(self) -> Iterator[GaugeMetricFamily]:
        applied = GaugeMetricFamily(
            "kv_slot_tracker_replication_position",
            "The supervisor's hub's position up to which this process applied the frames",
        )
        applied.add_metric([], self.position())
        yield applied
        stats = self.hub() or {}
        for name, doc in HUB_HELP.items():
            if name in stats:
                gauge = GaugeMetricFamily(f"kv_slot_tracker_supervisor_hub_{name}", doc)
                gauge.add_metric([], stats[name])
                yield gauge


def register_local_collector(
    registry: CollectorRegistry,
    position: Callable[[], int],
    hub: Callable[[], dict[str, int] | None],
) -> None:
    registry.register(_LocalCollector(position, hub))
