"""One command per operation: what the HTTP edge decodes a body into and the service executes.

The lifecycle and query commands are msgspec structs whose fields carry the API's types and
ranges, so the edge's fast path decodes a plain body straight into the command (in C, strict:
no bool for an int, no float for an int, no null for a field with a default) and hands it to
the service as it is. The pydantic models in ``kv_slot_tracker.http.schemas`` exist only for the OpenAPI
document and the reference's error texts; ``tests/api/test_commands.py`` checks them equal to
these structs field for field (names, types, bounds, defaults). The lifecycle commands are
tagged by ``op``: a ``/batch`` body is a list of their union (``BatchOperation``).

A prompt is given either as ``sequence_hashes`` or as ``token_ids``, never both: while decoding
the form not given is ``UNSET`` (a JSON null is invalid for either); the edge checks the form
(with the reference's messages) and hands the service the other one as None, and the hashes
as given (signed 64-bit, the service's form: ``kv_slot_tracker.core.hashing``). The ranges
beyond int64 (u64 ids and token counts) are checked by the edge after decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, UnsetType

from kv_slot_tracker.core.limits import MAX_ID_LENGTH, MAX_NAME_LENGTH, MAX_PREFILL_MS
from kv_slot_tracker.core.types import I64_MAX, I64_MIN, U32_MAX

DEFAULT_ROUTING_GROUP = "default"

Key = tuple[str, str]

# The API's types, as the structs' fields declare them.
Name = Annotated[str, Meta(max_length=MAX_NAME_LENGTH)]  # model, routing group, LoRA
Id = Annotated[str, Meta(max_length=MAX_ID_LENGTH)]  # request ids
Hash = Annotated[int, Meta(ge=I64_MIN, le=I64_MAX)]
U32 = Annotated[int, Meta(ge=0, le=U32_MAX)]
U64 = Annotated[int, Meta(ge=0)]  # and <= U64_MAX, checked by the edge after decoding
Ms = (
    Annotated[int, Meta(ge=0, le=int(MAX_PREFILL_MS))]
    | Annotated[float, Meta(ge=0, le=MAX_PREFILL_MS)]
)
Fraction = Annotated[int, Meta(ge=0, le=1)] | Annotated[float, Meta(ge=0, le=1)]


@dataclass(slots=True, kw_only=True)
class Command:
    """A topology command's key (the topology commands are plain dataclasses)."""

    model_name: str
    routing_group: str = DEFAULT_ROUTING_GROUP

    @property
    def key(self) -> Key:
        return (self.model_name, self.routing_group)


# -- topology ---------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Register(Command):
    """Register a worker's ranks ``dp_start .. dp_start + dp_size - 1``."""

    worker_id: int
    block_size: int
    dp_start: int = 0
    dp_size: int = 1


@dataclass(slots=True, kw_only=True)
class Upsert(Register):
    """Register a worker or replace its ranks."""


@dataclass(slots=True, kw_only=True)
class Unregister(Command):
    worker_id: int


@dataclass(slots=True, kw_only=True)
class Heartbeat(Command):
    """Renew a worker's lease (``worker_ttl_seconds``)."""

    worker_id: int


@dataclass(slots=True, kw_only=True)
class Reconcile(Command):
    """Make ``workers`` (``(worker_id, dp_start, dp_size)``) the whole topology of a tracker."""

    block_size: int
    workers: list[tuple[int, int, int]]


# -- lifecycle and queries --------------------------------------------------------------------


class Keyed(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model_name: Name
    routing_group: Name = DEFAULT_ROUTING_GROUP

    @property
    def key(self) -> Key:
        return (self.model_name, self.routing_group)


class Prompt(Keyed, kw_only=True):
    """A prompt as block hashes or as token ids (hashed with the tracker's block size)."""

    sequence_hashes: list[Hash] | UnsetType = UNSET
    token_ids: list[U32] | UnsetType = UNSET
    lora_name: Name | None = None


class Add(Prompt, tag_field="op", tag="add", kw_only=True):
    request_id: Id
    worker_id: U64
    dp_rank: U32
    new_isl_tokens: U64 = 0
    expected_prefill_ms: Ms | None = None
    track_prefill_tokens: bool | None = None  # None: track when new_isl_tokens > 0
    expected_output_tokens: U32 | None = None


class PrefillComplete(Keyed, tag_field="op", tag="prefill_complete", kw_only=True):
    request_id: Id


class Free(Keyed, tag_field="op", tag="free", kw_only=True):
    request_id: Id


class OutputBlock(Keyed, tag_field="op", tag="output_block", kw_only=True):
    request_id: Id
    decay_fraction: Fraction | None = None


class PotentialLoads(Prompt, kw_only=True):
    new_isl_tokens: U64 = 0


class ProjectLoads(Prompt, kw_only=True):
    pass


Lifecycle = Add | PrefillComplete | Free | OutputBlock
BatchOperation = Lifecycle  # a ``/batch`` operation: the command its ``op`` names
