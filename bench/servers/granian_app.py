"""The app for granian (``bench/server_cost.py``): ``app`` for its ASGI interface, ``rsgi`` for
its RSGI one.

``rsgi`` is a thin adapter: a lean route (``kv_slot_tracker.http.dispatch``) is answered from the
RSGI protocol object (body read with one await, the answer written with ``response_bytes``);
every other request (setup calls, /health) is bridged to the ASGI app. The app's lifespan is
entered on the first request. Benchmark only: granian is not a dependency.
"""

from __future__ import annotations

import sys
from pathlib import Path
from time import perf_counter
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kv_slot_tracker.gc_tuning import tune_gc  # noqa: E402
from kv_slot_tracker.main import create_app  # noqa: E402
from kv_slot_tracker.settings import load_settings  # noqa: E402

app = create_app(load_settings())
tune_gc()

_JSON = [("content-type", "application/json")]


class Rsgi:
    def __init__(self, asgi: Any) -> None:
        self.asgi = asgi
        self.lean = asgi.lean
        self._lifespan: Any = None

    async def _started(self) -> None:
        self._lifespan = self.asgi.router.lifespan_context(self.asgi)
        await self._lifespan.__aenter__()

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        if self._lifespan is None:
            await self._started()
        path = scope.path
        asgi_scope = {
            "type": "http",
            "method": scope.method,
            "path": path,
            "raw_path": path.encode(),
            "query_string": scope.query_string.encode(),
            "headers": [(k.encode(), v.encode()) for k, v in scope.headers.items()],
        }
        found = self.lean.route_for(asgi_scope)
        if found is not None:
            start = perf_counter()
            route, values = found
            body = await proto() if route.reads_body else b""
            from kv_slot_tracker.http.answers import Later
            from kv_slot_tracker.http.dispatch import parse_params

            answer = self.lean.answer(route, parse_params(route, values), body)
            status, payload = await answer if isinstance(answer, Later) else answer
            proto.response_bytes(status, _JSON, payload)
            self.lean.observe(route.method, route.path, status, perf_counter() - start)
            return
        await self._bridge(asgi_scope, proto)

    async def _bridge(self, asgi_scope: dict, proto: Any) -> None:
        body = await proto()
        asgi_scope.update(
            {
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "scheme": "http",
                "root_path": "",
                "server": None,
                "client": None,
                "state": {},
            }
        )
        sent = False
        out: dict[str, Any] = {"status": 500, "headers": [], "body": b""}

        async def receive() -> dict:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                out["status"] = message["status"]
                out["headers"] = [(k.decode(), v.decode()) for k, v in message["headers"]]
            elif message["type"] == "http.response.body":
                out["body"] += message.get("body", b"")

        await self.asgi(asgi_scope, receive, send)
        proto.response_bytes(out["status"], out["headers"], out["body"])


rsgi = Rsgi(app)
