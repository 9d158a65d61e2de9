"""Request models of the selection API (``/selection/*``, SELECTION.md), and how the reference's
serde words a body of the wrong shape on these routes (``SERDE``); the answers' models are in
``kv_slot_tracker.http.selection.responses``.

Request models validate JSON bytes with strict types, as the slot-tracker models do
(``kv_slot_tracker.http.schemas``): integers must be JSON integers in the Rust type's range, strings must be
strings, and ``null`` is accepted only where the reference's field is optional. Unknown fields are
ignored. Which prompt fields are required is decided by the service (SELECTION.md §3), so every
prompt field is optional here.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    WithJsonSchema,
)

from kv_slot_tracker.core.selection.catalog import KV_TRANSFER_ENFORCEMENTS
from kv_slot_tracker.core.serde.sequences import SeqField, SeqStruct
from kv_slot_tracker.core.serde.shapes import SerdeDialect
from kv_slot_tracker.http.schemas import U32, U64, Hash, Id, Name, Text, TokenId

USIZE = U64

MODEL = Field("default", description="Model name (default `default`); with the routing group "
              "it names one partition.")  # fmt: skip
GROUP = Field("default", description="Routing group inside the model (default `default`).")
TOKEN_IDS = Field(
    None,
    description="Prompt token ids (u32), hashed with the partition's block size and `lora_name`; "
    "when present the hash fields are ignored.",
)
BLOCK_HASHES = Field(
    None,
    description="Local block hashes of the prompt's full blocks (signed i64); they feed the "
    "approximate cache. Required without `token_ids`.",
)
SEQUENCE_HASHES = Field(
    None,
    description="Chained sequence hashes of the same blocks (signed i64); they drive active-block "
    "accounting. Required without `token_ids`, same length as `block_hashes`.",
)
ISL = Field(None, description="Input length in tokens. Required (> 0) without `token_ids`.")


# How the reference's serde words a body of the wrong shape on these routes (``parse_json``).
_STRINGS = ("model_name", "routing_group", "selection_id", "session_id", "lora_name",
            "cache_salt", "endpoint", "kv_events_endpoint", "replay_endpoint",
            "stable_routing_id", "kv_transfer_domain")  # fmt: skip
# The reference's WorkerPatchRequest fields in declaration order (WorkerRequest has the same
# between its own): serde also reads those structs from a JSON array, element i as field i
# (``core.serde.sequences.SeqStruct``); found by probing the reference field by field.
_WORKER_SEQUENCE = (
    SeqField("endpoint", "a string"),
    SeqField("kv_events_endpoint", "a string"),
    SeqField("kv_events_endpoints", "a map", keys="u32"),
    SeqField("replay_endpoint", "a string"),
    SeqField("block_size", "u32"),
    SeqField("data_parallel_start_rank", "u32"),
    SeqField("data_parallel_size", "u32"),
    SeqField("max_num_batched_tokens", "u64"),
    SeqField("total_kv_blocks", "u64"),
    SeqField("stable_routing_id", "a string"),
    SeqField("is_eagle", "a boolean"),
    SeqField("taints", "a sequence"),
    SeqField("topology_domains", "a map"),
    SeqField("kv_transfer_domain", "a string"),
    SeqField("kv_transfer_enforcement", "enum", variants=KV_TRANSFER_ENFORCEMENTS),
    SeqField("kv_transfer_preferred_weight", "f32"),
)
SERDE = SerdeDialect(
    types={
        **dict.fromkeys(_STRINGS, "a string"),
        **dict.fromkeys(("worker_id", "max_num_batched_tokens", "total_kv_blocks"), "u64"),
        **dict.fromkeys(
            (
                "block_size",
                "data_parallel_start_rank",
                "data_parallel_size",
                "dp_rank",
                "expected_output_tokens",
            ),
            "u32",
        ),  # fmt: skip
        **dict.fromkeys(("isl_tokens", "effective_prefill_tokens"), "usize"),
        **dict.fromkeys(("advisory", "track_prefill_tokens", "is_eagle"), "a boolean"),
        **dict.fromkeys(
            ("sequence_hashes", "block_hashes", "token_ids", "taints", "allowed_worker_ids",
             "replay_endpoints"),
            "a sequence",
        ),  # fmt: skip
        **dict.fromkeys(("topology_domains", "kv_events_endpoints"), "a map"),
        "decay_fraction": "f64",
        "kv_transfer_preferred_weight": "f32",
        "router_config_override": "struct RouterConfigOverrideSerde",
    },
    items={
        "sequence_hashes": "i64",
        "block_hashes": "i64",
        "token_ids": "u32",
        "allowed_worker_ids": "u64",
        "taints": "a string",
        "replay_endpoints": "a string",
    },  # fmt: skip
    # the prompt's fields are a flattened struct in the reference
    flattened=frozenset(
        ("token_ids", "block_hashes", "sequence_hashes", "isl_tokens", "lora_name", "cache_salt")
    ),
    structs={"SelectBody": "SelectRequest", "ReservationOutputBlockBody": "OutputBlockRequest"},
    sequences={
        "WorkerBody": SeqStruct("WorkerRequest", (
            SeqField("worker_id", "u64", nullable=False),
            SeqField("model_name", "a string", nullable=False, default=True),
            SeqField("routing_group", "a string", nullable=False, default=True),
            *_WORKER_SEQUENCE[:2],
            SeqField("kv_events_endpoints", "a map", keys="u32", nullable=False, default=True),
            *_WORKER_SEQUENCE[3:11],
            SeqField("taints", "a sequence", nullable=False, default=True),
            SeqField("topology_domains", "a map", nullable=False, default=True),
            *_WORKER_SEQUENCE[13:16],
            SeqField(None, "a string", default=True),  # router_hint_worker_type
            SeqField(None, "a map", nullable=False, default=True),  # ..._control_endpoints
            SeqField(None, "a string", default=True),  # kv_event_source_mode
        )),
        "WorkerPatchBody": SeqStruct("WorkerPatchRequest", (
            *_WORKER_SEQUENCE,
            SeqField(None, "a string", default=True),  # router_hint_worker_type
            SeqField(None, "a map", default=True),  # router_hint_source_control_endpoints
            SeqField(None, "a string", default=True),  # kv_event_source_mode
        )),
        "ReservationOutputBlockBody": SeqStruct(
            "OutputBlockRequest", (SeqField("decay_fraction", "f64"),)
        ),
    },
)  # fmt: skip


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


# -- workers ---------------------------------------------------------------------------------


class _WorkerFields(_Body):
    endpoint: Text | None = Field(None, description="Where the worker serves; required to "
                                       "be schedulable.")  # fmt: skip
    kv_events_endpoint: Text | None = Field(None, description="Accepted and echoed.")
    kv_events_endpoints: dict[Text, Text] | None = Field(
        None, description="Per dp rank (keys are numbers in quotes); accepted and echoed."
    )
    replay_endpoint: Text | None = Field(
        None,
        description="The engine's replay socket; with KV events on, only for a worker of one "
        "dp rank (see `replay_endpoints`).",
    )
    replay_endpoints: list[Text] | None = Field(
        None,
        description="Extension: one replay socket per dp rank, entry i for rank "
        "`data_parallel_start_rank + i`; exactly `data_parallel_size` entries, each "
        "`tcp://HOST:PORT` or `ipc://PATH`; not with `replay_endpoint`. Not read from the "
        "array form of the body.",
    )
    block_size: U32 | None = Field(
        None,
        description="Tokens per KV block (> 0); the first schedulable worker of a "
        "partition fixes it.",
    )
    data_parallel_start_rank: U32 | None = Field(None, description="First dp rank (default 0).")
    data_parallel_size: U32 | None = Field(None, description="Number of dp ranks (default 1).")
    max_num_batched_tokens: U64 | None = Field(
        None, description="Reported as `prefill_token_capacity` by advisory selections."
    )
    total_kv_blocks: U64 | None = Field(None, description="Reported by advisory selections.")
    stable_routing_id: Text | None = Field(None, description="Accepted and echoed.")
    is_eagle: StrictBool | None = Field(None, description="Accepted and echoed.")
    kv_transfer_domain: Text | None = Field(None, description="Accepted and echoed.")
    kv_transfer_enforcement: (
        Annotated[Text, WithJsonSchema({"type": "string", "enum": list(KV_TRANSFER_ENFORCEMENTS)})]
        | None
    ) = Field(None, description="`required` or `preferred`; accepted and echoed.")
    kv_transfer_preferred_weight: StrictFloat | StrictInt | None = Field(
        None, description="f32; accepted and echoed."
    )


class WorkerBody(_WorkerFields):
    worker_id: U64 = Field(description="Service-wide worker id.")
    model_name: Name = MODEL
    routing_group: Name = GROUP
    taints: list[Text] = Field(default_factory=list, description="Accepted and echoed.")
    topology_domains: dict[Text, Text] = Field(
        default_factory=dict, description="Accepted and echoed."
    )

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "worker_id": 1,
                    "model_name": "llama",
                    "endpoint": "http://10.0.0.1:8000",
                    "block_size": 16,
                    "data_parallel_size": 2,
                }
            ]
        }
    )


class WorkerPatchBody(_WorkerFields):
    """Only the non-null fields change; `worker_id`, `model_name` and `routing_group` are
    ignored (a worker moves partition with `POST /selection/workers`)."""

    taints: list[Text] | None = Field(None, description="Replaces the taints when given.")
    topology_domains: dict[Text, Text] | None = Field(
        None, description="Replaces the topology domains when given."
    )

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"data_parallel_size": 4, "endpoint": "http://w1:8000"}]}
    )


# -- prompts and selection -------------------------------------------------------------------


class PinnedWorker(_Body):
    worker_id: U64
    dp_rank: U32


class PromptBody(_Body):
    model_name: Name = MODEL
    routing_group: Name = GROUP
    token_ids: list[TokenId] | None = TOKEN_IDS
    block_hashes: list[Hash] | None = BLOCK_HASHES
    sequence_hashes: list[Hash] | None = SEQUENCE_HASHES
    isl_tokens: USIZE | None = ISL
    lora_name: Name | None = Field(None, description="LoRA adapter; changes token hashes.")
    cache_salt: Text | None = Field(
        None,
        description="Cache namespace; a non-empty salt changes token hashes (an engine's salted "
        "blocks match only the same salt).",
    )
    router_config_override: dict[str, Any] | None = Field(
        None,
        description="Per-request knobs, validated as the reference does: `overlap_score_credit`, "
        "`prefill_load_scale` (alias `overlap_score_weight`), `router_temperature`, "
        "`track_prefill_tokens`, `assume_kv_reuse`, `shared_cache_multiplier`. As in Dynamo "
        "1.6.1 only `track_prefill_tokens` takes effect (the cost, the booking, potential loads).",
    )

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model_name": "llama",
                    "block_hashes": [11, 12],
                    "sequence_hashes": [11, 5417695437591212399],
                    "isl_tokens": 32,
                }
            ]
        }
    )


class SelectBody(PromptBody):
    selection_id: Id | None = Field(
        None,
        description="Caches the pick for a later `POST /selection/reservations` "
        "(on select) or names the reservation (select_and_reserve; a UUID when absent).",
    )
    session_id: Text | None = Field(
        None,
        description="With session_affinity_ttl_seconds > 0: a booking binds the session to its "
        "worker, and later selections of the session stay on it.",
    )
    expected_output_tokens: U32 | None = Field(None, description="Stored with a booking.")
    pinned_worker: PinnedWorker | None = Field(None, description="Forces this rank.")
    allowed_worker_ids: list[U64] | None = Field(
        None, description="Only ranks of these workers are candidates."
    )
    advisory: StrictBool = Field(False, description="Adds `worker_load` to the answer.")


class ReservationBody(PromptBody):
    selection_id: Id = Field(description="The reservation id (global across models).")
    worker_id: U64 | None = Field(
        None,
        description="Explicit form: book on this worker; absent or null: replay the "
        "pending selection of `selection_id`.",
    )
    dp_rank: U32 | None = Field(None, description="Explicit form: the rank (default 0).")
    effective_prefill_tokens: USIZE | None = Field(
        None, description="Explicit form: prefill tokens the booking adds (<= isl_tokens)."
    )
    track_prefill_tokens: StrictBool | None = Field(
        None, description="Explicit form: false books no prefill tokens."
    )
    expected_output_tokens: U32 | None = Field(None, description="Stored with the booking.")

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"selection_id": "req-1", "model_name": "llama"},
                {
                    "selection_id": "req-2",
                    "model_name": "llama",
                    "worker_id": 1,
                    "dp_rank": 0,
                    "block_hashes": [11],
                    "sequence_hashes": [11],
                    "isl_tokens": 16,
                    "effective_prefill_tokens": 16,
                },
            ]
        }
    )


class ReservationOutputBlockBody(_Body):
    decay_fraction: (
        Annotated[
            StrictFloat | StrictInt,
            # checked by the service, with the reference's 400 text; stated here for clients
            WithJsonSchema({"type": "number", "minimum": 0, "maximum": 1}),
        ]
        | None
    ) = Field(None, description="0..1: weight of the blocks held only by this reservation.")

    model_config = ConfigDict(json_schema_extra={"examples": [{"decay_fraction": 0.5}]})
