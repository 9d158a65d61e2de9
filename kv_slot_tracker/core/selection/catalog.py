"""The selection service's worker catalog records: what a worker declared and whether it can serve.

Why it is separate from the slot trackers' topology: the selection API registers workers with a
service-wide id, an endpoint and a block size, and keeps a worker that cannot serve yet
(``incomplete``) with the reasons (SELECTION.md §2). Only a *schedulable* worker's ranks
``data_parallel_start_rank .. +data_parallel_size-1`` are placed in the slot tracker of its
partition ``(model_name, routing_group)``. The rules here are pure: which fields a record echoes,
which reasons keep a worker off the schedule, and how a partial update (PATCH) merges.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..limits import MAX_DP_SIZE as MAX_DP_SIZE  # the slot-tracker routes' limit, re-exported
from ..types import U32_MAX, WorkerDpRange

SCHEDULABLE = "schedulable"
INCOMPLETE = "incomplete"
UNSCHEDULABLE = "unschedulable"

DEFAULT_GROUP = "default"
DEFAULT_MODEL = "default"


# what ``kv_transfer_enforcement`` may be (the reference's variants)
KV_TRANSFER_ENFORCEMENTS = ("required", "preferred")

ENDPOINT_REQUIRED = "endpoint is required"
BLOCK_SIZE_ZERO = "block_size must be greater than 0"
DP_SIZE_ZERO = "data_parallel_size must be greater than 0"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """Every field a worker registration carries, as given (``None`` when absent).

    ``data_parallel_start_rank`` and ``data_parallel_size`` stay ``None`` when omitted (the record
    echoes ``null``); ``dp_range`` applies their defaults (0 and 1).
    """

    worker_id: int
    model_name: str = DEFAULT_MODEL
    routing_group: str = DEFAULT_GROUP
    endpoint: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_endpoints: dict[str, str] | None = None
    replay_endpoint: str | None = None
    block_size: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_size: int | None = None
    max_num_batched_tokens: int | None = None
    total_kv_blocks: int | None = None
    stable_routing_id: str | None = None
    is_eagle: bool | None = None
    taints: tuple[str, ...] = ()
    topology_domains: dict[str, str] | None = None
    kv_transfer_domain: str | None = None
    kv_transfer_enforcement: str | None = None
    kv_transfer_preferred_weight: float | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.model_name, self.routing_group)

    @property
    def dp_start(self) -> int:
        return self.data_parallel_start_rank if self.data_parallel_start_rank is not None else 0

    @property
    def dp_size(self) -> int:
        return self.data_parallel_size if self.data_parallel_size is not None else 1

    @property
    def dp_range(self) -> WorkerDpRange:
        return WorkerDpRange(self.worker_id, self.dp_start, self.dp_size)

    def has_rank(self, dp_rank: int) -> bool:
        return self.dp_start <= dp_rank < self.dp_start + self.dp_size


# Fields a PATCH may change: everything but the id and the partition (the reference ignores
# `model_name` and `routing_group` in a PATCH).
PATCHABLE = tuple(
    f.name for f in fields(WorkerSpec) if f.name not in ("worker_id", "model_name", "routing_group")
)


def patched(spec: WorkerSpec, changes: dict[str, Any]) -> WorkerSpec:
    """``spec`` with the PATCH's non-null fields applied (a null or absent field keeps its value)."""
    given = {k: v for k, v in changes.items() if k in PATCHABLE and v is not None}
    return replace(spec, **given) if given else spec


def intrinsic_reasons(spec: WorkerSpec) -> list[str]:
    """Why the worker cannot be scheduled on its own (before looking at its partition)."""
    reasons = []
    if not spec.endpoint:
        reasons.append(ENDPOINT_REQUIRED)
    if not spec.block_size:
        reasons.append(BLOCK_SIZE_ZERO)
    if spec.dp_size == 0:
        reasons.append(DP_SIZE_ZERO)
    elif spec.dp_size > MAX_DP_SIZE:
        reasons.append(f"data_parallel_size must be at most {MAX_DP_SIZE}")
    elif spec.dp_start + spec.dp_size - 1 > U32_MAX:
        reasons.append(
            f"data_parallel_start_rank + data_parallel_size must not exceed {U32_MAX + 1}"
        )
    return reasons


def block_size_mismatch(key: tuple[str, str], existing: int, requested: int) -> str:
    return (
        f"reconciliation failed: block_size mismatch for model={key[0]} "
        f"routing_group={key[1]}: existing={existing} requested={requested}"
    )


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A catalog entry: the spec, its lifecycle and, when not schedulable, the reasons."""

    spec: WorkerSpec
    lifecycle: str
    reasons: tuple[str, ...] = ()

    @property
    def schedulable(self) -> bool:
        return self.lifecycle == SCHEDULABLE
