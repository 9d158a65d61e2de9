"""The add command: one definition of an add's fields, from the HTTP body to the tracker.

An add is the one lifecycle command whose fields the tracker reads beyond a request id, so
it is defined here, in the core, and nowhere else: the HTTP edge decodes a plain ``/add`` body
(or a ``/batch`` operation) straight into it, the service resolves its prompt and hands it to
``ActiveSequencesMultiWorker.add_on_rank`` as it is, and the selection service builds one for a
booking. No copy is made per call, and no call passes an add's fields by position, where two
swapped integers would go unnoticed. ``kv_slot_tracker.service.commands`` builds on these
structs (the other commands, and ``Add`` tagged for ``/batch``'s union), so the core never
imports the service; the pydantic models in ``kv_slot_tracker.http.schemas`` only describe the
same fields for the OpenAPI document and the reference's error texts, and
``tests/api/test_commands.py`` checks them equal field for field.

They are msgspec structs because that is what the edge decodes into, in C, with the API's
types and ranges checked on the way (no bool for an int, no float for an int, no null for a
field with a default); the core only reads them as records. The key (``model_name``,
``routing_group``) addresses the tracker and is read by the service, never by the tracker.

A prompt is given either as ``sequence_hashes`` or as ``token_ids``, never both: while decoding
the form not given is ``UNSET`` (a JSON null is invalid for either); the edge checks the form
(with the reference's messages) and sets the other one to None, and leaves the hashes as given
(signed 64-bit, the service's form: ``kv_slot_tracker.core.hashing``). The ranges beyond int64
(u64 ids and token counts) are checked by the edge after decoding.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, UnsetType

from .bounds import I64, U32
from .bounds import U64 as U64  # the service's commands declare theirs with it too
from .limits import MAX_ID_LENGTH, MAX_NAME_LENGTH, MAX_PREFILL_MS

DEFAULT_ROUTING_GROUP = "default"

Key = tuple[str, str]  # (model_name, routing_group): one tracker

# The API's types, as the structs' fields declare them.
Name = Annotated[str, Meta(max_length=MAX_NAME_LENGTH)]  # model, routing group, LoRA
Id = Annotated[str, Meta(max_length=MAX_ID_LENGTH)]  # request ids
Hash = I64
# U32, U64 (``bounds``): a u64 is checked <= U64_MAX by the edge after decoding (JSON)
Ms = (
    Annotated[int, Meta(ge=0, le=int(MAX_PREFILL_MS))]
    | Annotated[float, Meta(ge=0, le=MAX_PREFILL_MS)]
)


class Keyed(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A command addressed to the tracker of ``(model_name, routing_group)``."""

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


class Add(Prompt, kw_only=True):
    """Add request ``request_id`` on rank ``dp_rank`` of worker ``worker_id``.

    ``new_isl_tokens``: prompt tokens still to prefill there; they are tracked as prefill load
    when ``track_prefill_tokens`` says so, or, when it is None, when there are any.
    ``expected_prefill_ms``: how long that prefill is modeled to take (read only when
    ``new_isl_tokens`` > 0). ``expected_output_tokens``: kept with the request (the seeds'
    field)."""

    request_id: Id
    worker_id: U64
    dp_rank: U32
    new_isl_tokens: U64 = 0
    expected_prefill_ms: Ms | None = None
    track_prefill_tokens: bool | None = None  # None: track when new_isl_tokens > 0
    expected_output_tokens: U32 | None = None
