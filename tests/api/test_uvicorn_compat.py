"""What ``kv_slot_tracker.http.fast_protocol`` and ``kv_slot_tracker.http.connection`` use of uvicorn's
httptools protocol, which is not a public API, exists on the installed uvicorn.

The attributes are read from the two modules' source (every ``self.name`` they use and do not
define themselves), so a new use is checked without an edit here; the objects the protocol
holds (parser, flow control, server state, request cycle) are checked by what the modules call
on them. With ``tests/api/test_direct_http.py`` (both paths over real sockets) this is what to
run against a new uvicorn release before moving the bound in ``pyproject.toml``:
``bench/try_uvicorn.sh`` does it in a scratch virtualenv.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path
from typing import Any

import uvicorn
import uvicorn.protocols.http.httptools_impl as impl
from uvicorn.server import ServerState

from kv_slot_tracker.http import connection, fast_protocol
from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import load_settings

OURS = (fast_protocol.DirectHttpToolsProtocol, connection.LimitedHttpToolsProtocol)


def used_attributes() -> set[str]:
    """Every ``self.<name>`` the two protocol classes read, write or call."""
    names: set[str] = set()
    classes = {cls.__name__ for cls in OURS}
    for module in (fast_protocol, connection):
        tree = ast.parse(Path(inspect.getfile(module)).read_text())
        bodies = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in classes]
        for node in (n for body in bodies for n in ast.walk(body)):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return names


def defined_here() -> set[str]:
    """The names the two classes define themselves (methods, class attributes, annotations)."""
    names: set[str] = set()
    for cls in OURS:
        names |= set(vars(cls)) | set(getattr(cls, "__annotations__", {}))
    return names - set(vars(impl.HttpToolsProtocol))


class _Transport:
    """What the protocol writes to: drops the bytes."""

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)

    def is_closing(self) -> bool:
        return False

    def write(self, data: Any) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def close(self) -> None: ...


def test_every_uvicorn_attribute_the_modules_use_exists() -> None:
    needed = used_attributes() - defined_here()
    assert {"parser", "transport", "server_state", "cycle", "flow"} <= needed  # found at all
    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(create_app(load_settings(api_key="", redis_url="")))
        config.load()
        # uvicorn's own class, not ours: what it provides by itself
        protocol = impl.HttpToolsProtocol(
            config=config, server_state=ServerState(), app_state={}, _loop=loop
        )
        protocol.connection_made(_Transport())  # type: ignore[arg-type]
        protocol.on_message_begin()
        missing = sorted(n for n in needed if not hasattr(protocol, n))
        assert missing == [], f"uvicorn {uvicorn.__version__} lacks {missing}"
        # what the modules call on the objects it holds
        for name in ("should_keep_alive", "get_http_version", "get_method", "should_upgrade"):
            assert callable(getattr(protocol.parser, name)), name
        assert isinstance(protocol.flow.write_paused, bool)
        assert isinstance(protocol.server_state.total_requests, int)
        assert isinstance(protocol.server_state.default_headers, list)
        protocol.connection_lost(None)
    finally:
        loop.close()


def test_the_module_level_names_are_uvicorns() -> None:
    assert impl.STATUS_LINE[201].startswith(b"HTTP/1.1 201 ")
    # the 503 application is looked up as a global of the module when a request comes
    # (``connection`` replaces it), not bound at import
    assert "service_unavailable" in impl.HttpToolsProtocol.on_headers_complete.__code__.co_names
    assert impl.service_unavailable is connection._service_unavailable
    # the request cycle ``direct`` builds for a call that waits, keyword for keyword
    params = set(inspect.signature(impl.RequestResponseCycle).parameters)
    assert params == {
        "scope",
        "transport",
        "flow",
        "logger",
        "access_logger",
        "access_log",
        "default_headers",
        "message_event",
        "expect_100_continue",
        "keep_alive",
        "on_response",
    }
    assert list(inspect.signature(impl.HttpToolsProtocol._start_asgi_task).parameters) == [
        "self",
        "cycle",
        "app",
    ]
    for name in ("more_body", "response_complete"):
        assert name in inspect.getsource(impl.RequestResponseCycle.__init__), name
