"""Reads of a KV index's internals that the service does not make."""

from __future__ import annotations

from kv_slot_tracker.core.selection.kv_index import KvIndex
from kv_slot_tracker.core.types import WorkerWithDpRank


def rank_size(ix: KvIndex, worker: WorkerWithDpRank) -> int:
    """Entries the index holds for one rank (its lookup table plus its per-tier maps)."""
    lk = ix._device._lookup.get(worker)
    maps = ix._lower._ranks.get(worker)
    return (0 if lk is None else len(lk)) + (0 if maps is None else sum(len(m) for m in maps))
