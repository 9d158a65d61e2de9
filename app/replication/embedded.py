"""The embedded default: a single instance, nothing to replicate, always ready."""

from __future__ import annotations

from typing import Any


class EmbeddedReplication:
    instance_id = 0

    def __init__(self, settings: Any = None, registry: Any = None) -> None:
        self.settings = settings

    def attach(self, service: Any) -> None:
        self.service = service

    def publish(self, record: dict[str, Any]) -> None:  # pragma: no cover - never called
        pass

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        return {"mode": "embedded", "instance_id": self.service.instance_id}
