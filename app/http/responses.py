"""The one place that writes raw ASGI responses, and the JSON ``Response`` of FastAPI routes."""

from __future__ import annotations

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
