"""Limits of one HTTP connection and of the server's connections: what a slow, large or greedy
client may hold.

uvicorn's httptools protocol has no bound on a request's header block (httptools buffers a
header however long it is) and no read timeout: a connection that never sends, or sends a
request a byte a minute, stays open for good. ``LimitedHttpToolsProtocol`` adds, per
connection (settings in brackets):

* the header block of a request at most ``http_max_header_bytes``: a larger one is answered
  431 and the connection closed, before httptools sees the bytes;
* a declared ``Content-Length`` above ``max_body_bytes`` answered 413 as soon as the header
  block is complete, and a body (chunked or not) growing past it answered 413 as soon as it
  does: the connection is closed, the rest of the body is never read;
* the header block complete within ``http_header_timeout_seconds`` of its first byte (or of the
  connection's opening), the body within ``http_body_timeout_seconds`` of the header block:
  otherwise 408 (or a silent close when nothing was sent) and the connection closed;
* a request arriving at ``http_min_request_bytes_per_second`` at least, averaged from its first
  byte once ``http_request_rate_grace_seconds`` have passed, and in pieces (reads and body
  chunks) of ``http_min_bytes_per_read`` on average beyond its first 64 pieces (a request sent
  a byte per packet, or a body in 1-byte chunks, costs a parser callback per byte): otherwise
  408 and the connection closed, long before the body timeout;
* at most ``http_max_connections`` open connections, ``http_max_connections_per_client`` of
  them from one client address: a connection beyond either limit makes room by closing the
  connection that has been idle longest (of that client, or of anyone), so that idle
  connections cannot lock live clients out; when none is idle, a request beyond it is answered
  503 (uvicorn's ``limit_concurrency``), as JSON like every error;
* a request that cannot be parsed, pipelined behind requests still being served, is answered
  400 after their answers (uvicorn's own answer would be written at once, and the answers of
  the requests before it lost although they were applied).

One timer per connection checks the deadlines, re-armed when it fires: a request costs two
clock reads, not a timer. The keep-alive timeout between requests stays uvicorn's
(``http_keep_alive_seconds``). ``kv_slot_tracker.http.fast_protocol`` builds on this class, so both
paths have the limits.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import httptools
import uvicorn.protocols.http.httptools_impl as _uvicorn_httptools
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kv_slot_tracker.http.body import is_json_content_type
from kv_slot_tracker.http.errors import CONTENT_TYPE, TOO_LARGE, error_body

OVER_CONNECTION_LIMIT = "too many open connections; try again later"
OVER_CLIENT_LIMIT = "too many open connections from this client address; try again later"
INVALID_REQUEST = "invalid HTTP request"

_HEAD_END = b"\r\n\r\n"
FREE_PIECES = 64  # pieces of a request before ``min_bytes_per_read`` applies


class ConnectionLimits:
    """The limits of every connection of one server (set on the protocol class), and the table
    of that server's open connections (which of them are idle, per client address)."""

    __slots__ = (
        "max_header_bytes",
        "header_timeout",
        "body_timeout",
        "max_body_bytes",
        "min_bytes_per_second",
        "rate_grace",
        "min_bytes_per_read",
        "max_connections",
        "max_per_client",
        "open",
        "per_client",
        "idle",
        "idle_by_client",
        "shed",
        "refused",
        "_logged_at",
        "_unlogged",
    )

    def __init__(
        self,
        max_header_bytes: int,
        header_timeout: float,
        body_timeout: float,
        *,
        max_body_bytes: int = 2_097_152,
        min_bytes_per_second: int = 1024,
        rate_grace: float = 3.0,
        min_bytes_per_read: int = 256,
        max_connections: int = 4096,
        max_per_client: int = 2048,
    ) -> None:
        self.max_header_bytes = max_header_bytes
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_body_bytes = max_body_bytes
        self.min_bytes_per_second = min_bytes_per_second
        self.rate_grace = rate_grace
        self.min_bytes_per_read = min_bytes_per_read
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.open = 0  # connections counted (made, not shed, not lost)
        self.per_client: dict[str, int] = {}
        # connections that went idle, longest idle first, of everyone and per client address;
        # a connection that went busy since stays until the shedding drops it (``went_idle``)
        self.idle: OrderedDict[LimitedHttpToolsProtocol, None] = OrderedDict()
        # per client address with connections counted (kept, maybe empty, until its last
        # connection goes: a connection going idle and busy per request makes none)
        self.idle_by_client: dict[str, OrderedDict[LimitedHttpToolsProtocol, None]] = {}
        self.shed = 0  # idle connections closed to make room, since start
        self.refused = 0  # connections answered an error and closed, since start
        self._logged_at = float("-inf")  # refusals are logged at most once a second
        self._unlogged = 0

    def log_refusal(self, logger: logging.Logger, now: float, message: str) -> None:
        """Count a refusal and log it, at most once a second (a client refused by the
        thousand must not flood the log): the line says how many went unlogged since."""
        self.refused += 1
        if now - self._logged_at < 1.0:
            self._unlogged += 1
            return
        self._logged_at = now
        more, self._unlogged = self._unlogged, 0
        suffix = f" ({more} more since the last line)" if more else ""
        logger.warning("closing an HTTP connection: %s%s", message, suffix)

    def went_idle(self, conn: LimitedHttpToolsProtocol) -> None:
        """Put ``conn`` last in the idle tables (the server's and its client's). A connection
        going busy only says so (``conn._idle = False``, inline where it happens) and stays in
        the tables; the shedding skips and drops such entries (``_oldest_idle``), and the
        next ``went_idle`` moves the connection to the end again: per request two
        ``move_to_end`` calls, no insert and no delete."""
        if conn._counted and not conn._idle:
            conn._idle = True
            idle = self.idle
            try:
                idle.move_to_end(conn)
            except KeyError:
                idle[conn] = None
            mine = conn._client_idle
            try:
                mine.move_to_end(conn)
            except KeyError:
                mine[conn] = None

    @staticmethod
    def _oldest_idle(
        table: OrderedDict[LimitedHttpToolsProtocol, None],
    ) -> LimitedHttpToolsProtocol | None:
        """The longest idle connection of ``table``, dropping the busy ones found before it
        (they enter again, last, when they next go idle): each entry is dropped at most once
        per ``went_idle``, so shedding costs O(1) amortized."""
        while table:
            conn = next(iter(table))
            if conn._idle:
                return conn
            del table[conn]
        return None

    def count(self, conn: LimitedHttpToolsProtocol) -> bool:
        """Count a new connection, closing the longest idle one of its client (beyond the
        per-client limit) or of anyone (beyond the server's): False when its client is over
        its limit with nothing idle to close (the connection is then refused)."""
        address = conn._address
        mine = self.idle_by_client.get(address)
        if self.per_client.get(address, 0) >= self.max_per_client:
            oldest = self._oldest_idle(mine) if mine is not None else None
            if oldest is None:
                return False
            self._shed(oldest)
            mine = self.idle_by_client.get(address)  # gone if that was the client's last
        if self.open >= self.max_connections:
            oldest = self._oldest_idle(self.idle)
            if oldest is not None:
                self._shed(oldest)
                mine = self.idle_by_client.get(address)
        if mine is None:
            mine = self.idle_by_client[address] = OrderedDict()
        conn._client_idle = mine
        conn._counted = True
        self.open += 1
        self.per_client[address] = self.per_client.get(address, 0) + 1
        return True

    def forget(self, conn: LimitedHttpToolsProtocol) -> None:
        if not conn._counted:
            return
        conn._idle = conn._counted = False
        self.idle.pop(conn, None)
        conn._client_idle.pop(conn, None)
        self.open -= 1
        left = self.per_client[conn._address] - 1
        if left:
            self.per_client[conn._address] = left
        else:
            del self.per_client[conn._address]
            self.idle_by_client.pop(conn._address, None)  # the client's last connection

    def _shed(self, conn: LimitedHttpToolsProtocol) -> None:
        self.forget(conn)
        self.shed += 1
        conn.connections.discard(conn)  # uvicorn's count (``limit_concurrency``) at once too
        conn.transport.close()


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of the module notes."""

    limits: ConnectionLimits = ConnectionLimits(65_536, 10.0, 30.0)

    # the request being read: since when (None: none, the connection is serving or idle), and
    # whether its header block is still coming, with how many of its bytes came so far
    _reading_since: float | None = None
    _in_head: bool = True
    _head_bytes: int = 0
    _received: bool = False  # any byte of the current request
    _request_bytes: int = 0  # bytes of the current request received so far (head and body)
    # pieces of the current request: its reads (``data_received`` calls) and body chunks (each
    # costs a parser callback: a body of 1-byte chunks costs one per byte)
    _reads: int = 0
    _body_bytes: int = 0  # body bytes of the current request parsed so far
    _started: float = 0.0  # when the current request's first byte came
    _deadline_timer: asyncio.TimerHandle | None = None
    # the request's first ``content-type`` and ``content-length`` headers, noted as they are
    # parsed (``on_header``): the size limit and a route's body checks read them, no scan
    _content_type: bytes | None = None
    _declared: bytes | None = None
    # the loop's time when the piece being parsed came, while a request's first piece is
    # parsed (its callbacks run within the same loop step: one clock read serves them all)
    _fed_at: float | None = None
    # since when the connection is idle (None while a request is received or served): the
    # direct path's keep-alive (``kv_slot_tracker.http.fast_protocol``)
    _idle_since: float | None = None
    _refused: bool = False  # answered and closing: parse nothing more
    _deferred_400: bool = False  # a parse error behind requests still being served
    # the connection table's view (``ConnectionLimits``)
    _address: str = ""
    _counted: bool = False
    _idle: bool = False
    _client_idle: OrderedDict[LimitedHttpToolsProtocol, None]  # its client's idle table

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._reading_since = self.loop.time()  # the first request's headers are due
        self._in_head, self._head_bytes, self._received = True, 0, False
        self._request_bytes = self._reads = self._body_bytes = 0
        self._started = self._reading_since
        client = self.client
        self._address = client[0] if client else ""
        limits = self.limits
        if not limits.count(self):
            self._refuse(503, OVER_CLIENT_LIMIT)
            return
        limits.went_idle(self)  # connected, nothing sent yet: the first to go when full
        self._deadline_timer = self.loop.call_later(self._first_check(), self._deadline)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        self.limits.forget(self)
        super().connection_lost(exc)

    def _first_check(self) -> float:
        """Seconds until the timer's first check of a request."""
        return min(self.limits.header_timeout, self.limits.rate_grace)

    def data_received(self, data: bytes) -> None:
        """The request's bookkeeping (its first piece's clock read, the header block's size
        while it is coming, the pieces counted), then uvicorn's ``data_received`` written out
        here (its keep-alive timer cancelled, the parser fed): one Python call per read."""
        if self._refused or self._deferred_400:
            return  # answered (or to be) and closing: nothing more is parsed
        n = len(data)
        limits = self.limits
        if self._reading_since is None:  # the first bytes of the next request: its first piece
            self._reading_since = self._started = self._fed_at = self.loop.time()
            self._in_head = self._received = True
            self._idle = False  # busy (``ConnectionLimits.went_idle``)
            self._body_bytes = 0
            self._reads = 1
            self._request_bytes = n
            # a first piece within the limit holds at most that much of the header block:
            # no search for its end (``_head_bytes`` is read again only if it does not end
            # here, and then it is exactly ``n``)
            head = self._head_bytes = n if n <= limits.max_header_bytes else _head_end(data)
        else:
            self._received = True
            self._idle = False
            reads = self._reads = self._reads + 1
            size = self._request_bytes = self._request_bytes + n
            # a request in a few pieces makes no call until it may be too fragmented
            if reads > FREE_PIECES and self._too_fragmented(size):
                return
            head = 0
            if self._in_head:
                head = self._head_bytes = self._head_bytes + _head_end(data)
        if head > limits.max_header_bytes:
            self._fed_at = None
            self._refuse(431, f"request header block larger than {limits.max_header_bytes} bytes")
            return
        # uvicorn's ``data_received`` (``_unset_keepalive_if_required`` inline)
        self._idle_since = None
        task = self.timeout_keep_alive_task
        if task is not None:
            task.cancel()
            self.timeout_keep_alive_task = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        self._fed_at = None

    def on_header(self, name: bytes, value: bytes) -> None:
        """uvicorn's ``on_header``, noting the first content type and length."""
        name = name.lower()
        # llhttp keeps trailing whitespace, which RFC 9110 section 5.5 excludes from the value
        value = value.rstrip(b" \t")
        if name == b"content-length":
            if self._declared is None:
                self._declared = value
        elif name == b"content-type":
            if self._content_type is None:
                self._content_type = value
        elif name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def _too_large(self, declared: bytes | None) -> bool:
        """Whether a declared ``Content-Length`` (the first) is above the body limit."""
        return (
            declared is not None
            and declared.isdigit()
            and int(declared) > self.limits.max_body_bytes
        )

    def _refuse_too_large(self) -> None:
        """Refuse a request declaring a body above the limit: 413, or 415 when the content
        type (its first header) is not JSON either (the reference checks the content type
        first)."""
        content_type = self._content_type
        if content_type is None or not is_json_content_type(content_type.decode("latin-1")):
            self._refuse(415, CONTENT_TYPE)
        else:
            self._refuse(413, TOO_LARGE)

    def _too_fragmented(self, size: int) -> bool:
        """Refuse (and True) a request of ``size`` bytes so far in more pieces than
        ``FREE_PIECES`` + one per ``min_bytes_per_read`` bytes."""
        reads = self._reads
        if reads > FREE_PIECES and size < (reads - FREE_PIECES) * self.limits.min_bytes_per_read:
            self._refuse(
                408, f"request arriving in pieces too small: {size} bytes in {reads} pieces"
            )
            return True
        return False

    def _body_part(self, size: int) -> bool:
        """Count a body chunk of ``size`` bytes: refuse (and True) once past the body limit or
        too fragmented."""
        received = self._body_bytes = self._body_bytes + size
        if received > self.limits.max_body_bytes:
            self._refuse(413, TOO_LARGE)
            return True
        reads = self._reads = self._reads + 1
        return reads > FREE_PIECES and self._too_fragmented(self._request_bytes)

    def on_message_begin(self) -> None:
        self._idle = False
        self._content_type = self._declared = None
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        if self._too_large(self._declared):
            self._refuse_too_large()
            return
        self._in_head = False
        fed = self._fed_at  # now the body is due
        self._reading_since = fed if fed is not None else self.loop.time()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        # only a chunked body is counted: a declared length was checked within the limit,
        # the parser ends the body there, and its pieces are the reads ``data_received`` counts
        if self._refused or (self._declared is None and self._body_part(len(body))):
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._reading_since = None
        self._in_head, self._received = True, False
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._deferred_400 and not self.pipeline:  # the answers before it are written
            self.server_state.total_requests += 1
            self._deferred_400 = False
            self._refuse(400, INVALID_REQUEST)
            return
        super().on_response_complete()
        if not self.pipeline and not self.transport.is_closing() and self._reading_since is None:
            self.limits.went_idle(self)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP: as JSON, and after the answers of the
        requests before them on the connection (they were applied)."""
        cycle = self.cycle
        if self.pipeline or (cycle is not None and not cycle.response_complete):
            self._deferred_400 = True
            self.flow.pause_reading()
            return
        self._refuse(400, INVALID_REQUEST)

    def _deadline(self) -> None:
        """The timer: close a connection whose request is overdue or too slow, else wait for
        the next check (or a header timeout's worth while no request is being read)."""
        self._deadline_timer = None
        if self.transport.is_closing():
            return
        limits = self.limits
        since = self._reading_since
        wait = limits.header_timeout
        if since is not None:
            now = self.loop.time()
            due = limits.header_timeout if self._in_head else limits.body_timeout
            wait = since + due - now
            if wait <= 0:
                if self._received:
                    part = "header block" if self._in_head else "body"
                    self._refuse(408, f"request {part} not received within {due:g} s")
                else:
                    self.transport.close()  # connected and never sent anything
                return
            took = now - self._started
            if (
                self._received
                and took >= limits.rate_grace
                and self._request_bytes < took * limits.min_bytes_per_second
            ):
                self._refuse(
                    408, f"request arriving slower than {limits.min_bytes_per_second} bytes/s"
                )
                return
            if self._received:
                wait = min(wait, max(limits.rate_grace - took, 0.0) or 1.0)
        self._deadline_timer = self.loop.call_later(wait, self._deadline)

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with the JSON error body and close the connection."""
        self._refused = True
        if self.transport.is_closing():
            return
        self.limits.log_refusal(self.logger, self.loop.time(), message)
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


def _head_end(data: bytes) -> int:
    """How many bytes of ``data`` belong to a header block still coming: up to its end, or
    all of them."""
    end = data.find(_HEAD_END)
    return len(data) if end < 0 else end


def limited_protocol(limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class to give uvicorn (``http=``) when the direct path is off."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
