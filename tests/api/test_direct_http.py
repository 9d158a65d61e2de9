"""The direct HTTP path (``kv_slot_tracker.http.fast_protocol``) against uvicorn's ASGI path, over real sockets.

Two uvicorn servers run the same application in the test's event loop: one with the direct
protocol, one with plain httptools. Every exchange is sent byte for byte to both, and the
answers (status, body, content type, connection handling) must be the same. A counting wrapper
around the ASGI application shows which requests the direct server answered without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn

from kv_slot_tracker.http.answers import Later
from kv_slot_tracker.http.connection import (
    ConnectionLimits,
    LimitedHttpToolsProtocol,
    limited_protocol,
)
from kv_slot_tracker.http.dispatch import LeanRoute
from kv_slot_tracker.http.fast_protocol import DirectHttpToolsProtocol, direct_protocol
from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import load_settings
from tests.fakes import FakeClock

KEY = "k3y"


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def same_as(self) -> tuple[int, str | None, str | None, bytes]:
        """What must agree between the two paths (``date`` and ``server`` may not)."""
        return (
            self.status,
            self.headers.get("content-type"),
            self.headers.get("connection"),
            self.body,
        )


@dataclass
class Served:
    port: int
    asgi_calls: list[str] = field(default_factory=list)

    async def exchange(
        self, data: bytes, answers: int, *, see_close: bool = True
    ) -> tuple[list[Answer], bool]:
        """Send ``data`` on a new connection and read ``answers`` responses; also whether the
        server then closed the connection (``see_close``: waits for it a moment)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(data)
            await writer.drain()
            out = [await read_answer(reader) for _ in range(answers)]
            if not see_close:
                return out, False
            try:
                closed = await asyncio.wait_for(reader.read(1), 0.2) == b""
            except TimeoutError:
                closed = False
            return out, closed
        finally:
            writer.close()

    async def one(self, data: bytes) -> Answer:
        (answer,), _ = await self.exchange(data, 1, see_close=False)
        return answer


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Answer(status, headers, body)


def request(method: str, path: str, body: Any = None, **headers: str) -> bytes:
    """A raw HTTP/1.1 request; ``body`` is JSON-encoded unless it is bytes."""
    raw = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
    hdrs = {"host": "t", "content-type": "application/json", "content-length": str(len(raw))}
    hdrs.update({k.replace("_", "-"): v for k, v in headers.items()})
    head = "".join(f"{k}: {v}\r\n" for k, v in hdrs.items() if v != "")
    return f"{method} {path} HTTP/1.1\r\n{head}\r\n".encode() + raw


