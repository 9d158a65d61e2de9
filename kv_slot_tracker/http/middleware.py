"""Pure ASGI middleware of the ordinary (FastAPI) path."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kv_slot_tracker.http.dispatch import encoded_path
from kv_slot_tracker.http.errors import ROUTE_NOT_FOUND, error_body
from kv_slot_tracker.http.responses import send_json

_NOT_FOUND = error_body(ROUTE_NOT_FOUND)


class HeadAsGet:
    """HEAD is answered like GET without a body, as the reference does; a percent-encoded path
    matches no route, unless ``templated`` says the encoding sits in a path parameter (which is
    decoded, as the reference decodes it).

    FastAPI's GET routes do not accept HEAD (405). Headers, including ``content-length``, stay
    those of the GET answer; a HEAD on a POST-only route is still a 405.
    """

    def __init__(
        self, app: ASGIApp, templated: Callable[[Scope], bool] = lambda scope: False
    ) -> None:
        self.app = app
        self.templated = templated

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if encoded_path(scope) and not self.templated(scope):
            await send_json(send, 404, _NOT_FOUND, head=scope["method"] == "HEAD")
            return
        if scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_without_body)
