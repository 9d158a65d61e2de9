"""Limits of one HTTP connection: what a slow, large or greedy client may hold.

uvicorn's httptools protocol has no bound on a request's header block (httptools buffers a
header however long it is) and no read timeout: a connection that never sends, or sends a
request a byte a minute, stays open for good. ``LimitedHttpToolsProtocol`` adds, per
connection (settings in brackets):

* the header block of a request at most ``http_max_header_bytes``: a larger one is answered
  431 and the connection closed, before httptools sees the bytes;
* the header block complete within ``http_header_timeout_seconds`` of its first byte (or of the
  connection's opening), the body within ``http_body_timeout_seconds`` of the header block:
  otherwise 408 (or a silent close when nothing was sent) and the connection closed;
* at most ``http_max_connections`` open connections (uvicorn's ``limit_concurrency``): a
  request beyond it is answered 503, as JSON like every error.

One timer per connection checks the deadlines, re-armed when it fires: a request costs two
clock reads, not a timer. The keep-alive timeout between requests stays uvicorn's
(``http_keep_alive_seconds``). ``kv_slot_tracker.http.direct`` builds on this class, so both paths have the
limits.
"""

from __future__ import annotations

import asyncio

import uvicorn.protocols.http.httptools_impl as _uvicorn_httptools
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kv_slot_tracker.http.errors import error_body

OVER_CONNECTION_LIMIT = "too many open connections; try again later"

_HEAD_END = b"\r\n\r\n"


class ConnectionLimits:
    """The limits of every connection of one server (set on the protocol class)."""

    __slots__ = ("max_header_bytes", "header_timeout", "body_timeout")

    def __init__(self, max_header_bytes: int, header_timeout: float, body_timeout: float) -> None:
        self.max_header_bytes = max_header_bytes
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of the module notes."""

    limits: ConnectionLimits = ConnectionLimits(65_536, 10.0, 30.0)

    # the request being read: since when (None: none, the connection is serving or idle), and
    # whether its header block is still coming, with how many of its bytes came so far
    _reading_since: float | None = None
    _in_head: bool = True
    _head_bytes: int = 0
    _received: bool = False  # any byte of the current request
    _deadline_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._reading_since = self.loop.time()  # the first request's headers are due
        self._in_head, self._head_bytes, self._received = True, 0, False
        self._deadline_timer = self.loop.call_later(self.limits.header_timeout, self._deadline)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._reading_since is None:  # the first bytes of the next request
            self._reading_since = self.loop.time()
            self._in_head, self._head_bytes = True, 0
        self._received = True
        if self._in_head:
            end = data.find(_HEAD_END)
            self._head_bytes += len(data) if end < 0 else end
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(
                    431, f"request header block larger than {self.limits.max_header_bytes} bytes"
                )
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._reading_since = self.loop.time()  # now the body is due
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._reading_since = None
        self._in_head, self._received = True, False
        super().on_message_complete()

    def _deadline(self) -> None:
        """The timer: close a connection whose request is overdue, else wait for the next
        deadline (or a header timeout's worth while no request is being read)."""
        self._deadline_timer = None
        if self.transport.is_closing():
            return
        limits = self.limits
        since = self._reading_since
        wait = limits.header_timeout
        if since is not None:
            due = limits.header_timeout if self._in_head else limits.body_timeout
            wait = since + due - self.loop.time()
            if wait <= 0:
                if self._received:
                    part = "header block" if self._in_head else "body"
                    self._refuse(408, f"request {part} not received within {due:g} s")
                else:
                    self.transport.close()  # connected and never sent anything
                return
        self._deadline_timer = self.loop.call_later(wait, self._deadline)

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with the JSON error body and close the connection."""
        self.logger.warning("closing an HTTP connection: %s", message)
        payload = error_body(message)
        self.transport.write(
            b"".join(
                (
                    STATUS_LINE[status],
                    b"content-type: application/json\r\ncontent-length: ",
                    str(len(payload)).encode(),
                    b"\r\nconnection: close\r\n\r\n",
                    payload,
                )
            )
        )
        self.transport.close()
        self._reading_since = None

    def over_connection_limit(self) -> bool:
        """uvicorn's ``limit_concurrency`` test: its path then answers 503."""
        limit = self.limit_concurrency
        return limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit)


async def _service_unavailable(scope: Scope, receive: Receive, send: Send) -> None:
    """uvicorn's answer beyond ``limit_concurrency``, with the service's JSON error body."""
    payload = error_body(OVER_CONNECTION_LIMIT)
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


# uvicorn's protocol looks its 503 application up by this module-level name (``pyproject.toml``
# bounds uvicorn's version; ``tests/api/test_http_limits.py`` checks the answer)
_uvicorn_httptools.service_unavailable = _service_unavailable  # type: ignore[assignment]


def limited_protocol(limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class to give uvicorn (``http=``) when the direct path is off."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
