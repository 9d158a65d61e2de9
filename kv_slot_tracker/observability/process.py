"""The registry of this app, with the series of its process and its container's memory limit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


def build_registry() -> CollectorRegistry:
    """A registry of this app's own (never the process-global one), with the standard
    ``process_*`` series of this process (CPU, resident memory, open file descriptors; Linux
    only) and the container's memory limit."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    registry.register(MemoryLimitCollector())
    return registry


# A cgroup v1 limit at or above this is "no limit" (the kernel reports its page counter maximum).
_CGROUP_V1_UNLIMITED = 1 << 62


class MemoryLimitCollector(Collector):
    """The memory limit of the container (cgroup v2 ``memory.max``, or v1
    ``memory.limit_in_bytes``), read at each scrape; no series when there is none. An alert
    compares the processes' ``process_resident_memory_bytes`` with it."""

    def __init__(self, cgroup_root: Path = Path("/sys/fs/cgroup")) -> None:
        self.cgroup_root = cgroup_root

    def limit_bytes(self) -> int | None:
        for path, unlimited in (
            (self.cgroup_root / "memory.max", None),
            (self.cgroup_root / "memory" / "memory.limit_in_bytes", _CGROUP_V1_UNLIMITED),
        ):
            try:
                text = path.read_text().strip()
            except OSError:
                continue
            if not text.isdigit():  # "max": no limit
                return None
            value = int(text)
            return None if unlimited is not None and value >= unlimited else value
        return None

    def collect(self) -> Iterator[Metric]:
        limit = self.limit_bytes()
        if limit is None:
            return
        gauge = GaugeMetricFamily(
            "kv_slot_tracker_memory_limit_bytes",
            "The container's memory limit (its cgroup's); absent when there is none",
        )
        gauge.add_metric([], float(limit))
        yield gauge
