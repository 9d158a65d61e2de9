"""Routing receipts over HTTP: ``GET /selection/receipts[/{id}]``, ``POST /selection/explain``
and the optional outcome body of a reservation's ``prefill_complete`` and ``DELETE``.

The receipts live on the instance that decided (``kv_slot_tracker.core.selection.receipts``);
every answer names that instance, and a receipt asked of another instance is a 404. The listing
is a JSON object (``{"instance", "receipts": [...]}``), or NDJSON for offline analysis
(``Accept: application/x-ndjson`` or ``?format=ndjson``: one receipt per line). The routes are
served by FastAPI (they are not hot) from a router of their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import Scope

from kv_slot_tracker.core.selection.receipt_ring import ReceiptFilter
from kv_slot_tracker.core.selection.receipts import Receipt
from kv_slot_tracker.http.body import parse_json, read_asgi_body
from kv_slot_tracker.http.errors import EXPECTED, QUERY_SHAPE, error_result
from kv_slot_tracker.http.responses import json_response, raw_response
from kv_slot_tracker.http.routes import error_responses
from kv_slot_tracker.http.selection import schemas as selection_schemas
from kv_slot_tracker.http.selection.operations import select_command
from kv_slot_tracker.service.selection.service import SelectionService

NDJSON = "application/x-ndjson"
MAX_LIMIT = 1000
DEFAULT_LIMIT = 100


# -- response models (documentation; the answers are built by ``Receipt.as_dict``) -------------


class _Rank(BaseModel):
    worker_id: int
    dp_rank: int


class ReceiptCandidate(BaseModel):
    worker_id: int
    dp_rank: int
    device_blocks: int = Field(description="Leading prompt blocks cached on the rank's device.")
    host_pinned_extension_blocks: int = Field(description="Further blocks in host memory.")
    disk_extension_blocks: int = Field(description="Further blocks on disk.")
    overlap_credit_blocks: float | None = Field(
        None,
        description="Prefill blocks the cache saves in the cost (credit x decay x device "
        "blocks, plus the weighted host/disk blocks); null when the rank was not scored.",
    )
    credit_decay: float | None = Field(
        None, description="The decay factor of the credit (1: none)."
    )
    active_prefill_tokens: int = Field(description="P: prefill tokens pending on the rank.")
    potential_decode_blocks: int = Field(
        description="D + new: active blocks plus the prompt's blocks not active there."
    )
    active_requests: int = Field(description="A: requests booked on the rank.")
    cost: float | None = Field(
        None,
        description="The rank's cost (lower wins); null when it was not scored (a pin, the "
        "allowed list or a session left it out).",
    )


class ReceiptPrediction(BaseModel):
    hit_rate: float
    cached_tokens: int
    effective_prefill_tokens: int


class ReceiptOutcome(BaseModel):
    state: str = Field(description="`selected`, `booked` or `freed`.")
    booked_at: float | None = None
    prefill_done_at: float | None = None
    prefill_seconds: float | None = None
    freed_at: float | None = None
    cached_tokens: int | None = Field(None, description="Reported by the client, if it did.")
    observed_hit_rate: float | None = None
    prediction_error_tokens: int | None = Field(
        None, description="Predicted minus reported cached tokens."
    )
    kv_predicted_blocks: int | None = Field(
        None,
        description="KV events: the predicted cached blocks, checked when the chosen rank "
        "stored the rest of the prompt.",
    )
    kv_still_held_blocks: int | None = Field(
        None, description="Of those, the ones still held then."
    )


# Real answers (the response-examples test checks them, times and instance masked).
_RECEIPT_EXAMPLE: dict[str, Any] = {
    "receipt_id": "req-1",
    "selection_id": "req-1",
    "instance": "router-0/1234",
    "action": "select",
    "time": 1796400000.25,
    "model_name": "qwen",
    "routing_group": "default",
    "block_size": 16,
    "isl_tokens": 33,
    "prompt_blocks": 2,
    "chosen": {"worker_id": 7, "dp_rank": 1},
    "chosen_overlap_blocks": 0,
    "max_overlap_blocks": 0,
    "max_overlap_ranks": [
        {"worker_id": 7, "dp_rank": 0},
        {"worker_id": 7, "dp_rank": 1},
        {"worker_id": 8, "dp_rank": 0},
    ],
    "optimal": True,
    "non_optimal_reason": None,
    "overlap_blocks_lost": 0,
    "decided_by": "tie",
    "tie_set": [
        {"worker_id": 7, "dp_rank": 0},
        {"worker_id": 7, "dp_rank": 1},
        {"worker_id": 8, "dp_rank": 0},
    ],
    "temperature": 0.0,
    "pinned": False,
    "allowed_worker_ids": None,
    "session_id": None,
    "session_worker_id": None,
    "candidates": [
        {
            "worker_id": 7,
            "dp_rank": 0,
            "device_blocks": 0,
            "host_pinned_extension_blocks": 0,
            "disk_extension_blocks": 0,
            "overlap_credit_blocks": 0.0,
            "credit_decay": 1.0,
            "active_prefill_tokens": 0,
            "potential_decode_blocks": 2,
            "active_requests": 0,
            "cost": 4.0625,
        },
        {
            "worker_id": 7,
            "dp_rank": 1,
            "device_blocks": 0,
            "host_pinned_extension_blocks": 0,
            "disk_extension_blocks": 0,
            "overlap_credit_blocks": 0.0,
            "credit_decay": 1.0,
            "active_prefill_tokens": 0,
            "potential_decode_blocks": 2,
            "active_requests": 0,
            "cost": 4.0625,
        },
        {
            "worker_id": 8,
            "dp_rank": 0,
            "device_blocks": 0,
            "host_pinned_extension_blocks": 0,
            "disk_extension_blocks": 0,
            "overlap_credit_blocks": 0.0,
            "credit_decay": 1.0,
            "active_prefill_tokens": 0,
            "potential_decode_blocks": 2,
            "active_requests": 0,
            "cost": 4.0625,
        },
    ],
    "predicted": {"hit_rate": 0.0, "cached_tokens": 0, "effective_prefill_tokens": 33},
    "outcome": {
        "state": "freed",
        "booked_at": 1796400000.5,
        "prefill_done_at": 1796400001.75,
        "prefill_seconds": 1.25,
        "freed_at": 1796400001.75,
        "cached_tokens": None,
        "observed_hit_rate": None,
        "prediction_error_tokens": None,
        "kv_predicted_blocks": None,
        "kv_still_held_blocks": None,
    },
}
_LIST_EXAMPLE: dict[str, Any] = {
    "instance": "router-0/1234",
    "partitions": [
        {
            "model_name": "qwen",
            "routing_group": "default",
            "decisions": 2,
            "kv_optimal": 1,
            "non_optimal": {
                "load": 1,
                "tie": 0,
                "temperature": 0,
                "pin": 0,
                "session": 0,
                "allowed": 0,
            },
            "overlap_blocks_lost": 2,
            "funnel_blocks": {"prompt": 4, "indexed_any": 2, "chosen": 0, "reported_cached": 0},
            "predicted_hit_rate": 0.0,
            "reported": 0,
            "reported_predicted_hit_rate": None,
            "observed_hit_rate": None,
            "mean_prediction_error_tokens": None,
            "kv_checked": 0,
            "kv_predicted_blocks": 0,
            "kv_still_held_blocks": 0,
        }
    ],
    "receipts": [
        {
            "receipt_id": "req-2",
            "selection_id": "req-2",
            "instance": "router-0/1234",
            "action": "select_and_reserve",
            "time": 1796400000.25,
            "model_name": "qwen",
            "routing_group": "default",
            "block_size": 16,
            "isl_tokens": 33,
            "prompt_blocks": 2,
            "chosen": {"worker_id": 8, "dp_rank": 0},
            "chosen_overlap_blocks": 0,
            "max_overlap_blocks": 2,
            "max_overlap_ranks": [{"worker_id": 7, "dp_rank": 1}],
            "optimal": False,
            "non_optimal_reason": "load",
            "overlap_blocks_lost": 2,
            "decided_by": "tie",
            "tie_set": [{"worker_id": 7, "dp_rank": 0}, {"worker_id": 8, "dp_rank": 0}],
            "temperature": 0.0,
            "pinned": False,
            "allowed_worker_ids": None,
            "session_id": None,
            "session_worker_id": None,
            "candidates": [
                {
                    "worker_id": 7,
                    "dp_rank": 0,
                    "device_blocks": 0,
                    "host_pinned_extension_blocks": 0,
                    "disk_extension_blocks": 0,
                    "overlap_credit_blocks": 0.0,
                    "credit_decay": 1.0,
                    "active_prefill_tokens": 0,
                    "potential_decode_blocks": 2,
                    "active_requests": 0,
                    "cost": 4.0625,
                },
                {
                    "worker_id": 7,
                    "dp_rank": 1,
                    "device_blocks": 2,
                    "host_pinned_extension_blocks": 0,
                    "disk_extension_blocks": 0,
                    "overlap_credit_blocks": 2.0,
                    "credit_decay": 1.0,
                    "active_prefill_tokens": 33,
                    "potential_decode_blocks": 2,
                    "active_requests": 1,
                    "cost": 4.125,
                },
                {
                    "worker_id": 8,
                    "dp_rank": 0,
                    "device_blocks": 0,
                    "host_pinned_extension_blocks": 0,
                    "disk_extension_blocks": 0,
                    "overlap_credit_blocks": 0.0,
                    "credit_decay": 1.0,
                    "active_prefill_tokens": 0,
                    "potential_decode_blocks": 2,
                    "active_requests": 0,
                    "cost": 4.0625,
                },
            ],
            "predicted": {"hit_rate": 0.0, "cached_tokens": 0, "effective_prefill_tokens": 33},
            "outcome": {
                "state": "booked",
                "booked_at": 1796400000.5,
                "prefill_done_at": None,
                "prefill_seconds": None,
                "freed_at": None,
                "cached_tokens": None,
                "observed_hit_rate": None,
                "prediction_error_tokens": None,
                "kv_predicted_blocks": None,
                "kv_still_held_blocks": None,
            },
        }
    ],
}


class RoutingReceipt(BaseModel):
    """One selection: the candidates and their cost terms, the choice and its outcome."""

    model_config = ConfigDict(json_schema_extra={"examples": [_RECEIPT_EXAMPLE]})

    receipt_id: str
    selection_id: str | None = None
    instance: str = Field(description="The instance that decided (receipts stay there).")
    action: str = Field(description="`select`, `select_and_reserve` or `explain`.")
    time: float = Field(description="When it was decided (Unix seconds).")
    model_name: str
    routing_group: str
    block_size: int
    isl_tokens: int
    prompt_blocks: int
    chosen: _Rank
    chosen_overlap_blocks: int
    max_overlap_blocks: int
    max_overlap_ranks: list[_Rank]
    optimal: bool = Field(description="The chosen rank has the most cached prefix.")
    non_optimal_reason: str | None = Field(
        None, description="`load`, `tie`, `temperature`, `pin`, `session` or `allowed`."
    )
    overlap_blocks_lost: int
    decided_by: str = Field(
        description="`cost`, `tie`, `temperature`, `pin`, `session` or `only_candidate`."
    )
    tie_set: list[_Rank]
    temperature: float
    pinned: bool
    allowed_worker_ids: list[int] | None = None
    session_id: str | None = None
    session_worker_id: int | None = None
    candidates: list[ReceiptCandidate]
    predicted: ReceiptPrediction
    outcome: ReceiptOutcome


class DecisionSummary(BaseModel):
    """One partition's decision quality on this instance, since it started."""

    model_name: str
    routing_group: str
    decisions: int
    kv_optimal: int = Field(description="Decisions that took a rank with the most overlap.")
    non_optimal: dict[str, int] = Field(description="The other decisions, by reason.")
    overlap_blocks_lost: int
    funnel_blocks: dict[str, int] = Field(
        description="prompt, indexed_any (most cached on any rank), chosen, reported_cached."
    )
    predicted_hit_rate: float | None = Field(None, description="Mean over the decisions.")
    reported: int = Field(description="Decisions whose cached tokens a client reported.")
    reported_predicted_hit_rate: float | None = Field(
        None, description="Predicted hit rate of the reported decisions (blocks)."
    )
    observed_hit_rate: float | None = Field(None, description="Mean reported hit rate.")
    mean_prediction_error_tokens: float | None = None
    kv_checked: int
    kv_predicted_blocks: int
    kv_still_held_blocks: int


