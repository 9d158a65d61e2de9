"""The KV index handed from one instance to another (``indexer_peers``, ``GET /selection/kv_index``).

The serving side is a real app (KV events on; its index filled through the ingest's sink, the
call a listener makes per batch); the loading side is a real app started with ``indexer_peers``.
Between them, a small HTTP server on 127.0.0.1 serves what the first app answered (or a hostile
variant of it), chunked or not, and records the requests: a peer is input like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI

from kv_slot_tracker.core.types import U64_MAX
from kv_slot_tracker.ingest.records import BlocksStored, KvBatch
from tests.api.conftest import running_app
from tests.fakes import FakeClock

BS = 4
TOKENS = list(range(100, 124))  # six blocks
SEL = "/selection"
KEY = "k-123"


class Peer:
    """One HTTP/1.1 answer per connection: ``status`` and ``body`` as given (chunked in
    ``chunk``-byte pieces, or with a Content-Length); the request heads are kept."""

    def __init__(self, body: bytes, status: int = 200, chunk: int | None = 7) -> None:
        self.body, self.status, self.chunk = body, status, chunk
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.requests.append(await reader.readuntil(b"\r\n\r\n"))
        head = f"HTTP/1.1 {self.status} X\r\nContent-Type: application/x-ndjson\r\n"
        if self.chunk is None:
            writer.write(f"{head}Content-Length: {len(self.body)}\r\n\r\n".encode() + self.body)
        else:
            writer.write(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
            for i in range(0, len(self.body), self.chunk):
                piece = self.body[i : i + self.chunk]
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def __aenter__(self) -> Peer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def worker(wid: int, **extra: Any) -> dict[str, Any]:
    return {"worker_id": wid, "endpoint": f"http://w{wid}", "block_size": BS,
            "kv_events_endpoint": "tcp://127.0.0.1:9", **extra}  # fmt: skip


async def register(client: httpx.AsyncClient, *wids: int) -> None:
    for wid in wids:
        r = await client.post(SEL + "/workers", json=worker(wid))
        assert r.json()["lifecycle"] == "schedulable", r.text


async def feed(app: FastAPI, wid: int, seq: int, *events: Any) -> None:
    """One batch applied by the rank's listener, as if its publisher had sent it."""
    await app.state.ingest.reconcile()
    _, listener, _ = app.state.ingest.listeners[wid, 0]
    await listener.apply(KvBatch(seq, 0, tuple(events)))


def store(hashes: list[int], first: int, parent: int | None) -> BlocksStored:
    tokens = tuple(TOKENS[first * BS : (first + len(hashes)) * BS])
    return BlocksStored(tuple(hashes), parent, tokens, BS, 0, None)


async def device_blocks(client: httpx.AsyncClient) -> list[tuple[int, int]]:
    r = await client.post(SEL + "/overlap_scores", json={"token_ids": TOKENS})
    assert r.status_code == 200, r.text
    return sorted((w["worker_id"], w["device_blocks"]) for w in r.json()["workers"])


@contextlib.asynccontextmanager
async def serving_app() -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """An app whose index holds worker 1: blocks 0..3 (seq 0, 1), worker 2: blocks 0..1."""
    async with running_app(FakeClock(), router_use_kv_events=True, api_key=KEY) as (app, client):
        client.headers["Authorization"] = f"Bearer {KEY}"
        await register(client, 1, 2)
        await feed(app, 1, 0, store([11, 12], 0, None))
        await feed(app, 1, 1, store([13, 14], 2, 12))
        await feed(app, 2, 0, store([21, 22], 0, None))
        yield app, client


async def dump_of(client: httpx.AsyncClient) -> bytes:
    r = await client.get(SEL + "/kv_index")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-ndjson"
    return r.content


