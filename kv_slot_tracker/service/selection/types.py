"""Value types of the selection service: partitions, reservations and the answers it builds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kv_slot_tracker.core.selection import ApproximateCache, Prompt, Selection
from kv_slot_tracker.core.selection.catalog import WorkerSpec
from kv_slot_tracker.core.selection.kv_index import KvIndex
from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.service.commands import Key


@dataclass(slots=True)
class Partition:
    """One ``(model_name, routing_group)`` as the selection service sees it."""

    key: Key
    block_size: int
    cache: ApproximateCache
    workers: dict[int, WorkerSpec] = field(default_factory=dict)
    index: KvIndex = field(default_factory=KvIndex)
    """What the ranks really hold, from their engines' KV events (KV events on)."""
    """The schedulable workers placed in this partition's tracker."""


@dataclass(slots=True)
class Reservation:
    key: Key
    worker: WorkerWithDpRank
    created_at: int
    lingering: bool = False
    """Its worker (or rank) was removed: the request is gone but the id stays taken until a
    lifecycle call on it answers 404 (the reference's rule)."""


SELECTION_OUTCOMES = ("select", "select_and_reserve", "replay", "explicit")
"""How a rank was chosen: ``/select``, ``/select_and_reserve``, and the two bookings of
``POST /reservations`` (a pending selection replayed, or a prompt on a given rank)."""


@dataclass(slots=True)
class SelectionCounters:
    """Successful selections and bookings per partition and outcome (never reset; read by the
    metrics at scrape time, so a call costs one dict update)."""

    made: dict[tuple[Key, str], int] = field(default_factory=dict)

    def count(self, key: Key, outcome: str) -> None:
        made = self.made
        made[key, outcome] = made.get((key, outcome), 0) + 1


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """The ``worker_load`` block of an advisory selection."""

    active_prefill_tokens: int
    prefill_token_capacity: int
    total_kv_blocks: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class SelectOutcome:
    selection_id: str | None
    model_name: str
    routing_group: str
    endpoint: str
    block_size: int
    selection: Selection
    prompt: Prompt
    track_prefill_tokens: bool
    worker_load: WorkerLoad | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Booked:
    selection_id: str
    model_name: str
    routing_group: str
    worker: WorkerWithDpRank
    endpoint: str


@dataclass(frozen=True, slots=True)
class OverlapScores:
    block_size: int
    num_blocks: int
    rows: list[tuple[int, int, int]]
    """``(worker_id, dp_rank, device_blocks)`` per candidate rank, sorted."""
    extensions: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    """``(worker_id, dp_rank) -> (host_pinned_extension, disk_extension)`` where not 0."""


# (worker_id, dp_rank, potential_prefill_tokens, potential_decode_blocks, active_requests)
LoadRow = tuple[int, int, int, int, int]


class Candidates(NamedTuple):
    """The candidate ranks of one selection as columns (``select_columns``' arguments)."""

    workers: list[WorkerWithDpRank]
    prefill: list[int]
    """P: prefill tokens pending on the rank."""
    decode: list[int]
    """D + new: active blocks plus the prompt's blocks not active on the rank."""
    requests: list[int]
    """A: requests booked on the rank."""
    overlap: list[int]
    """k: leading prompt blocks the approximate cache (or, KV events on, the device tier of the
    index) holds on the rank."""
    lower: list[tuple[int, int]] | None = None
    """KV events on, when some rank holds prompt blocks in host or disk memory: per rank its
    ``(host_pinned_extension, disk_extension)`` blocks."""
