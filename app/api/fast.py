"""The lean path: hot POST routes served straight from ASGI, before FastAPI's routing.

Routers call ``/add``, ``/free``, ``/prefill_complete`` and ``/potential_loads`` for every LLM
request. For those (and the other body-only POST routes) this middleware reads the body, runs the
same ``Operations`` the FastAPI routes run, and sends the pre-encoded answer itself, skipping
route matching, dependency resolution and response classes, which cost several times the tracker
work. The routes stay declared in FastAPI, so they are in the OpenAPI document; authentication
runs outside this middleware, and every request is counted in the same HTTP metrics.
"""

from __future__ import annotations

from time import perf_counter

from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.body import CONTENT_TYPE, TOO_LARGE, is_json_content_type
from app.api.operations import Operations, error_body
from app.observability import HttpMetrics

FAST_ROUTES = {
    "/add": "add",
    "/free": "free",
    "/prefill_complete": "prefill_complete",
    "/potential_loads": "potential_loads",
    "/output_block": "output_block",
    "/project_loads": "project_loads",
    "/batch": "batch",
}

_JSON_HEADER = (b"content-type", b"application/json")


class FastPath:
    def __init__(self, app: ASGIApp, ops: Operations, metrics: HttpMetrics, max_body: int) -> None:
        self.app = app
        self.ops = ops
        self.metrics = metrics
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = FAST_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if name is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        start = perf_counter()
        status, body = await self._serve(name, scope, receive)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [_JSON_HEADER, (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
        self.metrics.observe("POST", scope["path"], status, perf_counter() - start)

    async def _serve(self, name: str, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        content_type = declared = None
        for key, value in scope["headers"]:
            if key == b"content-type":
                content_type = value
            elif key == b"content-length":
                declared = value
        if content_type is None or not is_json_content_type(content_type.decode("latin-1")):
            return 415, error_body(CONTENT_TYPE)
        limit = self.max_body
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return 413, error_body(TOO_LARGE)
        message = await receive()
        body = message.get("body", b"")
        while message.get("more_body"):
            message = await receive()
            body += message.get("body", b"")
            if len(body) > limit:
                return 413, error_body(TOO_LARGE)
        if len(body) > limit:
            return 413, error_body(TOO_LARGE)
        return self.ops.run(name, body)
