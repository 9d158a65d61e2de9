"""The typed answers of the kv-slot-tracker API.

They mirror the response schemas of the service's OpenAPI document (a test in the service's
repository compares them). Fields the service adds later are ignored rather than rejected, so an
older client keeps working against a newer service.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "BatchResponse",
    "BatchResult",
    "LoadRow",
    "LoraCounts",
    "Overlap",
    "OverlapScoresResponse",
    "PartitionDump",
    "PartitionLoads",
    "PotentialLoadRow",
    "ProjectedLoadRow",
    "Rank",
    "RankLoad",
    "RankOverlap",
    "ReadyBody",
    "ReconcileResult",
    "ReplicationStatus",
    "ReservationResponse",
    "SelectAndReserveResponse",
    "SelectResponse",
    "SelectionReady",
    "SelectionStatus",
    "SharedCache",
    "WorkerLoad",
    "WorkerRecord",
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
    """Replication state of the instance answering (``mode`` ``embedded``, ``redis``, or
    ``local``: a process of a ``--workers`` supervisor sharing its state through the
    supervisor's hub).

    Fields a newer service adds are kept in ``model_extra``.
    """

    model_config = ConfigDict(extra="allow")
    mode: str
    instance_id: int
    namespace: str | None
    redis: str | None = Field(description="Where Redis is, password masked.")
    ready: bool
    not_ready_reason: str | None
    connected: bool | None
    degraded: bool
    degraded_reasons: list[str]
    stream_position: str | None
    outbox_depth: int
    outbox_capacity: int
    published: int
    applied: int
    duplicates: int
    dropped: int
    records_rejected: dict[str, int] = Field(description="Peers' records refused, by reason.")
    anomalies: dict[str, int] = Field(
        description="What the stream claimed and could not be trusted (forged sequence jumps, "
        "invalid snapshots, an exhausted stream...), by reason.",
    )
    gaps: int
    resets: int
    resent: int
    bootstraps: int
    snapshots_written: int
    last_applied_lag_ms: float | None
    snapshot_age_seconds: float | None
    snapshot_stream_id: str | None
    hub: dict[str, int] | None = Field(
        description="Mode local: the supervisor's hub as last heard (positions, counters)."
    )


# -- the selection API (``/selection``) -------------------------------------------------------


class SelectionStatus(BaseModel):
    """The selection API's liveness answer."""

    status: str = "ok"


class WorkerRecord(BaseModel):
    """A worker of the selection catalog.

    Every field the worker was posted with is echoed (``null`` when it was not given); those not
    declared here (``total_kv_blocks``, ``max_num_batched_tokens``, ``taints``, ...) are in
    ``model_extra``. ``not_schedulable_reasons`` is set only when ``lifecycle`` is not
    ``schedulable``.
    """

    model_config = ConfigDict(extra="allow")
    worker_id: int
    model_name: str
    routing_group: str
    lifecycle: str = Field(description="`schedulable`, `incomplete` or `unschedulable`.")
    endpoint: str | None
    block_size: int | None
    data_parallel_start_rank: int | None
    data_parallel_size: int | None
    replay_endpoints: list[str] | None = Field(
        None, description="Present only when the worker gave it (an extension)."
    )
    not_schedulable_reasons: list[str] | None = Field(
        None, description="Present only when the worker is not schedulable."
    )


class KvEventsReady(BaseModel):
    """With KV events on: the engines' publishers as the instance sees them."""

    recovering: bool = Field(description="Still loading the KV index from its peers at start.")
    peers: list[str]
    recovered_from: str | None
    listening_ranks: int
    disconnected_ranks: list[tuple[int, int]] = Field(
        description="``(worker_id, dp_rank)`` of the ranks with no connection to their publisher."
    )
    silent_ranks: list[tuple[int, int]] = Field(
        description="``(worker_id, dp_rank)`` of the ranks that sent nothing for a while."
    )


class SelectionReady(BaseModel):
    """The selection API's readiness answer: ready while some worker is schedulable."""

    ready: bool
    schedulable_workers: int
    workers: list[WorkerRecord] | None = Field(
        None, description="Absent when the service has a key and the client did not send it."
    )
    kv_events: KvEventsReady | None = None


class Overlap(BaseModel):
    """The prompt's cached prefix (in tokens) on the chosen worker."""

    longest_matched: int
    gpu: int
    dp: dict[str, int] = Field(description="Overlap tokens per dp rank of the chosen worker.")
    cpu: int
    disk: int


class WorkerLoad(BaseModel):
    """The chosen worker's load, in advisory selections."""

    active_prefill_tokens: int
    prefill_token_capacity: int
    total_kv_blocks: int | None = None


class SelectResponse(BaseModel):
    """The rank a selection chose and what the prompt would cost there."""

    selection_id: str | None = None
    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    endpoint: str
    block_size: int
    overlap: Overlap
    effective_prefill_tokens: int
    potential_decode_blocks: int
    worker_load: WorkerLoad | None = None


class SelectAndReserveResponse(SelectResponse):
    """A selection and its booking: the reservation id (generated when none was given), the
    prompt's sequence hashes (signed) and input length, and whether prefill tokens are tracked."""

    selection_id: str  # type: ignore[assignment]
    sequence_hashes: list[int]
    isl_tokens: int
    track_prefill_tokens: bool


class ReservationResponse(BaseModel):
    """A booked reservation and its rank."""

    selection_id: str
    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    endpoint: str


class RankLoad(BaseModel):
    """The load of one rank of a selection partition (with a prompt: if it went there)."""

    worker_id: int
    dp_rank: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int


class PartitionLoads(BaseModel):
    """The loads of one selection partition's ranks (``pending_count`` and
    ``pending_isl_tokens`` are the reference's router-queue counters: 0 without a queue)."""

    model_name: str
    routing_group: str
    loads: list[RankLoad]
    pending_count: int
    pending_isl_tokens: int


class RankOverlap(BaseModel):
    """The prompt's leading blocks a rank recently received (the approximate cache), per tier."""

    worker_id: int
    dp_rank: int
    device_blocks: int
    host_pinned_blocks: int
    disk_blocks: int
    host_pinned_extension_blocks: int
    disk_extension_blocks: int
    shared_beyond_device_blocks: int | None


class SharedCache(BaseModel):
    """The shared-cache tier (not implemented: always disabled)."""

    enabled: bool
    total_hit_blocks: int
    ranges: list[Any]
    error: str | None


class OverlapScoresResponse(BaseModel):
    """The prompt's cached prefix on every rank of a partition."""

    block_size: int
    num_blocks: int
    workers: list[RankOverlap]
    shared_cache: SharedCache


class PartitionDump(BaseModel):
    """One partition's approximate cache as stored events."""

    block_size: int
    events: list[dict[str, Any]] = Field(description="Stored events of the approximate cache.")
