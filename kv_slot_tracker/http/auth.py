"""Bearer-key authentication: one check, used by the middleware and the lean dispatcher."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kv_slot_tracker.http.docs import DOCS_ASSETS
from kv_slot_tracker.http.errors import UNAUTHORIZED, error_body
from kv_slot_tracker.http.responses import send_json

# Open even when a key is set: probes (also the selection API's), the load page (it asks for
# the key itself), the docs and, unless ``metrics_require_key``, the metrics.
OPEN_PATHS = frozenset(
    {
        "/health",
        "/ready",
        "/metrics",
        "/docs",
        "/redoc",
        "/openapi.json",
        "/docs/oauth2-redirect",
        "/dashboard",
        "/selection/health",
        "/selection/ready",
    }
)
METRICS = "/metrics"

# Open routes whose answer says more than a probe needs: without the key, only these fields
# (``/selection/ready`` lists every worker's endpoints, like the protected
# ``GET /selection/workers``).
PROBE_FIELDS: dict[str, tuple[str, ...]] = {
    "/selection/ready": ("ready", "schedulable_workers"),
}
# Set in the scope of such a call: the handler computes only those fields (``queries.PROBE``).
PROBE_SCOPE_KEY = "kv_slot_tracker.probe_fields"


def authorized(scope: Scope, token: bytes) -> bool:
    """``Authorization: Bearer <token>`` (scheme case-insensitive, constant-time compare)."""
    return bearer_matches(scope["headers"], token)


def bearer_matches(headers: Iterable[tuple[bytes, bytes]], token: bytes) -> bool:
    """``authorized`` on a request's header list (names lower-case, as ASGI gives them)."""
    given = b""
    for name, value in headers:
        if name == b"authorization":
            given = value
            break
    scheme, _, key = given.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(key, token)


def open_paths(metrics_require_key: bool) -> frozenset[str]:
    """The paths open without the key."""
    return OPEN_PATHS - {METRICS} if metrics_require_key else OPEN_PATHS


class BearerAuth:
    """Pure ASGI middleware: every route but the open ones needs ``Authorization: Bearer <key>``;
    an open probe answers a caller without the key only its ``PROBE_FIELDS``."""

    def __init__(self, app: ASGIApp, api_key: str, metrics_require_key: bool = False) -> None:
        self.app = app
        self.token = api_key.encode()
        self.body = error_body(UNAUTHORIZED)
        self.open = open_paths(metrics_require_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or authorized(scope, self.token):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path in self.open or path.startswith(DOCS_ASSETS):
            fields = PROBE_FIELDS.get(path)
            if fields is not None:
                scope[PROBE_SCOPE_KEY] = fields
            await self.app(scope, receive, send if fields is None else _only(fields, send))
            return
        await send_json(send, 401, self.body, headers=((b"www-authenticate", b"Bearer"),))


def _only(fields: tuple[str, ...], send: Send) -> Send:
    """``send`` for a JSON object answer of which only ``fields`` go out."""
    start: Message | None = None
    body = bytearray()

    async def filtered(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
            return
        if message["type"] != "http.response.body" or start is None:
            await send(message)
            return
        body.extend(message.get("body", b""))
        if message.get("more_body", False):
            return
        try:
            doc = orjson.loads(bytes(body))
            payload = orjson.dumps({k: doc[k] for k in fields if k in doc})
        except (orjson.JSONDecodeError, TypeError):
            payload = bytes(body)
        headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
        headers.append((b"content-length", str(len(payload)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    return filtered
