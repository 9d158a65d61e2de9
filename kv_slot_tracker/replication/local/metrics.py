"""Prometheus series of host-local replication, besides those every mode has
(``replication.metrics``): the position this process applied, and the hub's figures as last
heard. The hub is one per supervisor, so every process reports the same hub series: take
``max without (worker)``, not a sum."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

HUB_HELP = {
    "head": "The newest position the workers hub gave a frame",
    "kept_from": "The oldest position of the frames the workers hub keeps",
    "kept_bytes": "Bytes of frames the workers hub keeps (bounded)",
    "processes": "Processes connected to the workers hub",
    "frames": "Frames the workers hub sequenced",
    "frame_bytes": "Bytes of records in the frames the workers hub sequenced",
    "oversized": "Frames the workers hub refused for their size",
    "cut": "Connections to the workers hub that ended in the middle of a frame",
    "refused": "Connections the workers hub dropped for a frame it does not accept",
    "joins": "States the workers hub handed to (re)starting processes",
    "exports": "States the workers hub asked of a process for a sibling",
    "resyncs": "Processes the workers hub told to load a state again (fell behind)",
    "lost_joins": "Processes started from the kept frames alone (no process held the state)",
    "snapshots": "States the workers hub took from a process for itself",
    "snapshot_joins": "Processes started from the workers hub's own snapshot (none held a state)",
    "barriers": "Read barriers the workers hub answered (after every sibling sent its outbox)",
    "barriers_dropped": "Read barriers the workers hub dropped unanswered (too many waiting)",
    "snapshot_position": "The position of the workers hub's own snapshot (0: none)",
    "snapshot_bytes": "Bytes of the workers hub's own snapshot",
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
            "The workers hub's position up to which this process applied the frames",
        )
        applied.add_metric([], self.position())
        yield applied
        stats = self.hub() or {}
        for name, doc in HUB_HELP.items():
            if name in stats:
                gauge = GaugeMetricFamily(f"kv_slot_tracker_workers_hub_{name}", doc)
                gauge.add_metric([], stats[name])
                yield gauge


def register_local_collector(
    registry: CollectorRegistry,
    position: Callable[[], int],
    hub: Callable[[], dict[str, int] | None],
) -> None:
    registry.register(_LocalCollector(position, hub))
