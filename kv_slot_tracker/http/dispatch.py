"""The lean path: hot routes served straight from ASGI, before FastAPI's machinery.

Routers call ``/add``, ``/free``, ``/prefill_complete``, ``/potential_loads`` and the selection
routes for every LLM request. The route table (``kv_slot_tracker.http.routes``) marks those *lean*; a request
for one that needs nothing special (authorized when a key is set) is handed to this dispatcher,
which matches the path, parses its parameters, reads the body, runs the same operation the
FastAPI route runs, and sends the pre-encoded answer. That skips the middleware stack, route
matching, dependency resolution and response classes, which together cost several times the
tracker work. Anything else (a 401, a HEAD, a strange path) takes the ordinary FastAPI path,
which answers it identically. Every request is counted in the same HTTP metrics, under the
route's path template.

Paths match as sent, like the reference (axum): a literal segment never matches a
percent-encoded one (``/%61dd`` is not ``/add``), while a path parameter is percent-decoded
(``/selection/reservations/a%2Fb`` names the reservation ``a/b``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any
from urllib.parse import unquote_to_bytes

from starlette.types import Receive, Scope, Send

from kv_slot_tracker.http.answers import Answer, Call, Later, Result
from kv_slot_tracker.http.auth import authorized
from kv_slot_tracker.http.body import declares_body, read_asgi_body
from kv_slot_tracker.http.errors import HttpError, error_result
from kv_slot_tracker.http.responses import send_json

log = logging.getLogger(__name__)

Observe = Callable[[str, str, int, float], None]
ParamParser = Callable[[str], Any]

_INTERNAL = b'{"error":"internal error"}'


def encoded_path(scope: Scope) -> bool:
    """Whether the path was sent percent-encoded (it then matches no literal route)."""
    return b"%" in scope.get("raw_path", b"")


@dataclass(frozen=True, slots=True)
class LeanRoute:
    method: str
    path: str  # the template, e.g. ``/selection/reservations/{selection_id}``
    op: Call  # (body, *path parameters) -> its answer (replicated mode: rarely ``Later``)
    reads_body: bool = True
    params: tuple[ParamParser, ...] = ()  # one parser per ``{...}`` segment, in order
    optional_body: bool = False  # the body may be left out: read only when one is declared

    def segments(self) -> list[bytes | None]:
        """The template split on ``/``: literal segments as bytes, parameters as ``None``."""
        return [
            None if s.startswith("{") and s.endswith("}") else s.encode()
            for s in self.path.split("/")
        ]


class LeanDispatcher:
    def __init__(
        self,
        routes: Sequence[LeanRoute],
        observe: Observe,
        max_body: int,
        api_key: str = "",
    ) -> None:
        self.exact: dict[str, dict[str, LeanRoute]] = {}  # method -> path -> route
        # the exact routes by the request line's method and target as sent: a target that is
        # a route's path (no query string, nothing percent-encoded) finds its route without
        # parsing (``kv_slot_tracker.http.fast_protocol``)
        self.raw_exact: dict[bytes, dict[bytes, LeanRoute]] = {}
        # method -> segment count -> [(segments, route)]
        self.templated: dict[str, dict[int, list[tuple[list[bytes | None], LeanRoute]]]] = {}
        for r in routes:
            self.add_route(r)
        self.observe = observe
        self.max_body = max_body
        self.token = api_key.encode() if api_key else None

    def add_route(self, r: LeanRoute) -> None:
        """Serve ``r`` (in place of a route of the same method and path)."""
        if "{" in r.path:
            by_count = self.templated.setdefault(r.method, {})
            segs = r.segments()
            same = by_count.setdefault(len(segs), [])
            same[:] = [(s, o) for s, o in same if o.path != r.path]
            same.append((segs, r))
        else:
            self.exact.setdefault(r.method, {})[r.path] = r
            self.raw_exact.setdefault(r.method.encode(), {})[r.path.encode()] = r

    def route_for(self, scope: Scope) -> tuple[LeanRoute, list[str]] | None:
        """The lean route serving this request with its raw path parameters, or None for the
        ordinary path."""
        if scope["type"] != "http":
            return None
        method = scope["method"]
        found: tuple[LeanRoute, list[str]] | None = None
        exact = self.exact.get(method)
        route = exact.get(scope["path"]) if exact is not None else None
        if route is not None:
            if encoded_path(scope):
                return None
            found = (route, [])
        else:
            by_count = self.templated.get(method)
            if by_count is None:
                return None
            parts = _raw_parts(scope)
            for segs, r in by_count.get(len(parts), ()):
                values = _match(segs, parts)
                if values is not None:
                    found = (r, values)
                    break
            if found is None:
                return None
        if self.token is not None and not authorized(scope, self.token):
            return None  # the ordinary path answers the 401
        return found

    def matches_template(self, scope: Scope) -> bool:
        """Whether the raw path matches a templated route's path, whatever the method."""
        parts = _raw_parts(scope)
        return any(
            _match(segs, parts) is not None
            for by_count in self.templated.values()
            for segs, _ in by_count.get(len(parts), ())
        )

    def answer(self, route: LeanRoute, args: list[Any], body: bytes) -> Answer:
        """The route's answer to its parsed path parameters and a body already read: its
        ``Result``, or (replicated mode, when it must wait) ``Later``. Never raises."""
        try:
            return route.op(body, *args)
        except Exception:  # a bug, never client input: answer 500 and keep serving
            log.exception("unexpected error serving %s %s", route.method, route.path)
            return 500, _INTERNAL

    async def serve(
        self, found: tuple[LeanRoute, list[str]], scope: Scope, receive: Receive, send: Send
    ) -> None:
        route, values = found
        start = perf_counter()
        try:
            args = parse_params(route, values)
            body = (
                await read_asgi_body(scope, receive, self.max_body)
                if route.reads_body and (not route.optional_body or declares_body(scope["headers"]))
                else b""
            )
        except HttpError as e:
            answer: Answer = error_result(e)
        else:
            answer = self.answer(route, args, body)
        await self.reply(route, answer, send, start)

    async def reply(self, route: LeanRoute, answer: Answer, send: Send, start: float) -> None:
        """Send ``answer`` (awaited first when it is ``Later``: the call waits for
        replication, ``kv_slot_tracker.http.replicated``) and count the request, timed from
        ``start``."""
        result: Result
        try:
            result = await answer if isinstance(answer, Later) else answer
        except Exception:
            log.exception("unexpected error serving %s %s", route.method, route.path)
            result = 500, _INTERNAL
        status, payload = result
        await send_json(send, status, payload)
        self.observe(route.method, route.path, status, perf_counter() - start)


def parse_params(route: LeanRoute, values: list[str]) -> list[Any]:
    """The route's path parameters, parsed (HttpError for a bad one)."""
    if not values:
        return values
    return [parse(v) for parse, v in zip(route.params, values, strict=True)]


def _raw_parts(scope: Scope) -> list[bytes]:
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    return raw.split(b"?", 1)[0].split(b"/")


def _match(segs: list[bytes | None], parts: list[bytes]) -> list[str] | None:
    """The decoded parameters when ``parts`` fits the template; a parameter may be empty
    except as the last segment (``/reservations/`` is no reservation path, as in axum)."""
    if segs[-1] is None and not parts[-1]:
        return None
    values: list[str] = []
    for want, got in zip(segs, parts, strict=True):
        if want is None:
            try:
                values.append(unquote_to_bytes(got).decode("utf-8"))
            except UnicodeDecodeError:
                return None
        elif want != got:
            return None
    return values
