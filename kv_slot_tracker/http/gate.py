"""The readiness gate: while a replicated instance bootstraps, calls about tracker state are
refused with 503 (``NotReady``) before anything runs, so they change nothing.

The instance listens at once (Kubernetes probes need no initial delay): ``/health``, ``/ready``,
``/replication``, ``/metrics`` and the docs answer throughout; every route of the table marked
``needs_state`` goes through the gate. Once open the gate costs one attribute read per call;
a replication that stops being ready (Redis replication re-reading its stream after a primary
switch) closes it again through ``watch_readiness``, and it opens once ready again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kv_slot_tracker.replication.port import Replication
from kv_slot_tracker.service.errors import NotReady


class ReadinessGate:
    __slots__ = ("replication", "closed")

    def __init__(self, replication: Replication) -> None:
        self.replication = replication
        self.closed = True  # until ``refusal`` finds the replication ready
        watch = getattr(replication, "watch_readiness", None)  # not every mode loses readiness
        if watch is not None:
            watch(self.close)

    def close(self) -> None:
        """The replication is not ready any more: refuse until it is again."""
        self.closed = True

    def refusal(self) -> NotReady | None:
        """The error to answer now, or None (and the gate opens for good) once ready."""
        if self.replication.ready():
            self.closed = False
            return None
        reason = self.replication.status().not_ready_reason or "catching up with the peers"
        return NotReady(reason)

    def guard(self, handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``handler`` (a query route's), refused with ``NotReady`` while the gate is closed."""

        def guarded(params: Any) -> Any:
            if self.closed:
                refused = self.refusal()
                if refused is not None:
                    raise refused
            return handler(params)

        return guarded
