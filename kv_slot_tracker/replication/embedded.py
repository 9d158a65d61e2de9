"""Embedded mode (no ``redis_url``): a single instance, nothing to replicate, always ready.

It implements the same ``Replication`` port as the Redis mode, so the app wires both the same
way; the service gets no replicator in this mode, so its trackers emit no replica events.
"""

from __future__ import annotations

from kv_slot_tracker.replication.port import ReplicatedState, ReplicationStatus
from kv_slot_tracker.replication.records import resolve_instance_id
from kv_slot_tracker.settings import Settings


class EmbeddedReplication:
    mode = "embedded"
    barrier_covers_acknowledged = True  # nothing to wait for

    def __init__(self, settings: Settings) -> None:
        self.instance_id = resolve_instance_id(settings.instance_id)

    def publish(self, record: bytes, ts: int) -> int:
        """Nothing to send to: a no-op."""
        return 0

    async def start(self, target: ReplicatedState) -> None:
        pass

    async def settled(self, timeout_s: float) -> None:
        pass

    async def stop(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def write_refusal(self) -> str | None:
        return None

    def last_accepted(self) -> int:
        return 0

    def acknowledged_through(self) -> int:
        return 0

    async def appended(self, seq: int, timeout_s: float) -> bool:
        return True

    async def caught_up(self, timeout_s: float) -> bool:
        return True  # nothing is shared: this instance has everything

    def status(self) -> ReplicationStatus:
        return ReplicationStatus(mode=self.mode, instance_id=self.instance_id)
