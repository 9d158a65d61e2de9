"""The lean path: hot POST routes served straight from ASGI, before FastAPI's machinery.

Routers call ``/add``, ``/free``, ``/prefill_complete`` and ``/potential_loads`` for every LLM
request. The route table (``app.http.routes``) marks those (and the other hot body routes)
*lean*; a request for one that needs nothing special (no percent-encoded path, authorized when a
key is set) is handed to this dispatcher, which reads the body, runs the same operation the
FastAPI route runs, and sends the pre-encoded answer. That skips the middleware stack, route
matching, dependency resolution and response classes, which together cost several times the
tracker work. Anything else (a 401, a HEAD, a strange path) takes the ordinary FastAPI path,
which answers it identically. Every request is counted in the same HTTP metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import perf_counter
from typing import Any

from starlette.types import Receive, Scope, Send

from app.http.auth import authorized
from app.http.body import read_asgi_body
from app.http.errors import HttpError, error_result
from app.http.responses import send_json

log = logging.getLogger(__name__)

# An operation answers at once, or (replicated mode, rarely) with an awaitable of its answer.
Operation = Callable[[bytes], Any]
Observe = Callable[[str, str, int, float], None]

_INTERNAL = b'{"error":"internal error"}'


def encoded_path(scope: Scope) -> bool:
    """Routes match the path as sent, like the reference: ``/%61dd`` is not ``/add``."""
    return b"%" in scope.get("raw_path", b"")


class LeanDispatcher:
    def __init__(
        self, operations: dict[str, Operation], observe: Observe, max_body: int, api_key: str = ""
    ) -> None:
        self.operations = operations  # path -> operation
        self.observe = observe
        self.max_body = max_body
        self.token = api_key.encode() if api_key else None

    def operation_for(self, scope: Scope) -> Operation | None:
        """The operation serving this request on the lean path, or None for the ordinary path."""
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        op = self.operations.get(scope["path"])
        if op is None or encoded_path(scope):
            return None
        if self.token is not None and not authorized(scope, self.token):
            return None  # the ordinary path answers the 401
        return op

    async def serve(self, op: Operation, scope: Scope, receive: Receive, send: Send) -> None:
        start = perf_counter()
        try:
            try:
                body = await read_asgi_body(scope, receive, self.max_body)
            except HttpError as e:
                status, payload = error_result(e)
            else:
                result = op(body)
                if type(result) is not tuple:  # it waits for replication (app.http.replicated)
                    result = await result
                status, payload = result
        except Exception:  # a bug, never client input: answer 500 and keep serving
            log.exception("unexpected error serving %s", scope["path"])
            status, payload = 500, _INTERNAL
        await send_json(send, status, payload)
        self.observe("POST", scope["path"], status, perf_counter() - start)
