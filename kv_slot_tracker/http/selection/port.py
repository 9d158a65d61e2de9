"""The selection API at the root of a port of its own (``selection_port``).

Dynamo's selection service answers ``/select``, ``/workers``, ``/reservations/...`` at the root
of port 8092; this service answers them under ``/selection`` on its one port. With
``selection_port`` set, a second listening socket serves the selection routes at its root, in
the same process, event loop and state as ``/selection/*``, so that a selection client changes
nothing but the address.

How: one uvicorn server listens on both sockets (one lifespan, one connection limit, one
shutdown). Its connection protocol is the usual one (direct or ASGI, ``__main__``) with one
check when a connection is made: a connection to the selection port gets, for that connection
only, an application that prefixes each request's path with ``/selection`` (and, on the direct
path, a lean dispatcher that does the same before matching). A request on the main port pays
nothing per request; a connection pays one comparison. The routes, their errors, metrics and
authentication are those of ``/selection/*`` (a path that is no selection route answers the
same 404 as an unknown path; ``/metrics`` and the docs stay on the main port). A path already
under ``/selection/`` is served as it is, so that a URL written for the main port works there
too (another instance's ``indexer_peers`` loads ``/selection/kv_index`` from either port).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from kv_slot_tracker.http.dispatch import LeanDispatcher, LeanRoute

PREFIX = "/selection"


class PrefixedApp:
    """An ASGI application serving ``app`` with ``prefix`` put before every request's path."""

    def __init__(self, app: ASGIApp, prefix: str = PREFIX) -> None:
        self.app = app
        self.prefix = prefix
        self.raw_prefix = prefix.encode("ascii")
        self.within = prefix + "/"  # a path already under the prefix is served as it is

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not scope["path"].startswith(self.within):
            scope = dict(scope)
            scope["path"] = self.prefix + scope["path"]
            raw = scope.get("raw_path")
            if raw is not None:
                scope["raw_path"] = self.raw_prefix + raw
        await self.app(scope, receive, send)


class PrefixedLean:
    """The lean dispatcher as the direct path uses it, matching ``prefix`` + the path (the
    scope is the protocol's own for this request: it is changed in place)."""

    def __init__(self, lean: LeanDispatcher, prefix: str = PREFIX) -> None:
        self.lean = lean
        self.prefix = prefix
        self.raw_prefix = prefix.encode("ascii")
        self.within = prefix + "/"
        self.max_body = lean.max_body
        self.observe = lean.observe
        self.answer = lean.answer
        self.reply = lean.reply
        self.token = lean.token
        # the request-line table (``LeanDispatcher.raw_exact``) as this port matches: a route
        # under the prefix by its path with or without it
        raw_within = self.within.encode("ascii")
        self.raw_exact: dict[bytes, dict[bytes, LeanRoute]] = {
            method: {
                target: route
                for path, route in paths.items()
                if path.startswith(raw_within)
                for target in (path, path[len(self.raw_prefix) :])
            }
            for method, paths in lean.raw_exact.items()
        }

    def route_for(self, scope: Scope) -> tuple[LeanRoute, list[str]] | None:
        if not scope["path"].startswith(self.within):
            scope["path"] = self.prefix + scope["path"]
            raw = scope.get("raw_path")
            if raw is not None:
                scope["raw_path"] = self.raw_prefix + raw
        return self.lean.route_for(scope)


def selection_port_protocol(base: type[asyncio.Protocol], selection_port: int) -> type:
    """``base`` (uvicorn's connection protocol as ``__main__`` chose it), serving connections
    to ``selection_port`` with the ``/selection`` prefix put before every path."""
    prefixed_lean: list[PrefixedLean] = []  # made once, from the first connection's dispatcher

    def connection_made(self: Any, transport: asyncio.Transport) -> None:
        base.connection_made(self, transport)
        local = self.server
        if local is not None and len(local) == 2 and local[1] == selection_port:
            self.app = PrefixedApp(self.app)
            lean = getattr(self, "lean", None)
            if lean is not None:  # the direct path
                if not prefixed_lean:
                    prefixed_lean.append(PrefixedLean(lean))
                self.lean = prefixed_lean[0]

    return type(base.__name__, (base,), {"connection_made": connection_made})


def check(settings: Any, workers: int) -> str | None:
    """Why ``selection_port`` cannot be served with ``workers`` processes (``workers = "auto"``
    resolved at start; the settings refuse the other cases), if it cannot."""
    if settings.selection_port and workers > 1:
        return (
            f"selection_port is served by one server process, and workers = auto gives {workers}"
            ": set workers = 1 with it, or use /selection on port with several processes"
        )
    return None


def bind(settings: Any, app: Any) -> list[socket.socket]:
    """The main port's and the selection port's listening sockets (uvicorn binds them as it
    would its own, and says where it listens)."""
    return [
        uvicorn.Config(app, host=settings.host, port=port).bind_socket()
        for port in (settings.port, settings.selection_port)
    ]


def server(app: Any, options: dict[str, Any], port: int) -> uvicorn.Server:
    """The uvicorn server of ``app`` with uvicorn's ``options``, ``port`` being the selection
    port; run it over both listening sockets (``bind``)."""
    options = {**options, "http": selection_port_protocol(options["http"], port)}
    return uvicorn.Server(uvicorn.Config(app, **options))


def serve(app: Any, options: dict[str, Any], sockets: list[socket.socket], port: int) -> None:
    server(app, options, port).run(sockets=sockets)
