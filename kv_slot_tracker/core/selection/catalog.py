"""The selection service's worker catalog records: what a worker declared and whether it can serve.

Why it is separate from the slot trackers' topology: the selection API registers workers with a
service-wide id, an endpoint and a block size, and keeps a worker that cannot serve yet
(``incomplete``) with the reasons (SELECTION.md §2). Only a *schedulable* worker's ranks
``data_parallel_start_rank .. +data_parallel_size-1`` are placed in the slot tracker of its
partition ``(model_name, routing_group)``. The rules here are pure: which fields a record echoes,
which reasons keep a worker off the schedule, and how a partial update (PATCH) merges.
"""

from __future__ import annotations

import re
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
# With KV events on (as the reference): the replay protocol carries no rank and each rank
# publishes on its own sockets, so one replay endpoint cannot serve several ranks.
REPLAY_NEEDS_ONE_RANK = "replay_endpoint is supported only for data_parallel_size 1"

# ``replay_endpoints`` (an extension of the reference's body): one replay socket per dp rank,
# entry i for rank ``data_parallel_start_rank + i``. An address a ZMQ DEALER can connect to:
# ``tcp://HOST:PORT`` or ``ipc://PATH``.
_ZMQ_ADDRESS = re.compile(r"tcp://[^\s/]+:[0-9]{1,5}|ipc://\S+")


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
    replay_endpoints: tuple[str, ...] | None = None
    """One replay socket per dp rank (an extension of the reference's body, declared last as
    the replica record declares it: entry i serves rank ``dp_start + i``)."""

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

    def replay_for(self, dp_rank: int) -> str | None:
        """The replay socket of ``dp_rank``: its ``replay_endpoints`` entry, else the one
        ``replay_endpoint`` of a worker of one rank (one socket cannot serve several ranks)."""
        if self.replay_endpoints is not None:
            i = dp_rank - self.dp_start
            return self.replay_endpoints[i] if 0 <= i < len(self.replay_endpoints) else None
        return self.replay_endpoint or None if self.dp_size == 1 else None


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


def replay_endpoints_problem(spec: WorkerSpec) -> str | None:
    """Why the spec's ``replay_endpoints`` cannot be taken (None when it can, or is absent).

    Checked on every registration and on the result of every PATCH, before anything changes:
    the list belongs to the worker's ranks, so it is refused (not kept ``incomplete``) when it
    does not fit them. O(len(replay_endpoints)).
    """
    given = spec.replay_endpoints
    if given is None:
        return None
    if spec.replay_endpoint is not None:
        return "give either replay_endpoint or replay_endpoints, not both"
    if len(given) != spec.dp_size:
        return (
            f"replay_endpoints must have one entry per dp rank: data_parallel_size is "
            f"{spec.dp_size}, replay_endpoints has {len(given)}"
        )
    for i, address in enumerate(given):
        if not _ZMQ_ADDRESS.fullmatch(address) or (
            address.startswith("tcp") and int(address.rpartition(":")[2]) > 65535
        ):
            return f"replay_endpoints[{i}] must be tcp://HOST:PORT or ipc://PATH"
    return None


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
