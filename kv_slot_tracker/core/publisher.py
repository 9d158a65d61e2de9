"""What leaves a tracker: the publisher contract (loads, observations, replica events) and the
value types of the replica apply path. The tracker calls these hooks; replication and metrics
implement them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .events import ActiveSequenceEvent
from .types import ActiveLoad, WorkerWithDpRank


class ReplicaWorkerPolicy(enum.Enum):
    """What a replicated add does for a rank this tracker has no slot for."""

    LAZY_REGISTER = "lazy_register"
    REQUIRE_REGISTERED = "require_registered"


class SequencePublisher:
    """Where a tracker's loads, observations and replica events go. Every hook is optional.

    ``enqueue_event`` must not block; it may raise ``PublishRejected`` (the tracker logs it).
    The other hooks are fire-and-forget and must not raise.
    """

    def enqueue_event(self, event: ActiveSequenceEvent) -> None:
        pass

    def publish_load(self, load: ActiveLoad) -> None:
        pass

    def publish_load_batch(self, loads: list[ActiveLoad]) -> None:
        for load in loads:
            self.publish_load(load)

    def observe_load(
        self, worker: WorkerWithDpRank, worker_type: str, blocks: int, tokens: int
    ) -> None:
        pass

    def observe_worker_registered(self, worker: WorkerWithDpRank, worker_type: str) -> None:
        pass

    def observe_worker_removed(self, worker: WorkerWithDpRank, worker_type: str) -> None:
        pass


NoopSequencePublisher = SequencePublisher


@dataclass(slots=True)
class ReplicaEffects:
    """Side effects deferred to the end of one replica batch (one flush per batch): the ranks
    a batch changed, and whether their loads are published."""

    workers: dict[WorkerWithDpRank, bool] = field(default_factory=dict)  # worker -> publish

    def record(self, worker: WorkerWithDpRank, publish: bool) -> None:
        self.workers[worker] = self.workers.get(worker, False) or publish
