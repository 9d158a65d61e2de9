"""The one place that writes raw ASGI responses, the JSON ``Response`` of FastAPI routes, and
the JSON form of rank load rows (the slot and the selection APIs answer the same rows)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson
from fastapi import Response
from starlette.types import Send

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


def load_rows_json(
    rows: Iterable[tuple[int, int, int, int, int]],
) -> list[dict[str, int]]:
    """``(worker_id, dp_rank, potential_prefill_tokens, potential_decode_blocks,
    active_requests)`` rows as the JSON objects both APIs answer."""
    return [
        {
            "worker_id": wid,
            "dp_rank": rank,
            "potential_prefill_tokens": tokens,
            "potential_decode_blocks": blocks,
            "active_requests": requests,
        }
        for wid, rank, tokens, blocks, requests in rows
    ]
