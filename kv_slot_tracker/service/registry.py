"""The trackers of one process, keyed by ``(model_name, routing_group)``, with their counters.

A tracker is created by the first topology change of its key and dropped when its last worker
goes. Its counters (added, freed, expired: the tracker counts into them) go with it: a client that registers and unregisters
ever new names must not grow the process or the metrics (a counter that comes back starts from
0 again, which Prometheus reads as a counter reset).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kv_slot_tracker.core.limits import DEFAULT_MAX_TRACKERS
from kv_slot_tracker.core.publisher import ReplicaWorkerPolicy, SequencePublisher
from kv_slot_tracker.core.tracker import ActiveSequencesMultiWorker
from kv_slot_tracker.core.types import LifecycleCounts
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.errors import NoTracker, TooManyTrackers
from kv_slot_tracker.service.leases import Leases

WORKER_TYPE = "standalone"


class TrackerRegistry:
    def __init__(
        self,
        *,
        clock: Callable[[], int],
        expiry_ns: int,
        check_interval_ns: int,
        instance_id: int,
        replicated: bool,
        publisher_for: Callable[[Key, int], SequencePublisher],
    ) -> None:
        self.clock = clock
        self.expiry_ns = expiry_ns
        self.check_interval_ns = check_interval_ns
        self.instance_id = instance_id
        self.replicated = replicated
        self.publisher_for = publisher_for
        self.trackers: dict[Key, ActiveSequencesMultiWorker] = {}
        # per key, kept while its tracker lives, also across a snapshot's replacement of it
        self.counters: dict[Key, LifecycleCounts] = {}
        self.max_trackers = DEFAULT_MAX_TRACKERS
        self.leases = Leases(0)  # worker leases (``worker_ttl_seconds``; off: 0)
        self.workers_expired = 0  # workers removed because their lease ran out

    def check_room(self, key: Key) -> None:
        """``TooManyTrackers`` when ``key`` has no tracker and there is no room for one."""
        if key not in self.trackers and len(self.trackers) >= self.max_trackers:
            raise TooManyTrackers(key, self.max_trackers)

    def create(
        self, key: Key, block_size: int, *, capped: bool = True
    ) -> ActiveSequencesMultiWorker:
        """A new tracker for ``key``; ``capped``: refuse it beyond ``max_trackers`` (a
        snapshot being restored is not: it holds what its writer accepted)."""
        if capped:
            self.check_room(key)
        tracker = ActiveSequencesMultiWorker(
            self.publisher_for(key, block_size),
            block_size,
            {},
            self.replicated,
            self.instance_id,
            worker_type=WORKER_TYPE,
            clock=self.clock,
            expiry_ns=self.expiry_ns,
            check_interval_ns=self.check_interval_ns,
            replica_worker_policy=ReplicaWorkerPolicy.REQUIRE_REGISTERED,
            counts=self.counters.setdefault(key, LifecycleCounts()),
        )
        self.trackers[key] = tracker
        return tracker

    def get(self, key: Key) -> ActiveSequencesMultiWorker:
        t = self.trackers.get(key)
        if t is None:
            raise NoTracker(key)
        return t

    def find(self, key: Key) -> ActiveSequencesMultiWorker | None:
        return self.trackers.get(key)

    def drop_if_empty(self, key: Key) -> None:
        t = self.trackers.get(key)
        if t is not None and not t.has_registered_workers():
            del self.trackers[key]
            self.counters.pop(key, None)

    def matching(self, model_name: str | None, routing_group: str | None) -> list[Key]:
        """Keys of live trackers, sorted, filtered by model and/or routing group."""
        if model_name is not None and routing_group is not None:
            key = (model_name, routing_group)
            return [key] if key in self.trackers else []
        keys: Iterable[Key] = (
            k
            for k in self.trackers
            if (model_name is None or k[0] == model_name)
            and (routing_group is None or k[1] == routing_group)
        )
        return sorted(keys)

    def replace_all(self, trackers: dict[Key, ActiveSequencesMultiWorker]) -> None:
        """Replace the trackers; the counters of keys still present are kept (``prune``).
        Every worker gets a full lease from now: a snapshot carries no lease deadlines, and a
        worker that is really gone expires one ttl later."""
        self.trackers = trackers
        now = self.clock()
        for key, t in trackers.items():
            for r in t.worker_ranges():
                self.leases.renew(key, r.worker_id, now)

    def prune_counters(self) -> None:
        """Forget the counters of keys without a tracker (after ``replace_all``)."""
        trackers = self.trackers
        self.counters = {k: c for k, c in self.counters.items() if k in trackers}
