"""The query routes' handlers, and the query string they read.

``Queries`` holds the slot tracker's GET handlers: query parameters in, ``Response`` out (the
selection API's are ``kv_slot_tracker.http.selection.operations.SelectionQueries``). The handlers
of both APIs read the query string and page their listings with the helpers here: a listing
answers at most ``list_max_items`` items (or ``limit``), and the ``x-next-cursor`` response
header gives the ``cursor`` of the next page. ``kv_slot_tracker.http.endpoints`` serves the
handlers through FastAPI.
"""

from __future__ import annotations

from typing import Any

from fastapi import Response
from starlette.datastructures import QueryParams

from kv_slot_tracker.http.errors import query_error
from kv_slot_tracker.http.responses import json_response
from kv_slot_tracker.replication.port import Replication
from kv_slot_tracker.service import DEFAULT_ROUTING_GROUP, SlotTrackerService

# A query parameter the edge adds for a caller without the key on an open probe that answers
# such a caller only some fields (``auth.PROBE_FIELDS``): the handler computes only those.
PROBE = "kv_slot_tracker_probe"
# The response header giving the ``cursor`` of a listing's next page.
NEXT_CURSOR = "x-next-cursor"


def query_value(params: QueryParams, name: str) -> str | None:
    values = params.getlist(name)
    if len(values) > 1:
        raise query_error(f"duplicate field `{name}`")
    return values[0] if values else None


def page_of(params: QueryParams, max_items: int) -> tuple[int, int]:
    """The ``(start, limit)`` of the page ``params`` ask for (400 for a bad value)."""
    limit_text, cursor = query_value(params, "limit"), query_value(params, "cursor")
    limit = max_items
    if limit_text is not None:
        if not (limit_text.isascii() and limit_text.isdigit()) or int(limit_text) < 1:
            raise query_error("limit: expected a positive integer")
        limit = min(int(limit_text), max_items)
    start = 0
    if cursor is not None:
        if not (cursor.isascii() and cursor.isdigit() and len(cursor) <= 18):
            raise query_error("cursor: expected the x-next-cursor header of the previous page")
        start = int(cursor)
    return start, limit


def paged(items: list[Any], params: QueryParams, max_items: int) -> tuple[list[Any], str | None]:
    """One page of ``items`` and the cursor of the next one (None: this is the last)."""
    start, limit = page_of(params, max_items)
    end = start + limit
    return items[start:end], (str(end) if end < len(items) else None)


def paged_response(payload: Any, cursor: str | None) -> Response:
    response = json_response(payload)
    if cursor is not None:
        response.headers[NEXT_CURSOR] = cursor
    return response


class Queries:
    """The GET routes' handlers: query parameters in, ``Response`` out."""

    def __init__(
        self,
        service: SlotTrackerService,
        replication: Replication,
        durable_acks: bool = False,
        list_max_items: int = 1000,
    ) -> None:
        self.service = service
        self.replication = replication
        # ``replication_ack = "redis"``: while changes are refused, the instance is not ready
        self.durable_acks = durable_acks
        self.list_max_items = list_max_items

    def health(self, params: QueryParams) -> Response:
        return Response(status_code=200)

    def ready(self, params: QueryParams) -> Response:
        if self.replication.ready():
            refused = self.replication.write_refusal() if self.durable_acks else None
            if refused is None:
                return json_response({"status": "ready", "reason": None})
            return json_response(
                {"status": "not_ready", "reason": f"writes refused: {refused}"}, 503
            )
        reason = self.replication.status().not_ready_reason or "replication is catching up"
        return json_response({"status": "not_ready", "reason": reason}, 503)

    def replication_status(self, params: QueryParams) -> Response:
        return json_response(self.replication.status().as_dict())

    def workers(self, params: QueryParams) -> Response:
        m, g = query_value(params, "model_name"), query_value(params, "routing_group")
        rows, cursor = paged(self.service.workers(m, g), params, self.list_max_items)
        return paged_response(rows, cursor)

    def loads(self, params: QueryParams) -> Response:
        m, g = query_value(params, "model_name"), query_value(params, "routing_group")
        return json_response(self.service.loads(m, g))

    def lora_counts(self, params: QueryParams) -> Response:
        m, g = query_value(params, "model_name"), query_value(params, "routing_group")
        key = (m or "", g if g is not None else DEFAULT_ROUTING_GROUP)
        names, cursor = paged(
            list(self.service.lora_counts(key).items()), params, self.list_max_items
        )
        payload = {"model_name": key[0], "routing_group": key[1], "lora_counts": dict(names)}
        return paged_response(payload, cursor)