class ReceiptList(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [_LIST_EXAMPLE]})

    instance: str
    partitions: list[DecisionSummary] = Field(
        description="Every partition's decision quality on this instance."
    )
    receipts: list[RoutingReceipt]


# -- the routes ------------------------------------------------------------------------------


def build_receipts_router(service: SelectionService, max_body: int) -> APIRouter:
    router = APIRouter(tags=["selection"])
    off = {"error": "routing receipts are off on this instance (selection_receipts = false)"}

    @router.get(
        "/selection/receipts",
        summary="This instance's routing receipts, newest first",
        operation_id="selection_receipts",
        response_model=ReceiptList,
        responses={
            200: {"content": {NDJSON: {"schema": {"type": "string"}}}},
            **error_responses((400, 401, 404)),
        },
        description="The receipts of the selections this instance made (they are not "
        "replicated: ask each instance), newest first, at most `limit` (default 100, at most "
        "1000; 0 for only the per-partition summaries). Filters: partition, chosen worker, time range (Unix seconds, `since` inclusive, "
        "`until` exclusive) and `non_optimal=true` (only decisions that did not take a rank "
        "with the most cached prefix). NDJSON (one receipt per line) with `format=ndjson` or "
        "`Accept: application/x-ndjson`. 404 when receipts are off.",
    )
    async def receipts(
        request: Request,
        model_name: Annotated[str | None, Query(description="Only this model.")] = None,
        routing_group: Annotated[str | None, Query(description="Only this group.")] = None,
        worker_id: Annotated[int | None, Query(description="Only this chosen worker.")] = None,
        since: Annotated[float | None, Query(description="Decided at or after (Unix s).")] = None,
        until: Annotated[float | None, Query(description="Decided before (Unix s).")] = None,
        non_optimal: Annotated[
            bool | None, Query(description="Only decisions that gave up cached blocks.")
        ] = None,
        limit: Annotated[int | None, Query(description="At most this many (1-1000).")] = None,
        format: Annotated[
            Literal["json", "ndjson"] | None, Query(description="`ndjson` for NDJSON.")
        ] = None,
    ) -> Response:
        ring = service.receipts
        if ring is None:
            return json_response(off, 404)
        n = DEFAULT_LIMIT if limit is None else limit
        if not 0 <= n <= MAX_LIMIT:
            return json_response(
                {"error": QUERY_SHAPE + f"limit: must be between 0 and {MAX_LIMIT}"}, 400
            )
        ndjson = format == "ndjson" or (
            format is None and NDJSON in request.headers.get("accept", "")
        )
        where = ReceiptFilter(
            model_name=model_name,
            routing_group=routing_group,
            worker_id=worker_id,
            since=since,
            until=until,
            non_optimal=bool(non_optimal),
        )
        found = ring.newest(where, n)
        instance = service.instance
        if ndjson:
            return StreamingResponse(_lines(found, instance), media_type=NDJSON)
        return json_response(
            {
                "instance": instance,
                "partitions": ring.summaries(),
                "receipts": [r.as_dict(instance) for r in found],
            }
        )

    @router.get(
        "/selection/receipts/{selection_id}",
        summary="The routing receipt of one selection",
        operation_id="selection_receipt",
        response_model=RoutingReceipt,
        responses=error_responses((401, 404)),
        description="The receipt of the selection `selection_id` (a receipt of a selection "
        "made without an id is named `auto:N` in the listing), if this instance made it and "
        "still keeps it; 404 otherwise.",
    )
    async def receipt(
        selection_id: Annotated[str, Path(description="Selection (receipt) id.")],
    ) -> Response:
        ring = service.receipts
        if ring is None:
            return json_response(off, 404)
        r = ring.get(selection_id)
        if r is None:
            return json_response(
                {"error": f"no receipt {selection_id} on instance {service.instance}"}, 404
            )
        return json_response(r.as_dict(service.instance))

    @router.post(
        "/selection/explain",
        summary="The receipt a selection would get, changing nothing",
        operation_id="selection_explain",
        response_model=RoutingReceipt,
        responses=error_responses((400, 401, 413, 415, 422, 503)),
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/SelectBody"}}
                },
            }
        },
        description="Takes a `/selection/select` body and answers the receipt of the decision: "
        "every candidate's cost terms, the rank chosen, the rank with the most cached prefix "
        "and what decided. Books nothing, caches no pending selection, binds no session and "
        "keeps no receipt; ties and temperature draw from a generator of their own. Works with "
        "receipts off too.",
    )
    async def explain(request: Request) -> Response:
        try:
            raw = await read_asgi_body(request.scope, request.receive, max_body)
            body = parse_json(raw, selection_schemas.SelectBody, selection_schemas.SERDE)
            r = service.explain(select_command(body, reserve=False))
        except EXPECTED as e:
            status, payload = error_result(e)
            return raw_response(payload, status)
        return json_response(r.as_dict(service.instance))

    return router


def _lines(found: list[Receipt], instance: str) -> Iterator[bytes]:
    for r in found:
        yield orjson.dumps(r.as_dict(instance)) + b"\n"


def is_receipt_path(scope: Scope) -> bool:
    """Whether the raw path is one receipt's (``/selection/receipts/{selection_id}``, the id
    non-empty): a percent-encoded id sits in the path parameter (``HeadAsGet``)."""
    raw = (scope.get("raw_path") or scope["path"].encode()).split(b"?", 1)[0]
    head, _, tail = raw.rpartition(b"/")
    return head == b"/selection/receipts" and bool(tail)
