"""Reads of a prefill tracker, its snapshot and its token deltas that the service does not make."""

from __future__ import annotations

from collections.abc import KeysView

from kv_slot_tracker.core.prefill import PrefillLoadSnapshot, PrefillLoadTracker, _active_tokens
from kv_slot_tracker.core.types import PrefillTokenDeltas, WorkerWithDpRank


def active_tokens_at(snapshot: PrefillLoadSnapshot, now: int) -> int:
    """The prefill tokens the snapshot still counts at ``now`` (as the tracker would)."""
    return _active_tokens(
        snapshot.anchored_prefill,
        snapshot.prefill_full_tokens_sum,
        snapshot.total_modeled_ms is not None,
        now,
    )


def prefill_order(tracker: PrefillLoadTracker) -> KeysView[str]:
    """The tracked request ids, oldest (the anchor) first."""
    return tracker._entries.keys()


def tokens_for(deltas: PrefillTokenDeltas, worker: WorkerWithDpRank) -> int:
    """The prefill tokens ``deltas`` adds on ``worker``."""
    return deltas.by_worker.get(worker, deltas.default_tokens)
