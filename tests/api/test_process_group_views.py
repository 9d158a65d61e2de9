"""``ProcessGroupViews`` (``kv_slot_tracker.http.process_group``): ``/replication`` and ``/metrics`` of a
``--workers`` instance read the siblings' own views from their Unix sockets (real sockets here,
served by a stand-in that records what it was asked)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from kv_slot_tracker.http.process_group import ProcessGroupViews

OWN_STATUS = {"mode": "redis", "instance_id": 10, "ready": True, "connected": True,
              "degraded": False, "degraded_reasons": [], "published": 3, "applied": 4}  # fmt: skip
SIBLING_STATUS = {**OWN_STATUS, "instance_id": 11, "published": 5, "applied": 6,
                  "process": 1, "pid": 4242}  # fmt: skip
OWN_METRICS = b"# HELP x_total things\n# TYPE x_total counter\nx_total 3.0\n"
SIBLING_METRICS = b"# HELP x_total things\n# TYPE x_total counter\nx_total 5.0\n"


async def inner(scope: Scope, receive: Receive, send: Send) -> None:
    """This process's own app: 401 without a key, else its own view."""
    headers = dict(scope["headers"])
    if scope["path"] == "/replication" and headers.get(b"authorization") != b"Bearer k":
        body, status, kind = b'{"error":"unauthorized"}', 401, b"application/json"
    elif scope["path"] == "/replication":
        body, status, kind = json.dumps(OWN_STATUS).encode(), 200, b"application/json"
    else:
        body, status, kind = OWN_METRICS, 200, b"text/plain"
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", kind), (b"content-length", b"%d" % len(body))]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def sibling(tmp_path: Path) -> AsyncIterator[tuple[str, list[bytes]]]:
    """Process 1 on its Unix socket; yields its path and the requests it received."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        seen.append(request)
        metrics = request.startswith(b"GET /metrics")
        body = SIBLING_METRICS if metrics else json.dumps(SIBLING_STATUS).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    path = str(tmp_path / "process-1.sock")
    server = await asyncio.start_unix_server(handle, path=path)
    try:
        yield path, seen
    finally:
        server.close()
        await server.wait_closed()


async def get(app: Any, route: str, **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://process") as client:
        return await client.get(route, headers=headers)


def views(sibling_path: str, tmp_path: Path) -> ProcessGroupViews:
    # process 2's socket does not exist: it is being restarted
    paths = {0: str(tmp_path / "process-0.sock"), 1: sibling_path,
             2: str(tmp_path / "process-2.sock")}  # fmt: skip
    return ProcessGroupViews(inner, index=0, siblings=lambda: paths)


async def test_replication_of_every_process_with_the_callers_key(
    sibling: tuple[str, list[bytes]], tmp_path: Path
) -> None:
    path, seen = sibling
    r = await get(views(path, tmp_path), "/replication", authorization="Bearer k")
    assert r.status_code == 200
    body = r.json()
    assert [(w["process"], w["instance_id"]) for w in body["processes"]] == [(0, 10), (1, 11)]
    assert body["published"] == 8 and body["applied"] == 10
    assert body["processes_missing"] == [2] and not body["ready"] and body["degraded"]
    assert int(r.headers["content-length"]) == len(r.content)
    (request,) = seen
    assert request.startswith(b"GET /replication HTTP/1.1\r\n")
    assert b"authorization: Bearer k\r\n" in request
    assert b"x-slot-tracker-local: 1\r\n" in request


async def test_a_refused_call_is_answered_as_the_process_answered_it(
    sibling: tuple[str, list[bytes]], tmp_path: Path
) -> None:
    path, seen = sibling
    r = await get(views(path, tmp_path), "/replication")
    assert r.status_code == 401 and r.json() == {"error": "unauthorized"}
    assert seen == []


async def test_a_sibling_asking_gets_this_process_alone(
    sibling: tuple[str, list[bytes]], tmp_path: Path
) -> None:
    path, seen = sibling
    app = views(path, tmp_path)
    r = await get(app, "/replication", authorization="Bearer k", **{"x-slot-tracker-local": "1"})
    assert r.json() == {**OWN_STATUS, "process": 0, "pid": r.json()["pid"]}
    r = await get(app, "/metrics", **{"x-slot-tracker-local": "1"})
    assert r.content == OWN_METRICS
    assert seen == []


async def test_metrics_of_every_process_labelled(
    sibling: tuple[str, list[bytes]], tmp_path: Path
) -> None:
    path, _ = sibling
    r = await get(views(path, tmp_path), "/metrics")
    lines = [line for line in r.text.splitlines() if line.startswith("x_total")]
    assert lines == ['x_total{process="0"} 3.0', 'x_total{process="1"} 5.0']
