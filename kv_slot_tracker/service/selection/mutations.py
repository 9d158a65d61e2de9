"""Every change the selection service makes to its state, as one record type per kind of change.

Why records: ``SelectionService`` first decides (validation, the random pick, the generated id)
and only then changes its state, by handing one of these to its single ``commit`` method. A
record carries everything the change needs, so applying it is deterministic: the same record on
another instance would leave the same catalog, reservations, approximate cache and pending
selections. ``commit`` publishes the records other instances need (``kv_slot_tracker.service.selection.wire``
is their wire form, ``kv_slot_tracker.service.selection.replica`` applies a peer's). Nothing here knows HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_slot_tracker.core.selection.catalog import WorkerSpec
from kv_slot_tracker.core.selection.pending import PendingSelection
from kv_slot_tracker.core.types import WorkerWithDpRank


@dataclass(frozen=True, slots=True)
class PutWorker:
    """A worker registration or update: the complete resulting spec."""

    spec: WorkerSpec


@dataclass(frozen=True, slots=True)
class RemoveWorker:
    worker_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Book:
    """A reservation on one rank: its blocks, prefill tokens and approximate-cache write."""

    selection_id: str
    model_name: str
    routing_group: str
    worker: WorkerWithDpRank
    sequence_hashes: tuple[int, ...]
    block_hashes: tuple[int, ...] | None
    """Written to the approximate cache when given (signed, as every hash here)."""
    cache_chain: tuple[int, ...] | None
    """The block hashes' chained keys when already known (token prompts), else ``None``."""
    isl_tokens: int
    prefill_tokens: int
    """Prefill tokens the booking adds to the rank (0 when not tracked)."""
    expected_output_tokens: int | None = None
    lora_name: str | None = None
    consumes_pending: bool = True
    """Drop the partition's pending selection of this id (a replay or an explicit booking; a
    select_and_reserve leaves it, as the reference does)."""
    session_id: str | None = None
    """A select_and_reserve's session (session affinity on): every instance binds it to the
    booked worker."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.model_name, self.routing_group)


@dataclass(frozen=True, slots=True)
class CacheSelection:
    """A ``/select`` with a ``selection_id``: remember the pick for a later replay."""

    selection_id: str
    entry: PendingSelection


@dataclass(frozen=True, slots=True)
class CompletePrefill:
    selection_id: str


@dataclass(frozen=True, slots=True)
class AddOutputBlock:
    selection_id: str
    decay_fraction: float | None


@dataclass(frozen=True, slots=True)
class Release:
    selection_id: str


Mutation = (
    PutWorker | RemoveWorker | Book | CacheSelection | CompletePrefill | AddOutputBlock | Release
)
