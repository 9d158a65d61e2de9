"""One instance of several processes (``workers`` > 1): ``/metrics`` and ``/replication`` for
all of them, whichever process answers.

A process started by the supervisor also serves alone on a Unix socket in the supervisor's run
directory (``kv_slot_tracker.supervisor``). ``ProcessGroupViews`` answers ``GET /metrics`` and ``GET
/replication`` with its own view and its siblings' views, read from their sockets with the
``x-slot-tracker-local`` header (which asks one process for its own view only):

* ``/metrics``: every process's series, each labelled ``process="<index>"``; ``sum without
  (process) (...)`` gives the instance's totals of a counter;
* ``/replication``: the counters summed over the processes, ready only when every process is,
  degraded when any is, and each process's own answer under ``processes`` (with its ``process``
  index and ``pid``). A sibling that does not answer (being restarted) is listed in
  ``processes_missing`` and makes the instance degraded.

The tracker state needs no such view: every process holds all of it (``/loads`` and the load
page answer the same from any process, once replication has carried the last call).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Metric, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOCAL_HEADER = b"x-slot-tracker-local"
VIEWS = ("/metrics", "/replication")
SIBLING_TIMEOUT_S = 2.0
SUMMED = ("outbox_depth", "outbox_capacity", "published", "applied", "duplicates", "dropped",
          "gaps", "resets", "resent", "bootstraps", "snapshots_written")  # fmt: skip
SUMMED_BY_KEY = ("records_rejected", "anomalies")  # counters by reason

Response = tuple[int, list[tuple[bytes, bytes]], bytes]


class ProcessGroupViews:
    """ASGI middleware of a supervised process (module docstring). ``siblings()``: every
    process's index and Unix socket path, this one's included."""

    def __init__(self, app: ASGIApp, index: int, siblings: Callable[[], dict[int, str]]) -> None:
        self.app = app
        self.index = index
        self.siblings = siblings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or scope["path"] not in VIEWS:
            await self.app(scope, receive, send)
            return
        status, headers, body = await _capture(self.app, scope, receive)
        if status == 200:
            local = any(name == LOCAL_HEADER for name, _ in scope["headers"])
            if scope["path"] == "/replication":
                body = await self._replication(body, scope, local)
            elif not local:
                body = await self._metrics(body, scope)
        await _send(send, status, headers, body)

    async def _others(self, scope: Scope) -> dict[int, bytes | None]:
        auth = [value for name, value in scope["headers"] if name == b"authorization"]
        others = {i: path for i, path in self.siblings().items() if i != self.index}
        got = await asyncio.gather(*(fetch(p, scope["path"], auth) for p in others.values()))
        return {
            i: r[1] if r is not None and r[0] == 200 else None
            for i, r in zip(others, got, strict=True)
        }

    async def _replication(self, body: bytes, scope: Scope, local: bool) -> bytes:
        own = {**orjson.loads(body), "process": self.index, "pid": os.getpid()}
        if local:
            return orjson.dumps(own)
        views = {self.index: own}
        missing = []
        for index, other in (await self._others(scope)).items():
            if other is None:
                missing.append(index)
            else:
                views[index] = orjson.loads(other)
        return orjson.dumps(merge_status(own, [views[i] for i in sorted(views)], missing))

    async def _metrics(self, body: bytes, scope: Scope) -> bytes:
        views = {self.index: body}
        views.update({i: b for i, b in (await self._others(scope)).items() if b is not None})
        return merge_metrics(views)


def merge_status(
    own: dict[str, Any], views: list[dict[str, Any]], missing: list[int]
) -> dict[str, Any]:
    """The instance's ``/replication``: ``own``'s fields, counters summed over ``views``."""
    merged = {k: v for k, v in own.items() if k not in ("process", "pid")}
    for name in SUMMED:
        merged[name] = sum(v.get(name) or 0 for v in views)
    for name in SUMMED_BY_KEY:
        if name in merged:
            totals: dict[str, int] = {}
            for view in views:
                for key, count in (view.get(name) or {}).items():
                    totals[key] = totals.get(key, 0) + count
            merged[name] = totals
    not_ready = [v for v in views if not v.get("ready")]
    merged["ready"] = not not_ready and not missing
    merged["not_ready_reason"] = (
        not_ready[0].get("not_ready_reason") if not_ready
        else f"process {missing[0]} not answering" if missing
        else None
    )  # fmt: skip
    reasons = [r for v in views for r in v.get("degraded_reasons") or []]
    reasons += [f"process {i} not answering" for i in missing]
    merged["degraded_reasons"] = list(dict.fromkeys(reasons))
    merged["degraded"] = bool(reasons)
    merged["connected"] = all(v.get("connected") is not False for v in views)
    merged["processes"] = views
    merged["processes_missing"] = missing
    return merged


class _Families:
    """A collector yielding fixed metric families."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_metrics(views: dict[int, bytes]) -> bytes:
    """Prometheus text of several processes as one exposition, each series labelled with its
    process's ``process`` index."""
    families: dict[str, Metric] = {}
    for index, text in sorted(views.items()):
        for family in text_string_to_metric_families(text.decode()):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                labels = {**sample.labels, "process": str(index)}
                merged.samples.append(sample._replace(labels=labels))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))
    return generate_latest(registry)


async def fetch(path: str, route: str, auth: list[bytes]) -> tuple[int, bytes] | None:
    """``GET route`` from the process serving on the Unix socket ``path``, asking for its own
    view; (status, body), or None when it does not answer in time."""
    request = [f"GET {route} HTTP/1.1", "host: process", "connection: close",
               f"{LOCAL_HEADER.decode()}: 1"]  # fmt: skip
    request += [f"authorization: {value.decode('latin-1')}" for value in auth]
    try:
        async with asyncio.timeout(SIBLING_TIMEOUT_S):
            reader, writer = await asyncio.open_unix_connection(path)
            try:
                writer.write(("\r\n".join(request) + "\r\n\r\n").encode("latin-1"))
                data = await reader.read()
            finally:
                writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
    except (OSError, TimeoutError, ValueError, IndexError):
        return None
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    return status, body


def _dechunk(body: bytes) -> bytes:
    out = bytearray()
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return bytes(out)


async def _capture(app: ASGIApp, scope: Scope, receive: Receive) -> Response:
    """Run ``kv_slot_tracker`` for ``scope``; its whole answer."""
    started: dict[str, Any] = {}
    chunks: list[bytes] = []

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            started.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return started.get("status", 500), list(started.get("headers", [])), b"".join(chunks)


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
