"""The raw ASGI JSON response the routes and the middleware send (``send_json``), the JSON
``Response`` of FastAPI routes, and the JSON form of rank load rows (the slot and the selection
APIs answer the same rows). Two other places write ASGI messages themselves: the 503 beyond the
connection limit (``connection.py``, uvicorn's own path, closing the connection) and the probe
filter of ``auth.py``, which rewrites an answer already started."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson
from fastapi import Response
from starlette.types import Send

from kv_slot_tracker.core.loads import Columns
from kv_slot_tracker.core.types import WorkerWithDpRank

JSON = "application/json"
_JSON_HEADER = (b"content-type", b"application/json")


async def send_json(
    send: Send,
    status: int,
    body: bytes,
    *,
    head: bool = False,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """Send a complete JSON response (``head``: headers only, as for a HEAD request)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [_JSON_HEADER, (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": b"" if head else body})


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type=JSON)


def raw_response(body: bytes, status: int = 200) -> Response:
    return Response(body, status_code=status, media_type=JSON)


# one rank's potential load; ``%d`` writes any int (a selection's sum may pass 2^64 - 1)
_ROW_HEAD = b'{"worker_id":%d,"dp_rank":%d,'
_ROW_TAIL = b'"potential_prefill_tokens":%d,"potential_decode_blocks":%d,"active_requests":%d}'
_LOAD_ROW = _ROW_HEAD + _ROW_TAIL
_TEMPLATES: dict[int, tuple[list[WorkerWithDpRank], bytes]] = {}  # id(ranks) -> (ranks, template)
_TEMPLATES_KEPT = 64


def load_rows_json(rows: Iterable[tuple[int, int, int, int, int]]) -> bytes:
    """``(worker_id, dp_rank, potential_prefill_tokens, potential_decode_blocks,
    active_requests)`` rows as the JSON array both APIs answer."""
    return b"[" + b",".join([_LOAD_ROW % row for row in rows]) + b"]"


def load_columns_json(columns: Columns) -> bytes:
    """``load_rows_json`` of parallel columns. ``ranks`` is a tracker's sorted rank list, which
    it replaces (never changes) when its topology changes: its rows' fixed parts are formatted
    once into a template, and each call fills in the three numbers per rank in one step."""
    ranks = columns.ranks
    cached = _TEMPLATES.get(id(ranks))
    if cached is None or cached[0] is not ranks:
        if len(_TEMPLATES) >= _TEMPLATES_KEPT:
            del _TEMPLATES[next(iter(_TEMPLATES))]
        template = b"[" + b",".join([_ROW_HEAD % w + _ROW_TAIL for w in ranks]) + b"]"
        cached = _TEMPLATES[id(ranks)] = (ranks, template)
    values: list[int] = [0] * (3 * len(ranks))
    values[0::3] = columns.prefill
    values[1::3] = columns.decode
    values[2::3] = columns.requests
    return cached[1] % tuple(values)
