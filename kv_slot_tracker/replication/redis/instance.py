"""Who this instance is, and what every part of its Redis replication shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kv_slot_tracker.replication.metrics import ReplicationCounters
from kv_slot_tracker.replication.records import OriginKey
from kv_slot_tracker.replication.redis.stream import NamespaceKeys
from kv_slot_tracker.settings import Settings


@dataclass(frozen=True, slots=True)
class Instance:
    settings: Settings
    keys: NamespaceKeys
    instance_id: int  # the origin of our records (configured, or random)
    incarnation: int  # random per process: a restart numbers its records afresh
    clock: Callable[[], int]  # monotonic ns: timeouts, intervals
    wall_clock: Callable[[], int]  # wall ns: record times, snapshot ages, trimming
    counters: ReplicationCounters

    @property
    def own_key(self) -> OriginKey:
        """The ledger key of this process's records."""
        return self.instance_id, self.incarnation