@contextlib.asynccontextmanager
async def loading_app(*peers: str, **overrides: Any) -> AsyncIterator[FastAPI]:
    """An app with ``indexer_peers``, once its recovery is over; then workers 1 and 2 are
    registered (embedded mode: the catalog is this instance's own, learnt after start) and
    listened to."""
    settings = dict(router_use_kv_events=True, api_key=KEY, indexer_peers=",".join(peers),
                    indexer_peers_timeout_seconds=3)  # fmt: skip
    async with running_app(FakeClock(), **settings | overrides) as (app, client):
        client.headers["Authorization"] = f"Bearer {KEY}"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while app.state.index_peers.recovering:
            assert loop.time() < deadline, "recovery did not end"
            r = await client.get(SEL + "/ready")
            assert r.status_code == 503 and r.json()["kv_events"]["recovering"] is True
            await asyncio.sleep(0.01)
        await register(client, 1, 2)
        await app.state.ingest.reconcile()  # what the ingest's next poll does
        app.state.test_client = client
        yield app


def lines(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in raw.splitlines()]


def unlines(objs: list[Any]) -> bytes:
    return b"".join((o if isinstance(o, bytes) else orjson.dumps(o)) + b"\n" for o in objs)


async def test_the_dump_lists_every_rank_with_its_sequence_number() -> None:
    async with serving_app() as (app, client):
        got = lines(await dump_of(client))
    assert got[0] == {"kind": "header", "format": 1}
    assert got[1] == {"kind": "partition", "model_name": "default", "routing_group": "default",
                      "block_size": BS}  # fmt: skip
    ranks = {(x["worker_id"], x["dp_rank"]): x for x in got if x["kind"] == "rank"}
    assert ranks[1, 0]["seq"] == 1 and ranks[2, 0]["seq"] == 0
    assert [b[1:3] for b in ranks[1, 0]["blocks"]] == [[11, None], [12, 11], [13, 12], [14, 13]]
    assert {b[0] for b in ranks[1, 0]["blocks"]} == {0}  # device tier
    assert got[-1] == {"kind": "end", "ranks": 2, "blocks": 6}


async def test_the_dump_needs_the_key_and_is_refused_while_recovering() -> None:
    async with serving_app() as (app, client):
        assert (
            await client.get(SEL + "/kv_index", headers={"Authorization": ""})
        ).status_code == 401
        app.state.index_peers.recovering = True
        r = await client.get(SEL + "/kv_index")
        assert (r.status_code, r.json()) == (
            503,
            {"error": "this instance is still loading its KV index"},
        )
        ready = (await client.get(SEL + "/ready")).json()
        assert ready["ready"] is False and ready["kv_events"]["recovering"] is True
    async with running_app(FakeClock(), router_use_kv_events=False) as (_, off):
        r = await off.get(SEL + "/kv_index")
        assert (r.status_code, r.json()) == (404, {"error": "KV events are off on this instance"})


@pytest.mark.parametrize("chunk", [7, 4096, None])
async def test_an_instance_starts_from_its_peers_index(chunk: int | None) -> None:
    async with serving_app() as (_, client):
        dump = await dump_of(client)
        want = await device_blocks(client)
    assert want == [(1, 4), (2, 2)]
    async with Peer(dump, chunk=chunk) as peer, loading_app(peer.url) as app:
        assert await device_blocks(app.state.test_client) == want
        c = app.state.index_peers.counters.as_dict()
        assert c == {"peer_failures": 0, "ranks": 2, "ranks_skipped": 0, "blocks": 6,
                     "blocks_refused": 0, "malformed": 0}  # fmt: skip
        assert app.state.index_peers.recovered_from == peer.url
        assert peer.requests[0].startswith(b"GET /selection/kv_index HTTP/1.1\r\n")
        assert f"Authorization: Bearer {KEY}".encode() in peer.requests[0]
        # each listener continues from its rank's last batch on the peer
        assert app.state.ingest.watermark((1, 0)) == 1
        assert app.state.ingest.watermark((2, 0)) == 0


