"""The tracker's replica apply path (``ActiveSequencesMultiWorker`` inherits these methods):
a peer's lifecycle event applied without publishing anything, and the effects of a batch of
them (loads, wake-ups, cleanup) flushed once per batch. Kept apart from the local lifecycle
calls because it follows its own rules: the producer's instants, and the replica worker policy
for ranks this instance does not have.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .events import ActiveSequenceEvent, AddRequest, Free
from .publisher import ReplicaEffects, ReplicaWorkerPolicy

if TYPE_CHECKING:
    from .tracker import ActiveSequencesMultiWorker

log = logging.getLogger(__name__)


class ReplicaApplyMixin:
    def apply_replica_event(
        self: ActiveSequencesMultiWorker,
        event: ActiveSequenceEvent,
        effects: ReplicaEffects,
        decay_now: int | None = None,
        started_at: int | None = None,
    ) -> bool:
        """Apply a peer's event; returns whether it changed anything.

        ``decay_now`` defaults to the receive time (``clock()``); a transport that knows when the
        producer applied the event may pass that instant instead (and ``started_at`` for adds).
        """
        if event.router_id == self.router_id:
            return False
        if decay_now is None:
            decay_now = self.clock()
        data = event.data
        rid = event.request_id
        if isinstance(data, AddRequest):
            worker = event.worker
            slot = self._slots.get(worker)
            if slot is None:
                if self.replica_worker_policy is ReplicaWorkerPolicy.REQUIRE_REGISTERED:
                    log.debug("Dropping replica AddRequest for unregistered worker %s", worker)
                    return False
                self._ensure_worker(worker)
                slot = self._slots[worker]
            self._requests.set(rid, worker, event.lora_name)
            self._add_to_slot(
                slot,
                worker,
                rid,
                data.token_sequence,
                data.expected_output_tokens,
                data.track_prefill_tokens,
                data.prefill_load_hint,
                decay_now,
                started_at,
            )
            effects.record(worker, True)
            effects.cleanup = True
            return True
        if isinstance(data, Free):
            worker = self._requests.remove(rid)
            if worker is None:
                return False
            slot = self._slots.get(worker)
            if slot is None:
                return True
            slot.release(rid, decay_now)
            self._columns.changed.add(worker)
            effects.record(worker, True)
            effects.wake = True
            effects.cleanup = True
            return True
        worker = self._requests.worker(rid)
        if worker is None:
            return False
        slot = self._slots.get(worker)
        if slot is None:
            return False
        slot.mark_prefill_completed(rid, decay_now)
        self._columns.changed.add(worker)
        effects.record(worker, False)
        effects.wake = True
        return True

    def flush_replica_effects(self: ActiveSequencesMultiWorker, effects: ReplicaEffects) -> None:
        """Publish one load batch, one wake-up and one cleanup attempt for a replica batch."""
        now = self.clock()
        loads = [
            self._load_of(w, self._slots[w], now)
            for w, publish in effects.workers.items()
            if publish and w in self._slots and self._loads_wanted
        ]
        effects.workers.clear()
        if loads:
            self.publisher.publish_load_batch(loads)
        if effects.wake:
            self.notify_remote_state_update()
        if effects.cleanup:
            self.cleanup_attempts += 1
        effects.wake = effects.cleanup = False

    def subscribe_remote_state_changes(
        self: ActiveSequencesMultiWorker, listener: Callable[[], None]
    ) -> None:
        """Call ``listener`` whenever a replica batch freed capacity or completed a prefill."""
        self._remote_listeners.append(listener)

    def notify_remote_state_update(self: ActiveSequencesMultiWorker) -> None:
        self.remote_state_update_count += 1
        for listener in self._remote_listeners:
            listener()
