"""The optional outcome body of a reservation's ``prefill_complete`` and ``DELETE``: the cached
tokens the engine reported, for the selection's routing receipt
(``kv_slot_tracker.core.selection.receipts``). Without a body both calls behave as the
reference's."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from kv_slot_tracker.http.body import parse_json
from kv_slot_tracker.service.commands import MAX_CACHED_TOKENS


class ReservationOutcomeBody(BaseModel):
    """The optional body of ``prefill_complete`` and ``DELETE`` of a reservation."""

    model_config = ConfigDict(
        extra="ignore",
        frozen=True,
        json_schema_extra={"examples": [{"cached_tokens": 96}]},
    )

    cached_tokens: Annotated[int, Field(ge=0, le=MAX_CACHED_TOKENS)] | None = Field(
        None,
        description="Prompt tokens the engine found cached, as its OpenAI-compatible answer "
        "reports them (`usage.prompt_tokens_details.cached_tokens` in vLLM and SGLang): the "
        "observed outcome of the selection's routing receipt. The first report counts.",
    )


def reported_cached_tokens(raw: bytes) -> int | None:
    """``cached_tokens`` of an optional outcome body (None: no body, or not reported)."""
    if not raw.strip():
        return None
    return parse_json(raw, ReservationOutcomeBody).cached_tokens
