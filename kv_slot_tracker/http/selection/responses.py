"""Response models of the selection API (``/selection/*``, SELECTION.md): what each route
answers, with the examples the OpenAPI document shows."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class SelectionStatus(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ok"}]})

    status: str = "ok"


WORKER_EXAMPLE: dict[str, Any] = {
    "worker_id": 7,
    "model_name": "qwen",
    "routing_group": "default",
    "lifecycle": "schedulable",
    "endpoint": "http://w7:8000",
    "kv_events_endpoint": None,
    "replay_endpoint": None,
    "block_size": 16,
    "data_parallel_start_rank": None,
    "data_parallel_size": 2,
    "max_num_batched_tokens": None,
    "total_kv_blocks": None,
    "stable_routing_id": None,
    "is_eagle": None,
    "taints": [],
    "topology_domains": {},
    "kv_transfer_domain": None,
    "kv_transfer_enforcement": None,
    "kv_transfer_preferred_weight": None,
}
"""A schedulable worker as the service answers it (the examples of the worker routes)."""


class WorkerRecord(BaseModel):
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "examples": [
                WORKER_EXAMPLE,
                {
                    **WORKER_EXAMPLE,
                    "worker_id": 8,
                    "lifecycle": "incomplete",
                    "endpoint": None,
                    "data_parallel_size": None,
                    "not_schedulable_reasons": ["endpoint is required"],
                },
            ]
        },
    )
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
    recovering: bool = Field(
        description="Still loading the KV index from `indexer_peers` at start (not ready)."
    )
    peers: list[str] = Field(description="The `indexer_peers`.")
    recovered_from: str | None = Field(description="The peer the index was loaded from.")
    listening_ranks: int = Field(description="Ranks subscribed to their engine's publisher.")
    disconnected_ranks: list[tuple[int, int]] = Field(
        description="`[worker_id, dp_rank]` of the ranks with no connection to their publisher."
    )
    silent_ranks: list[tuple[int, int]] = Field(
        description="`[worker_id, dp_rank]` of the ranks that sent nothing for "
        "`kv_events_silent_seconds` (their blocks stay indexed, the worker schedulable)."
    )


class SelectionReady(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "ready": True,
                    "schedulable_workers": 1,
                    "workers": [WORKER_EXAMPLE],
                },
                {"ready": False, "schedulable_workers": 0, "workers": []},
            ]
        }
    )

    ready: bool
    schedulable_workers: int
    workers: list[WorkerRecord] | None = Field(
        None, description="Absent when a key is set and the caller did not send it."
    )
    kv_events: KvEventsReady | None = Field(
        None, description="With KV events on: the engines' publishers as this instance sees them."
    )


class Overlap(BaseModel):
    longest_matched: int
    gpu: int
    dp: dict[str, int] = Field(description="Overlap tokens per dp rank of the chosen worker.")
    cpu: int
    disk: int


class WorkerLoad(BaseModel):
    active_prefill_tokens: int
    prefill_token_capacity: int
    total_kv_blocks: int | None = None


class SelectResponse(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "selection_id": "req-1",
                    "model_name": "qwen",
                    "routing_group": "default",
                    "worker_id": 7,
                    "dp_rank": 1,
                    "endpoint": "http://w7:8000",
                    "block_size": 16,
                    "overlap": {
                        "longest_matched": 0,
                        "gpu": 0,
                        "dp": {"0": 0, "1": 0},
                        "cpu": 0,
                        "disk": 0,
                    },
                    "effective_prefill_tokens": 33,
                    "potential_decode_blocks": 3,
                }
            ]
        }
    )

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
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "selection_id": "req-2",
                    "sequence_hashes": [-1583300653928780152, -5980354406663771828],
                    "isl_tokens": 33,
                    "track_prefill_tokens": True,
                    "model_name": "qwen",
                    "routing_group": "default",
                    "worker_id": 8,
                    "dp_rank": 0,
                    "endpoint": "http://w8:8000",
                    "block_size": 16,
                    "overlap": {
                        "longest_matched": 0,
                        "gpu": 0,
                        "dp": {"0": 0},
                        "cpu": 0,
                        "disk": 0,
                    },
                    "effective_prefill_tokens": 33,
                    "potential_decode_blocks": 3,
                }
            ]
        }
    )

    selection_id: str
    sequence_hashes: list[int]
    isl_tokens: int
    track_prefill_tokens: bool


class ReservationResponse(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "selection_id": "req-1",
                    "model_name": "qwen",
                    "routing_group": "default",
                    "worker_id": 7,
                    "dp_rank": 1,
                    "endpoint": "http://w7:8000",
                }
            ]
        }
    )

    selection_id: str
    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    endpoint: str


class RankLoad(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "worker_id": 7,
                    "dp_rank": 0,
                    "potential_prefill_tokens": 33,
                    "potential_decode_blocks": 2,
                    "active_requests": 0,
                },
                {
                    "worker_id": 7,
                    "dp_rank": 1,
                    "potential_prefill_tokens": 1,
                    "potential_decode_blocks": 2,
                    "active_requests": 1,
                },
                {
                    "worker_id": 8,
                    "dp_rank": 0,
                    "potential_prefill_tokens": 34,
                    "potential_decode_blocks": 2,
                    "active_requests": 1,
                },
            ]
        }
    )

    worker_id: int
    dp_rank: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int


class PartitionLoads(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model_name": "qwen",
                    "routing_group": "default",
                    "loads": [
                        {
                            "worker_id": 7,
                            "dp_rank": 0,
                            "potential_prefill_tokens": 0,
                            "potential_decode_blocks": 0,
                            "active_requests": 0,
                        },
                        {
                            "worker_id": 7,
                            "dp_rank": 1,
                            "potential_prefill_tokens": 0,
                            "potential_decode_blocks": 2,
                            "active_requests": 1,
                        },
                        {
                            "worker_id": 8,
                            "dp_rank": 0,
                            "potential_prefill_tokens": 33,
                            "potential_decode_blocks": 2,
                            "active_requests": 1,
                        },
                    ],
                    "pending_count": 0,
                    "pending_isl_tokens": 0,
                }
            ]
        }
    )

    model_name: str
    routing_group: str
    loads: list[RankLoad]
    pending_count: int
    pending_isl_tokens: int


class RankOverlap(BaseModel):
    worker_id: int
    dp_rank: int
    device_blocks: int
    host_pinned_blocks: int
    disk_blocks: int
    host_pinned_extension_blocks: int
    disk_extension_blocks: int
    shared_beyond_device_blocks: int | None


class SharedCache(BaseModel):
    enabled: bool
    total_hit_blocks: int
    ranges: list[Any]
    error: str | None


class OverlapScoresResponse(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "block_size": 16,
                    "num_blocks": 2,
                    "workers": [
                        {
                            "worker_id": 7,
                            "dp_rank": 0,
                            "device_blocks": 0,
                            "host_pinned_blocks": 0,
                            "disk_blocks": 0,
                            "host_pinned_extension_blocks": 0,
                            "disk_extension_blocks": 0,
                            "shared_beyond_device_blocks": None,
                        },
                        {
                            "worker_id": 7,
                            "dp_rank": 1,
                            "device_blocks": 2,
                            "host_pinned_blocks": 2,
                            "disk_blocks": 2,
                            "host_pinned_extension_blocks": 0,
                            "disk_extension_blocks": 0,
                            "shared_beyond_device_blocks": None,
                        },
                        {
                            "worker_id": 8,
                            "dp_rank": 0,
                            "device_blocks": 2,
                            "host_pinned_blocks": 2,
                            "disk_blocks": 2,
                            "host_pinned_extension_blocks": 0,
                            "disk_extension_blocks": 0,
                            "shared_beyond_device_blocks": None,
                        },
                    ],
                    "shared_cache": {
                        "enabled": False,
                        "total_hit_blocks": 0,
                        "ranges": [],
                        "error": None,
                    },
                }
            ]
        }
    )

    block_size: int
    num_blocks: int
    workers: list[RankOverlap]
    shared_cache: SharedCache


class PartitionDump(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "block_size": 16,
                    "events": [
                        {
                            "worker_id": 7,
                            "storage_tier": "device",
                            "residency_domain": "worker",
                            "event": {
                                "event_id": 0,
                                "data": {
                                    "stored": {
                                        "parent_hash": None,
                                        "start_position": None,
                                        "blocks": [
                                            {
                                                "block_hash": 16863443419780771464,
                                                "tokens_hash": 16863443419780771464,
                                                "mm_extra_info": None,
                                            },
                                            {
                                                "block_hash": 12466389667045779788,
                                                "tokens_hash": 2287610619914608821,
                                                "mm_extra_info": None,
                                            },
                                        ],
                                    }
                                },
                                "dp_rank": 1,
                            },
                        },
                        {
                            "worker_id": 8,
                            "storage_tier": "device",
                            "residency_domain": "worker",
                            "event": {
                                "event_id": 1,
                                "data": {
                                    "stored": {
                                        "parent_hash": None,
                                        "start_position": None,
                                        "blocks": [
                                            {
                                                "block_hash": 16863443419780771464,
                                                "tokens_hash": 16863443419780771464,
                                                "mm_extra_info": None,
                                            },
                                            {
                                                "block_hash": 12466389667045779788,
                                                "tokens_hash": 2287610619914608821,
                                                "mm_extra_info": None,
                                            },
                                        ],
                                    }
                                },
                                "dp_rank": 0,
                            },
                        },
                    ],
                }
            ]
        }
    )

    block_size: int
    events: list[dict[str, Any]] = Field(description="Stored events of the approximate cache.")