@contextlib.asynccontextmanager
async def serve(
    direct: bool,
    patch: Callable[[Any], None] | None = None,
    keep_alive: float = 5,
    **overrides: Any,
) -> AsyncIterator[Served]:
    settings = load_settings(**{"api_key": "", "redis_url": "", **overrides})
    app = create_app(settings, clock=FakeClock().now)
    if patch is not None:
        patch(app)
    served = Served(0)

    async def counting(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            served.asgi_calls.append(scope["path"])
        await app(scope, receive, send)

    # both paths with the connection limits (a body over the limit is refused at once by both)
    protocol = (
        direct_protocol(app.lean)
        if direct
        else limited_protocol(
            ConnectionLimits(65_536, 10.0, 30.0, max_body_bytes=app.lean.max_body)
        )
    )
    config = uvicorn.Config(
        counting,
        host="127.0.0.1",
        port=0,
        http=protocol,
        log_level="warning",
        lifespan="on",
        timeout_keep_alive=keep_alive,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the server did not start"
        await asyncio.sleep(0.01)
    served.port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield served
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def both(**overrides: Any) -> AsyncIterator[tuple[Served, Served]]:
    async with serve(True, **overrides) as direct, serve(False, **overrides) as asgi:
        yield direct, asgi


def register(worker_id: int) -> bytes:
    return request(
        "POST",
        "/register",
        {"worker_id": worker_id, "model_name": "m", "block_size": 4, "dp_start": 0, "dp_size": 2},
    )


def add(rid: str, worker_id: int = 1, hashes: list[int] | None = None) -> bytes:
    return request(
        "POST",
        "/add",
        {
            "model_name": "m",
            "request_id": rid,
            "worker_id": worker_id,
            "dp_rank": 1,
            "sequence_hashes": [1, 2, 3] if hashes is None else hashes,
            "new_isl_tokens": 12,
        },
    )


def free(rid: str) -> bytes:
    return request("POST", "/free", {"model_name": "m", "request_id": rid})


POTENTIAL = request(
    "POST",
    "/potential_loads",
    {"model_name": "m", "sequence_hashes": [1, 2, 9], "new_isl_tokens": 7},
)

# (request, served directly): one exchange after another on each server, same state on both
SCRIPT: list[tuple[bytes, bool]] = [
    (register(1), False),
    (register(2), False),
    (add("a"), True),
    (add("b", 2, [1, 2]), True),
    (add("a"), True),  # duplicate id: 409
    (add("c", 7), True),  # unknown worker: 404
    (POTENTIAL, True),
    (request("POST", "/add", b'{"model_name": "m",'), True),  # malformed JSON: 400
    (request("POST", "/add", {"model_name": "m"}), True),  # missing fields: 422
    (request("POST", "/add", b"{}", content_type="text/plain"), True),  # 415
    (request("POST", "/add", b"{}", content_type=""), True),  # no content type: 415
    (request("POST", "/free", b"x" * 5000), True),  # over the body limit: 413
    (request("POST", "/%61dd", {}), False),  # a literal segment never matches encoded: 404
    (request("GET", "/add"), False),  # wrong method: 405
    (request("DELETE", "/selection/workers/abc"), True),  # bad path parameter: 400
    (request("DELETE", "/selection/workers/5"), True),  # unknown worker: 404
    (request("DELETE", "/selection/reservations/a%2Fb"), True),  # decoded parameter: 404
    (request("POST", "/add?x=1", b"{}"), True),  # a query string does not change the route
    (free("a"), True),
    (free("a"), True),  # freeing twice is a no-op
    (POTENTIAL, True),
    (request("GET", "/loads?model_name=m"), False),
]


async def test_every_answer_is_the_asgi_paths_answer() -> None:
    async with both(max_body_bytes=4096) as (direct, asgi):
        for raw, is_direct in SCRIPT:
            before = len(direct.asgi_calls)
            got, want = await direct.one(raw), await asgi.one(raw)
            assert got.same_as() == want.same_as(), raw
            assert got.headers.keys() == want.headers.keys(), raw
            served_directly = len(direct.asgi_calls) == before
            assert served_directly is is_direct, raw
        # the one body declared larger than the limit is refused at its headers, before the app
        assert len(asgi.asgi_calls) == len(SCRIPT) - 1
        loads = (await direct.one(POTENTIAL)).json()
        assert [(r["worker_id"], r["dp_rank"], r["potential_decode_blocks"]) for r in loads] == [
            (1, 0, 3),
            (1, 1, 3),
            (2, 0, 3 + 2 - 2),  # b holds [1, 2]: the prompt's first two blocks are there
            (2, 1, 3),
        ]


async def test_a_chunked_body_is_read_and_limited() -> None:
    body = json.dumps({"model_name": "m", "request_id": "z"}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    big = b"".join(b"%x\r\n%s\r\n" % (1000, b" " * 1000) for _ in range(5)) + b"0\r\n\r\n"
    async with both(max_body_bytes=4096) as (direct, asgi):
        for raw in (
            request("POST", "/free", chunked, content_length="", transfer_encoding="chunked"),
            request("POST", "/free", big, content_length="", transfer_encoding="chunked"),
        ):
            got, want = await direct.one(raw), await asgi.one(raw)
            assert got.same_as() == want.same_as()
        assert [a.status for a in (got, want)] == [413, 413]
        assert direct.asgi_calls == []


async def test_pipelined_requests_are_answered_in_order() -> None:
    """Direct requests behind one still on the ASGI path wait their turn."""
    async with both() as (direct, asgi):
        await direct.one(register(1))
        await asgi.one(register(1))
        script = [add("p"), request("GET", "/loads?model_name=m"), POTENTIAL, free("p"), POTENTIAL]
        wire = b"".join(script)
        got, _ = await direct.exchange(wire, len(script))
        want, _ = await asgi.exchange(wire, len(script))
        assert [a.same_as() for a in got] == [a.same_as() for a in want]
        assert [a.status for a in got] == [201, 200, 200, 200, 200]
        assert got[2].json()[1]["potential_decode_blocks"] == 3 + 3 - 2  # p holds [1, 2, 3]
        assert got[4].json()[1]["potential_decode_blocks"] == 3


async def test_keep_alive_and_close_are_those_of_http() -> None:
    async with both() as (direct, asgi):
        for server in (direct, asgi):
            await server.one(register(1))
        many = b"".join(add(f"k{i}") for i in range(50))
        for server in (direct, asgi):
            answers, closed = await server.exchange(many, 50)
            assert [a.status for a in answers] == [201] * 50 and not closed
        http10 = free("k0").replace(b"HTTP/1.1", b"HTTP/1.0")
        close = request(
            "POST", "/free", {"model_name": "m", "request_id": "k1"}, connection="close"
        )
        for raw in (http10, close):
            (got,), got_closed = await direct.exchange(raw, 1)
            (want,), want_closed = await asgi.exchange(raw, 1)
            assert got.same_as() == want.same_as()
            assert got.headers["connection"] == "close" and got_closed and want_closed
        assert direct.asgi_calls == ["/register"]


async def test_an_idle_connection_closes_after_the_keep_alive_timeout_a_busy_one_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    call_later = loop.call_later

    def counting(delay: float, *args: Any) -> asyncio.TimerHandle:
        armed.append(delay)
        return call_later(delay, *args)

    async with serve(True, keep_alive=0.3) as direct:
        await direct.one(register(1))
        reader, writer = await asyncio.open_connection("127.0.0.1", direct.port)
        try:
            monkeypatch.setattr(loop, "call_later", counting)
            for i in range(20):  # back to back: one timer for the connection, not one per call
                writer.write(add(f"a{i}"))
                assert (await read_answer(reader)).status == 201
            assert armed.count(0.3) == 1  # (the client's own waits use other delays)
            for i in range(8):  # a call every 0.1 s for 0.8 s: busy, so it stays open
                await asyncio.sleep(0.1)
                writer.write(free(f"a{i}"))
                assert (await read_answer(reader)).status == 200
            idle_from = loop.time()
            assert await asyncio.wait_for(reader.read(1), 3) == b""  # then idle: closed
            assert loop.time() - idle_from >= 0.25
        finally:
            writer.close()
        assert direct.asgi_calls == ["/register"]


async def test_expect_continue_takes_the_asgi_path() -> None:
    async with serve(True) as direct:
        await direct.one(register(1))
        raw = request(
            "POST", "/free", {"model_name": "m", "request_id": "x"}, expect="100-continue"
        )
        answers, _ = await direct.exchange(raw, 2)
        assert [a.status for a in answers] == [100, 200]
        assert direct.asgi_calls == ["/register", "/free"]


async def test_a_key_is_checked_and_a_refusal_is_the_asgi_paths() -> None:
    async with both(api_key=KEY) as (direct, asgi):
        for server in (direct, asgi):
            await server.one(
                register(1).replace(
                    b"\r\n\r\n", f"\r\nauthorization: Bearer {KEY}\r\n\r\n".encode(), 1
                )
            )
        refused = add("r")
        wrong = request(
            "POST", "/add", add("r").split(b"\r\n\r\n", 1)[1], authorization="Bearer no"
        )
        right = request(
            "POST", "/add", add("r").split(b"\r\n\r\n", 1)[1], authorization=f"Bearer {KEY}"
        )
        for raw in (refused, wrong, right):
            got, want = await direct.one(raw), await asgi.one(raw)
            assert got.same_as() == want.same_as()
        assert (got.status, want.status) == (201, 201)
        assert direct.asgi_calls == ["/register", "/add", "/add"]  # the two refusals


async def test_direct_requests_are_counted_in_the_http_metrics() -> None:
    async with serve(True) as direct:
        await direct.one(register(1))
        for i in range(3):
            await direct.one(add(f"m{i}"))
        await direct.one(add("m0"))
        text = (await direct.one(request("GET", "/metrics"))).body.decode()

    def count(status: str) -> float:
        series = r'kv_slot_tracker_http_requests_total\{handler="/add",method="POST",'
        pattern = series + rf'status="{status}"\}} (\S+)'
        found = re.search(pattern, text)
        return float(found.group(1)) if found else 0.0

    assert (count("2xx"), count("4xx")) == (3.0, 1.0)
    latency = "kv_slot_tracker_http_request_duration_seconds"
    assert latency + '_count{handler="/add",method="POST"} 4.0' in text


def waiting(path: str, until: asyncio.Event, fail: bool = False) -> Callable[[Any], None]:
    """A patch making the lean route ``POST path`` wait for ``until`` before it answers, the
    way a replicated instance's call waits for Redis (``Later``, ``kv_slot_tracker.http.replicated``)."""

    def patch(app: Any) -> None:
        route = app.lean.exact["POST"][path]

        def op(body: bytes, *args: Any) -> Any:
            result = route.op(body, *args)

            async def later() -> tuple[int, bytes]:
                await until.wait()
                if fail:
                    raise RuntimeError("a bug while waiting")
                return result

            return Later(later())

        app.lean.add_route(LeanRoute(route.method, route.path, op, route.reads_body, route.params))

    return patch


async def test_a_call_that_waits_is_answered_in_turn() -> None:
    """The waiting call goes to uvicorn's request cycle; a request pipelined behind it waits."""
    released = asyncio.Event()
    async with serve(True, patch=waiting("/free", released)) as direct:
        await direct.one(register(1))
        await direct.one(add("w"))
        reader, writer = await asyncio.open_connection("127.0.0.1", direct.port)
        try:
            writer.write(free("w") + POTENTIAL + free("w"))
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.2)
            released.set()
            answers = [await read_answer(reader) for _ in range(3)]
        finally:
            writer.close()
        assert [a.status for a in answers] == [200, 200, 200]
        assert answers[0].json() == answers[2].json() == {"status": "ok"}
        assert answers[1].json()[1]["potential_decode_blocks"] == 3  # w was freed first
        # what was pipelined behind the waiting call took uvicorn's path; the waiting call
        # itself never entered the ASGI app
        assert direct.asgi_calls == ["/register", "/potential_loads", "/free"]
        text = (await direct.one(request("GET", "/metrics"))).body.decode()
        sample = 'kv_slot_tracker_http_requests_total{handler="/free",method="POST",status="2xx"}'
        assert sample + " 2.0" in text


async def test_a_call_that_fails_while_waiting_answers_500_and_the_connection_goes_on() -> None:
    released = asyncio.Event()
    released.set()
    async with serve(True, patch=waiting("/free", released, fail=True)) as direct:
        await direct.one(register(1))
        answers, closed = await direct.exchange(free("x") + add("y"), 2)
        assert [(a.status, a.body) for a in answers] == [
            (500, b'{"error":"internal error"}'),
            (201, b'{"status":"ok"}'),
        ]
        assert not closed


@pytest.mark.parametrize("http_direct", [True, False])
def test_the_command_line_picks_the_protocol(http_direct: bool, monkeypatch) -> None:
    import kv_slot_tracker.__main__ as cli

    chosen: dict[str, Any] = {}
    monkeypatch.setattr(cli.uvicorn, "run", lambda app, **kw: chosen.update(kw))
    monkeypatch.setattr(cli, "tune_gc", lambda: None)
    monkeypatch.setenv("SLOT_TRACKER_REDIS_URL", "")
    monkeypatch.setenv("SLOT_TRACKER_HTTP_DIRECT", str(http_direct).lower())
    assert cli.main(["--port", "0"]) == 0
    assert issubclass(chosen["http"], LimitedHttpToolsProtocol)  # both paths have the limits
    assert issubclass(chosen["http"], DirectHttpToolsProtocol) is http_direct
    assert chosen["limit_concurrency"] == 4096
    assert chosen["timeout_keep_alive"] == 5
