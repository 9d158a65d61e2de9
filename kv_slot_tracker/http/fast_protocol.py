"""The direct path: lean routes answered inside uvicorn's connection callbacks.

For a hot route, uvicorn's own per-request work (a scope, an ASGI task, an event, two ASGI send
messages with header checks, two socket writes, a keep-alive timer) costs more than the tracker's.
``direct_protocol`` gives uvicorn a subclass of its httptools protocol that serves a lean request
as soon as the parser has its body: the same route matching, authorization, header checks,
operation and metrics as the lean ASGI path, and the whole response in one write. Its
keep-alive timer is armed once per idle period, not once per request (``_respond``). Measured on
the lifecycle benchmark: about 1.5x the requests per second of the ASGI path on the same core
(``bench/RESULTS.md``). A call that has to wait (it answers ``Later``: a replicated instance
waiting for Redis or for a record, ``kv_slot_tracker.http.replicated``) is handed to uvicorn's
request cycle and answered from a task, as on the ASGI path.

Everything else is uvicorn's unchanged path, and a request also takes it whenever the direct
path could answer differently from it: a request pipelined behind one still being served (answers
keep their order), ``Expect: 100-continue``, a paused write buffer (uvicorn waits for the client
to read), an upgrade, a root path, a route the lean dispatcher does not serve (including a 401).
The subclass uses uvicorn's protocol attributes, so ``pyproject.toml`` bounds uvicorn's version
and ``tests/api/test_direct_http.py`` drives both paths over real sockets.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from time import perf_counter
from typing import Any

import httptools
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from kv_slot_tracker.http.answers import Answer, Later
from kv_slot_tracker.http.auth import bearer_matches
from kv_slot_tracker.http.body import check_declared_body, declares_body
from kv_slot_tracker.http.connection import (
    FREE_PIECES,
    ConnectionLimits,
    LimitedHttpToolsProtocol,
)
from kv_slot_tracker.http.dispatch import LeanDispatcher, LeanRoute, parse_params
from kv_slot_tracker.http.errors import TOO_LARGE, HttpError, error_result

_JSON_HEAD = b"content-type: application/json\r\ncontent-length: "
_CLOSE = b"connection: close\r\n"


class DirectHttpToolsProtocol(LimitedHttpToolsProtocol):
    """uvicorn's httptools protocol, answering the lean routes itself (module notes)."""

    lean: LeanDispatcher  # set on the subclass ``direct_protocol`` makes
    # whether the connection's size limit (checked first) is within the lean routes' own:
    # then a JSON body that passed it needs no second check
    size_checked: bool = False

    # the request being served directly: its route, parsed parameters, body so far, and the
    # error to answer instead of running it (a bad parameter, content type or size)
    _route: LeanRoute | None = None
    _args: list[Any]
    _body: bytes | bytearray  # the first chunk as given; a bytearray once a second one comes
    _error: HttpError | None
    _start: float
    # uvicorn's default headers (date, server) as bytes, for the list they were made from
    _head_source: object = None
    _head: bytes = b""
    # keep-alive of the direct path: uvicorn cancels its timer when data arrives and arms a new
    # one after each response (a timer handle made and cancelled per request); here one timer
    # per idle period checks when the connection last went idle (``_idle_since``, kept by
    # ``LimitedHttpToolsProtocol``: None while a request is being received or served)
    _idle_timer: asyncio.TimerHandle | None = None

    def _unset_keepalive_if_required(self) -> None:
        """uvicorn's (data arrived, or its own path answered); the connection is busy."""
        self._idle_since = None
        super()._unset_keepalive_if_required()

    def _idle_check(self) -> None:
        """The idle timer: close the connection once it has been idle for the keep-alive
        timeout, or wait for the rest of it. While busy, the next direct response re-arms it
        (and uvicorn's own path has its own timer)."""
        self._idle_timer = None
        since = self._idle_since
        if since is None or self.transport.is_closing():
            return
        left = since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self._idle_timer = self.loop.call_later(left, self._idle_check)
        else:
            self.timeout_keep_alive_handler()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        """uvicorn's, without the ASGI parts of the scope; ``_asgi_scope`` adds them for a
        request that takes uvicorn's path."""
        self._idle = False
        self._content_type = self._declared = None
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = {"type": "http", "headers": self.headers}  # type: ignore[typeddict-item]

    def _asgi_scope(self) -> None:
        self.scope.update(
            {
                "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
                "http_version": self.parser.get_http_version(),
                "server": self.server,
                "client": self.client,
                "scheme": self.scheme,  # type: ignore[typeddict-item]
                "root_path": self.root_path,
                "state": self.app_state.copy(),
            }
        )

    def on_headers_complete(self) -> None:
        self._route = None
        if self._refused:
            return
        declared = self._declared
        # ``_too_large``, inline: a request with a body makes no call for it
        if (
            declared is not None
            and declared.isdigit()
            and int(declared) > self.limits.max_body_bytes
        ):
            self._refuse_too_large()
            return
        cycle = self.cycle
        limit = self.limit_concurrency
        if (
            (cycle is None or cycle.response_complete)
            and not self.pipeline
            and not self.expect_100_continue
            and not self.flow.write_paused
            and not self.root_path
            and not self.parser.should_upgrade()
            # uvicorn's ``limit_concurrency``: its path answers 503
            and (limit is None or (len(self.connections) < limit and len(self.tasks) < limit))
        ):
            lean = self.lean
            # a target that is an exact route's path as sent (the usual request) is looked up
            # on the request line's bytes: its scope is filled only if uvicorn's path takes
            # the request after all (``_answer_later``)
            by_target = lean.raw_exact.get(self.parser.get_method())
            route = by_target.get(self.url) if by_target is not None else None
            found: tuple[LeanRoute, list[str]] | None
            if route is not None and (
                lean.token is None or bearer_matches(self.headers, lean.token)
            ):
                found = (route, [])
            else:
                self._path_scope()
                found = lean.route_for(self.scope)  # type: ignore[arg-type]
            if found is not None:
                self._in_head = False  # what LimitedHttpToolsProtocol.on_headers_complete does
                fed = self._fed_at
                self._reading_since = fed if fed is not None else self.loop.time()
                self._start = perf_counter()
                route, values = found
                self._route, self._body, self._error = route, b"", None
                try:
                    self._args = parse_params(route, values)
                    if route.reads_body and (
                        not route.optional_body or declares_body(self.headers)
                    ):
                        content_type = self._content_type
                        # a JSON body within the connection's limit passes: no call
                        if content_type != b"application/json" or not self.size_checked:
                            check_declared_body(content_type, declared, self.lean.max_body)
                except HttpError as e:
                    self._error = e
                return
        self._asgi_scope()
        super().on_headers_complete()

    def _path_scope(self) -> None:
        """The scope's method, path and query string, from the request line."""
        url = httptools.parse_url(self.url)
        raw_path = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope = self.scope
        scope["method"] = self.parser.get_method().decode("ascii")
        scope["path"] = path
        scope["raw_path"] = raw_path
        scope["query_string"] = url.query or b""

    def on_body(self, body: bytes) -> None:
        if self._route is None:
            super().on_body(body)  # counted there
            return
        if self._refused:
            return
        if self._declared is None:  # ``LimitedHttpToolsProtocol.on_body``'s rule, inline
            received = self._body_bytes = self._body_bytes + len(body)
            if received > self.limits.max_body_bytes:
                self._refuse(413, TOO_LARGE)
                return
            reads = self._reads = self._reads + 1
            if reads > FREE_PIECES and self._too_fragmented(self._request_bytes):
                return
        if self._error:
            return
        buf = self._body
        if not buf:
            buf = self._body = body  # the usual body: one chunk, kept without a copy
        else:  # appending to bytes would copy the whole body per chunk
            if type(buf) is bytes:
                buf = self._body = bytearray(buf)
            buf += body

    def on_message_complete(self) -> None:
        route = self._route
        if route is None or self._refused:
            super().on_message_complete()
            return
        self._reading_since = None  # what LimitedHttpToolsProtocol.on_message_complete does
        self._in_head, self._received = True, False
        self._route = None
        body, self._body = self._body, b""
        if isinstance(body, bytearray):
            body = bytes(body)
        answer: Answer
        if self._error is not None:
            answer = error_result(self._error)
        else:
            answer = self.lean.answer(route, self._args, body if route.reads_body else b"")
            if isinstance(answer, Later):  # it waits for replication (http/replicated.py)
                self._answer_later(route, answer)
                return
        status, payload = answer
        self._respond(status, payload)
        self.lean.observe(route.method, route.path, status, perf_counter() - self._start)

    def _answer_later(self, route: LeanRoute, pending: Later) -> None:
        """Hand a call that waits to uvicorn's request cycle, as if it had taken uvicorn's
        path from the start: requests pipelined behind it queue until it is answered, and
        uvicorn writes the answer, keeps the connection alive and serves the queue."""
        if "path" not in self.scope:  # the route was found on the request line
            self._path_scope()
        self._asgi_scope()
        self.cycle = cycle = RequestResponseCycle(
            scope=self.scope,
            transport=self.transport,
            flow=self.flow,
            logger=self.logger,
            access_logger=self.access_logger,
            access_log=self.access_log,
            default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(),
            expect_100_continue=False,
            keep_alive=self.scope["http_version"] != "1.0" and self.parser.should_keep_alive(),
            on_response=self.on_response_complete,
        )
        cycle.more_body = False
        lean, start = self.lean, self._start

        async def answer(scope: Scope, receive: Receive, send: Send) -> None:
            await lean.reply(route, pending, send, start)

        self._start_asgi_task(cycle, answer)  # type: ignore[arg-type]

    def _respond(self, status: int, payload: bytes) -> None:
        """What uvicorn's send and ``on_response_complete`` do for a complete JSON response."""
        transport = self.transport
        self.server_state.total_requests += 1
        if transport.is_closing():
            return
        defaults = self.server_state.default_headers
        if defaults is not self._head_source:  # uvicorn renews the list (the date) every second
            self._head = b"".join(name + b": " + value + b"\r\n" for name, value in defaults)
            self._head_source = defaults
        keep_alive = self.parser.should_keep_alive()
        transport.write(
            b"".join(
                (
                    STATUS_LINE[status],
                    self._head,
                    _JSON_HEAD,
                    str(len(payload)).encode(),
                    b"\r\n" if keep_alive else b"\r\n" + _CLOSE,
                    b"\r\n",
                    payload,
                )
            )
        )
        if not keep_alive:
            transport.close()
        else:
            # idle from the request's own clock read when it came in one piece (the same loop
            # step): the keep-alive timeout runs a few microseconds early
            fed = self._fed_at
            self._idle_since = fed if fed is not None else self.loop.time()
            if not self.pipeline:
                self.limits.went_idle(self)
            if self._idle_timer is None:
                self._idle_timer = self.loop.call_later(self.timeout_keep_alive, self._idle_check)


def direct_protocol(
    lean: LeanDispatcher, limits: ConnectionLimits | None = None
) -> type[HttpToolsProtocol]:
    """The protocol class to give uvicorn (``http=``) for ``lean``'s routes."""
    if limits is None:
        limits = ConnectionLimits(65_536, 10.0, 30.0, max_body_bytes=lean.max_body)
    attrs: dict[str, Any] = {
        "lean": lean,
        "limits": limits,
        "size_checked": limits.max_body_bytes <= lean.max_body,
    }
    return type("DirectHttpToolsProtocol", (DirectHttpToolsProtocol,), attrs)
