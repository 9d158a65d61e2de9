"""Bearer-key authentication: one check, used by the middleware and the lean dispatcher."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from app.http.docs import DOCS_ASSETS
from app.http.errors import UNAUTHORIZED, error_body
from app.http.responses import send_json

# Open even when a key is set: probes (also the selection API's), metrics, the load page and
# the docs.
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


def authorized(scope: Scope, token: bytes) -> bool:
    """``Authorization: Bearer <token>`` (scheme case-insensitive, constant-time compare)."""
    given = b""
    for name, value in scope["headers"]:
        if name == b"authorization":
            given = value
            break
    scheme, _, key = given.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(key, token)


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(DOCS_ASSETS)


class BearerAuth:
    """Pure ASGI middleware: every route but the open ones needs ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.token = api_key.encode()
        self.body = error_body(UNAUTHORIZED)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_open(scope["path"]) or authorized(scope, self.token):
            await self.app(scope, receive, send)
            return
        await send_json(send, 401, self.body, headers=((b"www-authenticate", b"Bearer"),))
