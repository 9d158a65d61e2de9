"""Request body models of the slot tracker's HTTP API, and the field types the selection API's
request models share (its response models are ``kv_slot_tracker.http.response_schemas``).

The models validate JSON bytes directly (``model_validate_json``) with strict types: integers
must be JSON integers in range (no floats, strings or booleans), strings must be strings, and an
explicit ``null`` for a field with a default is rejected, as the reference service does. Unknown
fields are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    WithJsonSchema,
)

from kv_slot_tracker.core.limits import (
    MAX_DP_SIZE,
    MAX_ID_LENGTH,
    MAX_NAME_LENGTH,
    MAX_PREFILL_MS,
    MAX_RANKS_PER_TRACKER,
    MAX_TEXT_LENGTH,
)
from kv_slot_tracker.core.types import I64_MAX, I64_MIN, U32_MAX, U64_MAX
from kv_slot_tracker.service.commands import DEFAULT_ROUTING_GROUP, MAX_CACHED_TOKENS

# Integers are JSON integer literals, as the reference's serde reads them: ``1.0`` or ``1e3``
# is refused (422) although JSON Schema's ``integer`` admits them. No JSON Schema keyword can
# say "no fraction or exponent in the literal", so the document says it in words: in its
# description (``INTEGER_LITERALS``) and with a ``format`` on every such field.
INTEGER_LITERALS = (
    "Integer fields take JSON integer literals only: a number written with a fraction or an "
    "exponent (`1.0`, `1e3`) is refused with 422 even when its value is whole, as the reference "
    "service (Rust serde) refuses it. JSON Schema's `integer` cannot express that; the fields' "
    "`format` (`uint32`, `uint64`, `int64`) names the Rust type they are read as."
)


def integer_schema(low: int, high: int, fmt: str) -> dict[str, Any]:
    """The JSON Schema of an integer field read as the Rust type ``fmt`` names."""
    return {"type": "integer", "format": fmt, "minimum": low, "maximum": high}


U64 = Annotated[
    StrictInt, Field(ge=0, le=U64_MAX), WithJsonSchema(integer_schema(0, U64_MAX, "uint64"))
]
U32 = Annotated[
    StrictInt, Field(ge=0, le=U32_MAX), WithJsonSchema(integer_schema(0, U32_MAX, "uint32"))
]
Hash = Annotated[
    StrictInt,
    Field(ge=I64_MIN, le=I64_MAX),
    WithJsonSchema(integer_schema(I64_MIN, I64_MAX, "int64")),
]
TokenId = U32
# a block size: any u32 parses; 0 is answered 400 by the service, and the schema says 1 at least
BlockSize = Annotated[
    StrictInt, Field(ge=0, le=U32_MAX), WithJsonSchema(integer_schema(1, U32_MAX, "uint32"))
]
# a worker's ranks: any u32 parses; the service answers 400 for 0 and above the limit (its own
# text)
DpSize = Annotated[
    StrictInt,
    Field(ge=0, le=U32_MAX),
    WithJsonSchema({"type": "integer", "format": "uint32", "minimum": 1, "maximum": MAX_DP_SIZE}),
]
Name = Annotated[StrictStr, Field(max_length=MAX_NAME_LENGTH)]  # model, routing group, LoRA
Id = Annotated[StrictStr, Field(max_length=MAX_ID_LENGTH)]  # request and selection ids
Text = Annotated[StrictStr, Field(max_length=MAX_TEXT_LENGTH)]  # what a worker declares


def number(low: float, high: float) -> Any:
    """A JSON number in ``low..high`` (the schema says so in standard keywords)."""
    return Annotated[
        StrictFloat | StrictInt,
        Field(ge=low, le=high),
        WithJsonSchema({"type": "number", "minimum": low, "maximum": high}),
    ]


# `sequence_hashes` or `token_ids`: exactly one of the two (the service answers 422 otherwise).
ONE_PROMPT_FORM: list[Any] = [{"required": ["sequence_hashes"]}, {"required": ["token_ids"]}]

MODEL = Field(description="Model name; with the routing group it selects one tracker.")
GROUP = Field(
    DEFAULT_ROUTING_GROUP, description="Routing group inside the model (default `default`)."
)
HASHES: Any = Field(
    None,
    description="Sequence hashes of the prompt's full KV blocks, in order, as signed 64-bit "
    "integers (values >= 2^63 are sent as their two's-complement negative).",
)
TOKENS: Any = Field(
    None,
    description="Prompt token ids (u32); the service computes Dynamo-compatible sequence hashes "
    "with the tracker's block size and `lora_name`. Give this or `sequence_hashes`, not both.",
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class _Keyed(_Body):
    model_name: Name = MODEL
    routing_group: Name = GROUP


class RegisterBody(_Keyed):
    worker_id: U64 = Field(description="Worker (engine process) id.")
    block_size: BlockSize = Field(
        description="Tokens per KV block; fixed per tracker by its first worker."
    )
    dp_start: U32 = Field(description="First data-parallel rank of the worker.")
    dp_size: DpSize = Field(
        description=f"Number of data-parallel ranks: at most {MAX_DP_SIZE:,} per worker, and a "
        f"tracker holds at most {MAX_RANKS_PER_TRACKER:,} ranks in all."
    )

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "worker_id": 1,
                    "model_name": "llama",
                    "block_size": 16,
                    "dp_start": 0,
                    "dp_size": 2,
                }
            ]
        }
    )


class UpsertBody(RegisterBody):
    pass


class UnregisterBody(_Keyed):
    worker_id: U64 = Field(description="Worker id to remove with all its ranks and requests.")

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"worker_id": 1, "model_name": "llama"}]}
    )


class HeartbeatBody(_Keyed):
    worker_id: U64 = Field(description="Registered worker whose lease is renewed.")

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"worker_id": 1, "model_name": "llama"}]}
    )


class ReconcileWorker(_Body):
    worker_id: U64 = Field(description="Worker (engine process) id; listed at most once.")
    dp_start: U32 = Field(description="First data-parallel rank of the worker.")
    dp_size: DpSize = Field(description=f"Number of data-parallel ranks (at most {MAX_DP_SIZE:,}).")


class ReconcileBody(_Keyed):
    block_size: BlockSize = Field(description="Tokens per KV block of this tracker.")
    workers: list[ReconcileWorker] = Field(
        description="The complete topology of the tracker; every other worker is removed."
    )

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model_name": "llama",
                    "block_size": 16,
                    "workers": [{"worker_id": 1, "dp_start": 0, "dp_size": 2}],
                }
            ]
        }
    )


class AddBody(_Keyed):
    request_id: Id = Field(description="Request id, unique across the tracker while active.")
    worker_id: U64 = Field(description="Worker the request was routed to.")
    dp_rank: U32 = Field(description="Data-parallel rank the request was routed to.")
    sequence_hashes: list[Hash] = HASHES
    token_ids: list[TokenId] = TOKENS
    new_isl_tokens: U64 = Field(0, description="Prompt tokens still to prefill on this rank.")
    expected_prefill_ms: number(0, MAX_PREFILL_MS) | None = Field(  # type: ignore[valid-type]
        None, description="Modeled prefill duration in ms; the prefill tokens then decay linearly."
    )
    track_prefill_tokens: StrictBool | None = Field(
        None, description="Count this request's prefill tokens (default: new_isl_tokens > 0)."
    )
    expected_output_tokens: U32 | None = Field(None, description="Stored and replicated only.")
    lora_name: Name | None = Field(None, description="LoRA adapter name, if any.")

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model_name": "llama",
                    "request_id": "r1",
                    "worker_id": 1,
                    "dp_rank": 0,
                    "sequence_hashes": [1, 2, 3],
                    "new_isl_tokens": 48,
                }
            ],
            "oneOf": ONE_PROMPT_FORM,
        }
    )


class _RequestIdBody(_Keyed):
    request_id: Id = Field(description="Request id.")


class RequestBody(_RequestIdBody):
    """The body of `/prefill_complete` and `/free`."""

    cached_tokens: (
        Annotated[
            StrictInt,
            Field(ge=0, le=MAX_CACHED_TOKENS),
            WithJsonSchema(integer_schema(0, MAX_CACHED_TOKENS, "uint64")),
        ]
        | None
    ) = Field(
        None,
        description="Prompt tokens the engine found cached, as its OpenAI-compatible answer "
        "reports them (`usage.prompt_tokens_details.cached_tokens` in vLLM and SGLang): the "
        "observed outcome of the routing receipt of the selection whose id is `request_id` "
        "in this model and routing group, when this instance made it (the first report "
        "counts). Without it the call is the reference's.",
    )

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"model_name": "llama", "request_id": "r1"}]}
    )


class OutputBlockBody(_RequestIdBody):
    decay_fraction: number(0, 1) | None = Field(  # type: ignore[valid-type]
        None, description="Weight (0..1) given to the blocks held only by this request."
    )

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"model_name": "llama", "request_id": "r1", "decay_fraction": 0.5}]
        }
    )


class PotentialLoadsBody(_Keyed):
    sequence_hashes: list[Hash] = HASHES
    token_ids: list[TokenId] = TOKENS
    lora_name: Name | None = Field(None, description="LoRA name used to hash `token_ids`.")
    new_isl_tokens: U64 = Field(0, description="Prefill tokens the prompt would add on any rank.")

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"model_name": "llama", "sequence_hashes": [1, 2, 4], "new_isl_tokens": 48}
            ],
            "oneOf": ONE_PROMPT_FORM,
        }
    )


class ProjectLoadsBody(_Keyed):
    sequence_hashes: list[Hash] = HASHES
    token_ids: list[TokenId] = TOKENS
    lora_name: Name | None = Field(None, description="LoRA name used to hash `token_ids`.")

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"model_name": "llama", "sequence_hashes": [1, 2, 4]}],
            "oneOf": ONE_PROMPT_FORM,
        }
    )


class BatchAdd(AddBody):
    op: Literal["add"]


class BatchPrefillComplete(RequestBody):
    op: Literal["prefill_complete"]


class BatchFree(RequestBody):
    op: Literal["free"]


class BatchOutputBlock(OutputBlockBody):
    op: Literal["output_block"]


BatchOperation = Annotated[
    BatchAdd | BatchPrefillComplete | BatchFree | BatchOutputBlock, Field(discriminator="op")
]


class StrictBatchBody(_Body):
    """A batch whose operations are all well formed: validated in one pass (the common case)."""

    operations: list[BatchOperation]


class BatchBody(_Body):
    operations: list[dict[str, Any]] = Field(
        description="Lifecycle operations applied in order, each independently: objects with "
        "`op` (`add`, `prefill_complete`, `free`, `output_block`) and that route's fields."
    )

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "operations": [
                        {
                            "op": "add",
                            "model_name": "llama",
                            "request_id": "r1",
                            "worker_id": 1,
                            "dp_rank": 0,
                            "sequence_hashes": [1, 2],
                            "new_isl_tokens": 32,
                        },
                        {"op": "free", "model_name": "llama", "request_id": "r0"},
                    ]
                }
            ]
        }
    )
