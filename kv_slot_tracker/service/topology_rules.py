"""The topology rules a change must pass before it reaches a tracker, whoever asks for it.

A local call (``kv_slot_tracker.service.service``) and a peer's replica record (``kv_slot_tracker.service.replica``)
run the same checks, so that a topology the HTTP edge would refuse can never arrive through the
stream instead. Limits come from ``kv_slot_tracker.core.limits``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kv_slot_tracker.core.limits import MAX_DP_SIZE, MAX_RANKS_PER_TRACKER
from kv_slot_tracker.core.topology import validate_range
from kv_slot_tracker.core.types import WorkerDpRange
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.errors import InvalidTopology, TooManyRanks

if TYPE_CHECKING:
    from kv_slot_tracker.core.tracker import ActiveSequencesMultiWorker as Tracker


def check_range(block_size: int, dp_start: int, dp_size: int) -> None:
    """The service's topology limits, then the core's range rule, in the reference's order."""
    if block_size == 0:
        raise InvalidTopology("block_size must be greater than 0")
    if dp_size > MAX_DP_SIZE:
        raise InvalidTopology(f"dp_size {dp_size} exceeds the maximum {MAX_DP_SIZE}")
    validate_range(WorkerDpRange(0, dp_start, dp_size))


def check_capacity(key: Key, ranks: int) -> None:
    if ranks > MAX_RANKS_PER_TRACKER:
        raise TooManyRanks(key, ranks, MAX_RANKS_PER_TRACKER)


def check_upsert(key: Key, t: Tracker | None, worker_id: int, dp_size: int) -> None:
    """A worker's ranks replaced by ``dp_size`` ranks must fit the tracker (range checked)."""
    old = t.worker_range(worker_id) if t is not None else None
    kept = (t.num_ranks() if t is not None else 0) - (old.dp_size if old is not None else 0)
    check_capacity(key, kept + dp_size)


def check_reconcile(key: Key, block_size: int, workers: Iterable[tuple[int, int, int]]) -> None:
    """A complete topology: block size, each worker once, each range, and the sum of ranks."""
    if block_size == 0:
        raise InvalidTopology("block_size must be greater than 0")
    seen: set[int] = set()
    ranks = 0
    for wid, start, size in workers:
        if wid in seen:
            raise InvalidTopology(f"worker {wid} is listed more than once")
        seen.add(wid)
        check_range(block_size, start, size)
        ranks += size
    check_capacity(key, ranks)
