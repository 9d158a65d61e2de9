"""Embedded mode (no ``redis_url``): a single instance, nothing to replicate, always ready.

Same surface as ``RedisReplication`` so the app wires both the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from app.replication.records import resolve_instance_id


class EmbeddedReplication:
    mode = "embedded"

    def __init__(
        self,
        settings: Any = None,
        registry: Any = None,
        clock: Callable[[], int] = time.monotonic_ns,
        wall_clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.settings = settings
        self.instance_id = resolve_instance_id(getattr(settings, "instance_id", 0) or 0)
        self.service: Any = None

    def attach(self, service: Any) -> None:
        self.service = service

    def publish(self, record: dict[str, Any]) -> None:
        """Nothing to send to: a no-op."""

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        instance_id = self.instance_id
        if self.service is not None and self.service.instance_id:
            instance_id = self.service.instance_id
        return {
            "mode": self.mode,
            "instance_id": instance_id,
            "namespace": None,
            "ready": True,
            "not_ready_reason": None,
            "connected": None,
            "degraded": False,
            "degraded_reasons": [],
            "stream_position": None,
            "outbox_depth": 0,
            "outbox_capacity": 0,
            "published": 0,
            "applied": 0,
            "duplicates": 0,
            "dropped": 0,
            "gaps": 0,
            "resets": 0,
            "resent": 0,
            "bootstraps": 0,
            "snapshots_written": 0,
            "last_applied_lag_ms": None,
            "snapshot_age_seconds": None,
            "snapshot_stream_id": None,
        }
