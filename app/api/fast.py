"""The lean path: hot POST routes served straight from ASGI, before FastAPI's machinery.

Routers call ``/add``, ``/free``, ``/prefill_complete`` and ``/potential_loads`` for every LLM
request. For those (and the other body-only POST routes) the application hands a request that
needs nothing special (no percent-encoded path, authorized when a key is set) to this class,
which reads the body, runs the same ``Operations`` the FastAPI routes run, and sends the
pre-encoded answer. That skips the middleware stack, route matching, dependency resolution and
response classes, which together cost several times the tracker work. Anything else (a 401, a
HEAD, a strange path) takes the ordinary FastAPI path, which answers it identically. The routes
stay declared in FastAPI, so they are in the OpenAPI document, and every request is counted in
the same HTTP metrics.
"""

from __future__ import annotations

import hmac
import logging
from time import perf_counter

from starlette.types import Receive, Scope, Send

from app.api.body import read_asgi_body
from app.api.operations import Operations, error_body
from app.observability import HttpMetrics
from app.service import ServiceError

log = logging.getLogger(__name__)

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
_INTERNAL = b'{"error":"internal error"}'


def bearer_ok(scope: Scope, token: bytes) -> bool:
    """``Authorization: Bearer <token>`` (scheme case-insensitive, constant-time compare)."""
    given = b""
    for name, value in scope["headers"]:
        if name == b"authorization":
            given = value
            break
    scheme, _, key = given.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(key, token)


class FastPath:
    def __init__(
        self, ops: Operations, metrics: HttpMetrics, max_body: int, api_key: str = ""
    ) -> None:
        self.ops = ops
        self.metrics = metrics
        self.max_body = max_body
        self.token = api_key.encode() if api_key else None

    def route_for(self, scope: Scope) -> str | None:
        """The operation serving this request on the lean path, or None for the ordinary path."""
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        name = FAST_ROUTES.get(scope["path"])
        if name is None or b"%" in scope.get("raw_path", b""):
            return None
        if self.token is not None and not bearer_ok(scope, self.token):
            return None  # the ordinary path answers the 401
        return name

    async def serve(self, name: str, scope: Scope, receive: Receive, send: Send) -> None:
        start = perf_counter()
        try:
            status, body = await self._run(name, scope, receive)
        except Exception:  # a bug, never client input: answer 500 and keep serving
            log.exception("unexpected error serving %s", scope["path"])
            status, body = 500, _INTERNAL
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [_JSON_HEADER, (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
        self.metrics.observe("POST", scope["path"], status, perf_counter() - start)

    async def _run(self, name: str, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        try:
            body = await read_asgi_body(scope, receive, self.max_body)
        except ServiceError as e:
            return e.status, error_body(e.message)
        return self.ops.run(name, body)
