"""One command per selection-API operation: the only definition of each operation's inputs.

The HTTP edge builds these from validated bodies and path parameters; ``SelectionService``
executes them. Hashes are as on the wire (signed i64); the service normalises them. A prompt is
``token_ids`` (wins when present) or the triple ``block_hashes``, ``sequence_hashes``,
``isl_tokens``; which of them are required is the service's rule (SELECTION.md §3), so every
field is optional here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kv_slot_tracker.core.selection import RouterConfigOverride
from kv_slot_tracker.core.selection.catalog import WorkerSpec
from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.service.commands import DEFAULT_ROUTING_GROUP, Key

DEFAULT_MODEL = "default"


@dataclass(slots=True, kw_only=True)
class PartitionCommand:
    model_name: str = DEFAULT_MODEL
    routing_group: str = DEFAULT_ROUTING_GROUP

    @property
    def key(self) -> Key:
        return (self.model_name, self.routing_group)


# -- the worker catalog ----------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class UpsertWorker:
    """``POST /selection/workers``: create or replace a worker (it may move partition)."""

    spec: WorkerSpec


@dataclass(slots=True, kw_only=True)
class PatchWorker:
    """``PATCH /selection/workers/{id}``: apply the non-null ``changes`` (``WorkerSpec`` names)."""

    worker_id: int
    changes: dict[str, Any]


@dataclass(slots=True, kw_only=True)
class DeleteWorker:
    worker_id: int


# -- prompts and selection -------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class PromptCommand(PartitionCommand):
    token_ids: list[int] | None = None
    block_hashes: list[int] | None = None
    sequence_hashes: list[int] | None = None
    isl_tokens: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    """Folded into the token hashes (an engine's salted blocks match only a salted prompt)."""
    router_config_override: RouterConfigOverride | None = None


@dataclass(slots=True, kw_only=True)
class Select(PromptCommand):
    """``POST /selection/select`` (``reserve=False``) and ``/selection/select_and_reserve``."""

    selection_id: str | None = None
    pinned_worker: WorkerWithDpRank | None = None
    allowed_worker_ids: list[int] | None = None
    advisory: bool = False
    expected_output_tokens: int | None = None
    session_id: str | None = None
    reserve: bool = False


@dataclass(slots=True, kw_only=True)
class PotentialLoads(PromptCommand):
    pass


@dataclass(slots=True, kw_only=True)
class OverlapScores(PromptCommand):
    pass


# -- reservations ----------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class ReplaySelection(PartitionCommand):
    """``POST /selection/reservations`` without ``worker_id``: book a pending selection."""

    selection_id: str


@dataclass(slots=True, kw_only=True)
class BookExplicit(PromptCommand):
    """``POST /selection/reservations`` with ``worker_id``: book a prompt on a chosen rank."""

    selection_id: str
    worker_id: int
    dp_rank: int = 0
    effective_prefill_tokens: int | None = None
    track_prefill_tokens: bool | None = None
    expected_output_tokens: int | None = None


@dataclass(slots=True, kw_only=True)
class ReservationCall:
    """``prefill_complete`` and ``DELETE`` of ``/selection/reservations/{id}``."""

    selection_id: str
    cached_tokens: int | None = None
    """The prompt tokens the engine found cached (its ``usage.prompt_tokens_details.
    cached_tokens``), when the client reports it: the observed outcome of a routing receipt."""


@dataclass(slots=True, kw_only=True)
class ReservationOutputBlock:
    selection_id: str
    decay_fraction: float | None = None
