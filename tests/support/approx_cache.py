"""Reads of an approximate cache's internals that the service does not make."""

from __future__ import annotations

from kv_slot_tracker.core.selection.approx_cache import ApproximateCache


def pending_expiries(cache: ApproximateCache) -> int:
    """Block entries waiting in the expiry heap, stale ones (refreshed or removed blocks)
    included."""
    return cache._heap_keys
