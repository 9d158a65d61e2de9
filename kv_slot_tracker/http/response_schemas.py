"""Response models of the slot tracker's HTTP API: what each route answers, with the examples
the OpenAPI document shows.

The models only document the answers: the operations (``kv_slot_tracker.http.operations``) and
the query handlers (``kv_slot_tracker.http.queries``) encode them directly. The route table
(``kv_slot_tracker.http.routes``) names one per route; the request models are
``kv_slot_tracker.http.schemas``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kv_slot_tracker.replication import port


class StatusOk(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ok"}]})

    status: Literal["ok"] = "ok"


class ErrorBody(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"error": "Request r9 not found"}]})

    error: str = Field(description="What went wrong.")


class WorkerRow(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "worker_id": 1,
                    "model_name": "llama",
                    "routing_group": "default",
                    "block_size": 16,
                    "dp_start": 0,
                    "dp_size": 2,
                }
            ]
        }
    )

    worker_id: int
    model_name: str
    routing_group: str
    block_size: int
    dp_start: int
    dp_size: int


class LoadRow(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model_name": "llama",
                    "routing_group": "default",
                    "worker_id": 1,
                    "dp_rank": 0,
                    "active_prefill_tokens": 48,
                    "active_decode_blocks": 3,
                    "active_requests": 1,
                    "modeled_remaining_prefill_ms": None,
                },
                {
                    "model_name": "llama",
                    "routing_group": "default",
                    "worker_id": 1,
                    "dp_rank": 1,
                    "active_prefill_tokens": 0,
                    "active_decode_blocks": 0,
                    "active_requests": 0,
                    "modeled_remaining_prefill_ms": 0,
                },
            ]
        }
    )

    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    active_prefill_tokens: int = Field(description="Prefill tokens still to compute now.")
    active_decode_blocks: int = Field(description="Unique active KV blocks (fractions weighted).")
    active_requests: int = Field(description="Active requests on the rank.")
    modeled_remaining_prefill_ms: int | None = Field(
        description="Modeled prefill time left, or null when a prefill has no duration."
    )


class PotentialLoadRow(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "worker_id": 1,
                    "dp_rank": 0,
                    "potential_prefill_tokens": 96,
                    "potential_decode_blocks": 4,
                    "active_requests": 1,
                },
                {
                    "worker_id": 1,
                    "dp_rank": 1,
                    "potential_prefill_tokens": 48,
                    "potential_decode_blocks": 3,
                    "active_requests": 0,
                },
            ]
        }
    )

    worker_id: int
    dp_rank: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int


class ProjectedLoadRow(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "worker_id": 1,
                    "dp_rank": 0,
                    "active_prefill_tokens": 48,
                    "active_decode_blocks": 3,
                    "additional_active_blocks": 1,
                    "potential_decode_blocks": 4,
                },
                {
                    "worker_id": 1,
                    "dp_rank": 1,
                    "active_prefill_tokens": 0,
                    "active_decode_blocks": 0,
                    "additional_active_blocks": 3,
                    "potential_decode_blocks": 3,
                },
            ]
        }
    )

    worker_id: int
    dp_rank: int
    active_prefill_tokens: int
    active_decode_blocks: int
    additional_active_blocks: int
    potential_decode_blocks: int


class Rank(BaseModel):
    worker_id: int
    dp_rank: int


class ReconcileResult(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "added": [{"worker_id": 2, "dp_rank": 0}, {"worker_id": 2, "dp_rank": 1}],
                    "removed": [{"worker_id": 1, "dp_rank": 1}],
                }
            ]
        }
    )

    added: list[Rank]
    removed: list[Rank]


class LoraCounts(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model_name": "llama",
                    "routing_group": "default",
                    "lora_counts": {"sql-adapter": 1},
                }
            ]
        }
    )

    model_name: str
    routing_group: str
    lora_counts: dict[str, int] = Field(description="Active requests per LoRA name.")


class BatchResult(BaseModel):
    status: int
    error: str | None = None


class BatchResponse(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "results": [
                        {"status": 201},
                        {"status": 200},
                        {"status": 404, "error": "Request r9 not found"},
                    ]
                }
            ]
        }
    )

    results: list[BatchResult]


class ReadyBody(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"status": "ready", "reason": None},
                {
                    "status": "not_ready",
                    "reason": "Redis unreachable: Error 111 connecting to 127.0.0.1:1. Connect call "
                    "failed ('127.0.0.1', 1).",
                },
            ]
        }
    )

    status: Literal["ready", "not_ready"]
    reason: str | None = None


# ``GET /replication``: the replication port's own dataclass is the answer's schema, so the
# document lists every field the service answers (and no field it does not); this subclass only
# adds the example (an instance's answer on Redis).
@dataclass(slots=True)
class ReplicationStatus(port.ReplicationStatus):
    __pydantic_config__ = ConfigDict(
        json_schema_serialization_defaults_required=True,
        json_schema_extra={
            "examples": [
                {
                    "mode": "redis",
                    "instance_id": 14818628228872068829,
                    "namespace": "kv-slot-tracker",
                    "redis": "redis://127.0.0.1:6379/0",
                    "ready": True,
                    "not_ready_reason": None,
                    "connected": True,
                    "degraded": False,
                    "degraded_reasons": [],
                    "stream_position": "1796372882652-0",
                    "outbox_depth": 0,
                    "outbox_capacity": 100000,
                    "published": 1,
                    "applied": 0,
                    "duplicates": 0,
                    "dropped": 0,
                    "records_rejected": {
                        "undecodable": 0,
                        "seq_jump": 0,
                        "envelope": 0,
                        "topology": 0,
                        "event": 0,
                        "early": 0,
                        "selection": 0,
                        "conflict": 0,
                    },
                    "anomalies": {
                        "seq_jump": 0,
                        "new_origin_gap": 0,
                        "origins_evicted": 0,
                        "snapshot_invalid": 0,
                        "snapshot_lease_held": 0,
                        "stream_exhausted": 0,
                    },
                    "gaps": 0,
                    "resets": 0,
                    "resent": 0,
                    "bootstraps": 1,
                    "snapshots_written": 0,
                    "last_applied_lag_ms": None,
                    "snapshot_age_seconds": None,
                    "snapshot_stream_id": None,
                    "hub": None,
                }
            ]
        },
    )