async def test_a_hostile_dump_is_counted_and_skipped_never_fatal() -> None:
    async with serving_app() as (_, client):
        good = lines(await dump_of(client))
    part, w1, w2 = good[1], good[2], good[3]
    bad_entries = orjson.dumps(
        {**w2, "blocks": [[7, 1, None, 1], [0, "2**64", None, 1], *w2["blocks"]]}
    ).replace(b'"2**64"', str(1 << 64).encode())  # tier 7, and a hash beyond u64
    hostile = unlines([
        good[0],
        {"kind": "rank", "worker_id": 1, "dp_rank": 0, "seq": 0, "blocks": []},  # before a partition
        {**part, "model_name": "elsewhere"},
        {**w1, "worker_id": 3},  # worker 3 is in another partition here: skipped
        {**part, "block_size": 16},
        w1,  # replaced by the next (a worker is in one partition)
        part,
        w1,
        b"{not json",
        bad_entries,  # two entries out of range; the rest loads
        {**w1, "worker_id": 9},  # worker 9 is not schedulable here
        {**w1, "dp_rank": -1},
        good[-1],
    ])  # fmt: skip
    async with Peer(hostile) as peer, loading_app(peer.url) as app:
        assert await device_blocks(app.state.test_client) == [(1, 4), (2, 2)]
        await register(app.state.test_client, 3)
        await app.state.ingest.reconcile()
        c = app.state.index_peers.counters.as_dict()
        assert c == {"peer_failures": 0, "ranks": 2, "ranks_skipped": 1, "blocks": 6,
                     "blocks_refused": 0, "malformed": 5}  # fmt: skip
        # the partition had malformed parts: its ranks resynchronise from the engines
        assert app.state.ingest.watermark((1, 0)) is None


async def test_a_peer_that_gives_no_whole_dump_is_passed_over() -> None:
    async with serving_app() as (_, client):
        dump = await dump_of(client)
    broken = dump[: dump.rindex(b'{"kind":"end"')]  # broke off before its end line
    async with (
        Peer(b"", status=503) as busy,
        Peer(b"<html>hello</html>\n") as other,
        Peer(broken) as cut,
        Peer(dump) as good,
        loading_app(busy.url, other.url, cut.url, good.url) as app,
    ):
        assert app.state.index_peers.recovered_from == good.url
        assert app.state.index_peers.counters.peer_failures == 3
        assert await device_blocks(app.state.test_client) == [(1, 4), (2, 2)]


class RawPeer(Peer):
    """Answers every connection with exactly ``raw``: not HTTP, or HTTP broken mid-way."""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.requests.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(self.body)
        await writer.drain()
        writer.close()


async def test_a_peer_that_breaks_http_is_passed_over() -> None:
    async with serving_app() as (_, client):
        dump = await dump_of(client)
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with (
        RawPeer(b"SSH-2.0-OpenSSH_9.2\r\n\r\n") as not_http,
        RawPeer(chunked + b"zz\r\nhello\r\n") as bad_chunk_size,
        RawPeer(chunked + b"%x\r\n" % len(dump) + dump[:100]) as cut_mid_chunk,
        RawPeer(b"HTTP/1.1 200 OK\r\nX: " + b"y" * (100 << 10) + b"\r\n\r\n") as huge_head,
        Peer(dump) as good,
        loading_app(not_http.url, bad_chunk_size.url, cut_mid_chunk.url, huge_head.url,
                    good.url) as app,
    ):  # fmt: skip
        assert app.state.index_peers.recovered_from == good.url
        assert app.state.index_peers.counters.peer_failures == 4
        assert await device_blocks(app.state.test_client) == [(1, 4), (2, 2)]


async def test_bounds_and_no_peer_at_all() -> None:
    async with serving_app() as (_, client):
        dump = await dump_of(client)
    too_long = unlines([lines(dump)[0], b"[" + b"1," * (3 << 20) + b"1]", lines(dump)[-1]])
    async with (
        Peer(too_long, chunk=1 << 16) as long_line,
        loading_app(long_line.url, indexer_peers_timeout_seconds=0.3) as app,
    ):
        assert app.state.index_peers.recovered_from is None
        assert app.state.index_peers.counters.peer_failures >= 1
        assert await device_blocks(app.state.test_client) == [(1, 0), (2, 0)]
        ready = (await app.state.test_client.get(SEL + "/ready")).json()
        assert ready["ready"] is True and ready["kv_events"]["recovered_from"] is None


def test_u64_hashes_survive_the_trip() -> None:
    assert orjson.loads(orjson.dumps([U64_MAX]))[0] == U64_MAX
