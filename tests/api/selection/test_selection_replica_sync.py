"""Dynamo's replica-sync peer routes (``/replica_sync/*`` of the slot tracker, and under
``/selection`` of the selection service): answered as Dynamo answers without replica sync, since
instances share their state through Redis here. The body is checked first; nothing changes."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.api.conftest import post_json

PREFIXES = ["", "/selection"]
EMBEDDED_409 = (
    "replica sync is disabled: this instance runs alone; instances share their state through "
    "Redis (redis_url), not a ZMQ mesh"
)
PEER = {"endpoint": "tcp://selector-b:9092"}


@pytest.mark.parametrize("prefix", PREFIXES)
async def test_peers_are_none_and_changes_are_409(client: httpx.AsyncClient, prefix: str) -> None:
    peers = await client.get(f"{prefix}/replica_sync/peers")
    assert (peers.status_code, peers.json()) == (200, [])
    for call in ("register_peer", "deregister_peer"):
        resp = await post_json(client, f"{prefix}/replica_sync/{call}", PEER)
        assert (resp.status_code, resp.json()) == (409, {"error": EMBEDDED_409})
        assert resp.headers["content-type"] == "application/json"
    # nothing changed: still no peer, and the rest of the service is untouched
    assert (await client.get(f"{prefix}/replica_sync/peers")).json() == []
    assert (await client.get("/workers")).json() == []


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize(
    ("body", "headers", "status", "start"),
    [
        (b'{"url": "tcp://a:1"}', None, 422, "Failed to deserialize the JSON body into the target type: "),
        (b'{"endpoint": 5}', None, 422, "Failed to deserialize the JSON body into the target type: "),
        (b'{"endpoint": ', None, 400, "Failed to parse the request body as JSON: "),
        (b"", None, 400, "Failed to parse the request body as JSON: "),
        (b'{"endpoint": "tcp://a:1"}', {"content-type": "text/plain"}, 415, "Expected request with `Content-Type: application/json`"),
        (b'{"endpoint": "' + b"x" * 2_100_000 + b'"}', None, 413, "Failed to buffer the request body: length limit exceeded"),
    ],
)  # fmt: skip
async def test_a_body_that_is_no_peer_is_refused_first(
    client: httpx.AsyncClient,
    prefix: str,
    body: bytes,
    headers: dict[str, str] | None,
    status: int,
    start: str,
) -> None:
    for call in ("register_peer", "deregister_peer"):
        resp = await client.post(
            f"{prefix}/replica_sync/{call}",
            content=body,
            headers=headers or {"content-type": "application/json"},
        )
        assert resp.status_code == status, resp.text
        assert resp.json()["error"].startswith(start)


@pytest.mark.parametrize("prefix", PREFIXES)
async def test_wrong_methods_and_paths(client: httpx.AsyncClient, prefix: str) -> None:
    wrong = await client.get(f"{prefix}/replica_sync/register_peer")
    assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
    posted = await post_json(client, f"{prefix}/replica_sync/peers", PEER)
    assert (posted.status_code, posted.headers["allow"]) == (405, "GET, HEAD")
    for path in ("/replica_sync", "/replica_sync/peer", "/register_peer"):
        missing = await client.get(prefix + path)
        assert (missing.status_code, missing.json()) == (404, {"error": "route not found"})


async def test_with_redis_the_answer_says_where_the_state_is_shared(
    make_client: Callable[..., Any], redis_url: str
) -> None:
    namespace = f"test-replica-sync-{uuid.uuid4().hex}"
    async with make_client(redis_url=redis_url, namespace=namespace) as (_, client):
        resp = await post_json(client, "/replica_sync/register_peer", PEER)
        assert (resp.status_code, resp.json()) == (
            409,
            {
                "error": "replica sync is disabled: instances share their state through Redis "
                "(redis_url), see GET /replication, not a ZMQ mesh"
            },
        )
        assert (await client.get("/selection/replica_sync/peers")).json() == []


async def test_the_key_guards_them(make_client: Callable[..., Any]) -> None:
    async with make_client(api_key="k-1") as (_, client):
        assert (await client.get("/replica_sync/peers")).status_code == 401
        key = {"authorization": "Bearer k-1"}
        assert (await client.get("/replica_sync/peers", headers=key)).json() == []
        assert (await post_json(client, "/replica_sync/register_peer", PEER)).status_code == 401
