"""The typed answers of the kv-slot-tracker API.

They mirror the response schemas of the service's OpenAPI document (a test in the service's
repository compares them). Fields the service adds later are ignored rather than rejected, so an
older client keeps working against a newer service.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "BatchResponse",
    "BatchResult",
    "LoadRow",
    "LoraCounts",
    "PotentialLoadRow",
    "ProjectedLoadRow",
    "Rank",
    "ReadyBody",
    "ReconcileResult",
    "ReplicationStatus",
    "WorkerRow",
]


class WorkerRow(BaseModel):
    """A registered worker: its tracker and its data-parallel ranks."""

    worker_id: int
    model_name: str
    routing_group: str
    block_size: int
    dp_start: int
    dp_size: int


class LoadRow(BaseModel):
    """The current load of one rank."""

    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    active_prefill_tokens: int = Field(description="Prefill tokens still to compute now.")
    active_decode_blocks: int = Field(description="Unique active KV blocks (fractions weighted).")
    active_requests: int = Field(description="Active requests on the rank.")
    modeled_remaining_prefill_ms: int | None = Field(
        description="Modeled prefill time left, or None when a prefill has no duration."
    )


class PotentialLoadRow(BaseModel):
    """The load of one rank if a given prompt went there."""

    worker_id: int
    dp_rank: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int


class ProjectedLoadRow(BaseModel):
    """The current load of one rank and the blocks a given prompt would add there."""

    worker_id: int
    dp_rank: int
    active_prefill_tokens: int
    active_decode_blocks: int
    additional_active_blocks: int
    potential_decode_blocks: int


class Rank(BaseModel):
    """One data-parallel rank of a worker."""

    worker_id: int
    dp_rank: int


class ReconcileResult(BaseModel):
    """The ranks a reconcile added and removed."""

    added: list[Rank]
    removed: list[Rank]


class LoraCounts(BaseModel):
    """Active requests per LoRA adapter in one tracker."""

    model_name: str
    routing_group: str
    lora_counts: dict[str, int] = Field(description="Active requests per LoRA name.")


class BatchResult(BaseModel):
    """The outcome of one batched operation: its HTTP status and, when it failed, why."""

    status: int
    error: str | None = None


class BatchResponse(BaseModel):
    results: list[BatchResult]


class ReadyBody(BaseModel):
    """The readiness answer; ``reason`` says why when not ready."""

    status: Literal["ready", "not_ready"]
    reason: str | None = None


class ReplicationStatus(BaseModel):
    """Replication state: ``mode`` plus the mode's counters as extra fields (``model_extra``)."""

    model_config = ConfigDict(extra="allow")
    mode: str
