"""Bearer-key protection (``api_key`` setting).

With a key configured every route answers 401 ``{"error": ...}`` without the right
``Authorization: Bearer <key>`` header, except the probes and the documentation: /health, /ready,
/metrics, /docs, /openapi.json (and the static pages /redoc, /docs/oauth2-redirect, /dashboard
and the docs' assets under /docs/assets/, which carry no data). The key never appears in logs, in the OpenAPI document or in any answer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.routing import BaseRoute

from kv_slot_tracker.config_sources import DEFAULT_CONFIG_FILE
from kv_slot_tracker.http.auth import OPEN_PATHS
from kv_slot_tracker.http.docs import DOCS_ASSETS
from kv_slot_tracker.settings import load_settings
from tests.api.conftest import post_json

KEY = "s3cret"
RIGHT = {"authorization": f"Bearer {KEY}"}
UNAUTHORIZED = {"error": "missing or invalid bearer key"}

# open by requirement: probes, metrics and the API description
REQUIRED_OPEN = {
    "/health",
    "/ready",
    "/metrics",
    "/docs",
    "/openapi.json",
    "/selection/health",
    "/selection/ready",
}
# open as well: static pages without data (they call the API with the key the user gives)
STATIC_OPEN = {"/redoc", "/docs/oauth2-redirect", "/dashboard"}
ANCHOR_ROUTES = {
    ("POST", "/register"),
    ("POST", "/unregister"),
    ("GET", "/workers"),
    ("POST", "/add"),
    ("POST", "/prefill_complete"),
    ("POST", "/free"),
    ("GET", "/loads"),
    ("POST", "/potential_loads"),
}

WRONG_HEADERS: list[dict[str, str]] = [
    {},
    {"authorization": ""},
    {"authorization": "Bearer"},
    {"authorization": "Bearer "},
    {"authorization": "Bearer wrong"},
    {"authorization": f"Bearer {KEY}x"},
    {"authorization": f"Bearer {KEY[:-1]}"},
    {"authorization": f"Bearer {KEY.upper()}"},
    {"authorization": f"Bearer  {KEY}"},
    {"authorization": f"Bearer {KEY} "},
    {"authorization": KEY},
    {"authorization": f"Basic {KEY}"},
    {"authorization": "Basic czNjcmV0OnMzY3JldA=="},
    {"authorization": f"Token {KEY}"},
    {"authorization": f"Bearer:{KEY}"},
    {"x-api-key": KEY},
    {"authorization-bearer": KEY},
    {"cookie": f"api_key={KEY}"},
]


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"api_key": KEY}


def flat_routes(routes: list[BaseRoute]) -> Iterator[BaseRoute]:
    """Every route, including those of included routers."""
    for route in routes:
        sub = getattr(route, "original_router", None)
        if sub is not None:
            yield from flat_routes(sub.routes)
        else:
            yield route


def app_routes(app: FastAPI) -> set[tuple[str, str]]:
    out = set()
    for route in flat_routes(app.routes):
        path = getattr(route, "path", None)
        for method in getattr(route, "methods", None) or ():
            if path is not None and method != "HEAD":
                out.add((method, path))
    return out


def protected_routes(app: FastAPI) -> list[tuple[str, str]]:
    return sorted(
        (m, p) for m, p in app_routes(app) if p not in OPEN_PATHS and not p.startswith(DOCS_ASSETS)
    )


def assert_unauthorized(resp: httpx.Response) -> None:
    assert resp.status_code == 401, (resp.request.method, resp.request.url, resp.text)
    assert resp.json() == UNAUTHORIZED
    assert resp.headers["content-type"] == "application/json"
    assert resp.headers["www-authenticate"] == "Bearer"


# -- which routes are open ---------------------------------------------------------------------


def test_open_paths_are_only_probes_docs_and_static_pages() -> None:
    assert REQUIRED_OPEN <= OPEN_PATHS
    assert OPEN_PATHS <= REQUIRED_OPEN | STATIC_OPEN


async def test_every_other_route_is_protected(app: FastAPI) -> None:
    protected = set(protected_routes(app))
    assert protected >= ANCHOR_ROUTES
    assert {p for _, p in protected}.isdisjoint(REQUIRED_OPEN | STATIC_OPEN)


async def test_open_routes_need_no_key(client: httpx.AsyncClient) -> None:
    resp = await client.get("/health")
    assert (resp.status_code, resp.content) == (200, b"")
    resp = await client.get("/ready")
    assert resp.status_code == 200
    assert resp.json()["status"] == "ready"
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    resp = await client.get("/openapi.json")
    assert resp.status_code == 200
    assert resp.json()["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"}
    }
    for path in ["/docs", "/redoc", "/dashboard"]:
        resp = await client.get(path)
        assert resp.status_code == 200, path
        assert resp.headers["content-type"].startswith("text/html")
    # open paths stay open with a wrong key too
    for path in ["/health", "/ready", "/metrics", "/openapi.json", "/docs"]:
        resp = await client.get(path, headers={"authorization": "Bearer wrong"})
        assert resp.status_code == 200, path


# -- 401 without the right key -----------------------------------------------------------------


@pytest.mark.parametrize("headers", WRONG_HEADERS, ids=[json.dumps(h) for h in WRONG_HEADERS])
async def test_protected_routes_answer_401(
    app: FastAPI, client: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    for method, path in protected_routes(app):
        body = b'{"worker_id":1,"model_name":"m","block_size":4,"dp_start":0,"dp_size":1}'
        resp = await client.request(
            method,
            path,
            content=body if method == "POST" else None,
            headers={**headers, "content-type": "application/json"},
        )
        assert_unauthorized(resp)
    # nothing was registered by the rejected calls
    assert (await client.get("/workers", headers=RIGHT)).json() == []


async def test_unknown_routes_and_methods_answer_401_first(client: httpx.AsyncClient) -> None:
    """Without the key nothing is revealed, not even which routes exist."""
    for method, path in [
        ("GET", "/nonexistent"),
        ("GET", "/replica_sync/peers"),
        ("GET", "/add"),
        ("DELETE", "/free"),
        ("GET", "/health/"),
        ("GET", "/workers?model_name=a&model_name=b"),
    ]:
        assert_unauthorized(await client.request(method, path))


async def test_key_in_query_string_is_not_accepted(client: httpx.AsyncClient) -> None:
    for query in [f"key={KEY}", f"api_key={KEY}", f"access_token={KEY}"]:
        assert_unauthorized(await client.get(f"/workers?{query}"))


async def test_head_without_key_is_401_without_body(client: httpx.AsyncClient) -> None:
    resp = await client.head("/workers")
    assert (resp.status_code, resp.content) == (401, b"")
    resp = await client.head("/workers", headers=RIGHT)
    assert (resp.status_code, resp.content) == (200, b"")
    resp = await client.head("/health")
    assert (resp.status_code, resp.content) == (200, b"")


# -- the right key works -----------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
async def test_the_right_key_works(client: httpx.AsyncClient, scheme: str) -> None:
    """The anchor routes with their usual answers; the scheme name is case-insensitive."""
    h = {"authorization": f"{scheme} {KEY}"}
    reg = {"worker_id": 1, "model_name": "m", "block_size": 4, "dp_start": 0, "dp_size": 1}
    add = {
        "model_name": "m",
        "request_id": "r1",
        "worker_id": 1,
        "dp_rank": 0,
        "sequence_hashes": [1, 2],
        "new_isl_tokens": 8,
    }
    r1 = {"model_name": "m", "request_id": "r1"}
    steps: list[tuple[str, str, Any, int, Any]] = [
        ("POST", "/register", reg, 201, {"status": "ok"}),
        ("GET", "/workers", None, 200, [{**reg, "routing_group": "default"}]),
        ("POST", "/add", add, 201, {"status": "ok"}),
        (
            "POST",
            "/potential_loads",
            {"model_name": "m", "sequence_hashes": [1, 3], "new_isl_tokens": 2},
            200,
            [
                {
                    "worker_id": 1,
                    "dp_rank": 0,
                    "potential_prefill_tokens": 10,
                    "potential_decode_blocks": 3,
                    "active_requests": 1,
                }
            ],
        ),
        ("POST", "/prefill_complete", r1, 200, {"status": "ok"}),
        ("POST", "/free", r1, 200, {"status": "ok"}),
        ("POST", "/unregister", {"worker_id": 1, "model_name": "m"}, 200, {"status": "ok"}),
        ("GET", "/loads", None, 200, []),
    ]
    for method, path, body, status, expected in steps:
        if method == "POST":
            resp = await post_json(client, path, body, headers=h)
        else:
            resp = await client.get(path, headers=h)
        assert (resp.status_code, resp.json()) == (status, expected), (path, resp.text)


async def test_the_right_key_opens_every_protected_route(
    app: FastAPI, client: httpx.AsyncClient
) -> None:
    for method, path in protected_routes(app):
        resp = await client.request(
            method,
            path,
            content=b"{}" if method == "POST" else None,
            headers={**RIGHT, "content-type": "application/json"},
        )
        assert resp.status_code != 401, (method, path, resp.text)
        # the selection API answers 503 while no worker is schedulable, as the reference does
        no_worker = path.startswith("/selection/") and resp.status_code == 503
        assert resp.status_code < 500 or no_worker, (method, path, resp.text)


# -- the key never leaks -----------------------------------------------------------------------


async def test_key_never_appears_in_logs_docs_or_answers(
    make_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    seen: list[bytes] = []
    async with make_client(api_key=KEY, log_level="debug") as (app, client):
        for headers in [{}, {"authorization": "Bearer wrong"}, RIGHT]:
            for method, path in protected_routes(app):
                resp = await client.request(
                    method,
                    path,
                    content=b'{"model_name":"m"}' if method == "POST" else None,
                    headers={**headers, "content-type": "application/json"},
                )
                seen.append(resp.content)
                seen.extend(v.encode() for v in resp.headers.values())
        for path in sorted(OPEN_PATHS):
            resp = await client.get(path, headers=RIGHT)
            seen.append(resp.content)
            seen.extend(v.encode() for v in resp.headers.values())
        doc = await client.get("/openapi.json")
        assert doc.status_code == 200
        assert KEY not in doc.text
        assert KEY not in json.dumps(app.openapi())
    for chunk in seen:
        assert KEY.encode() not in chunk
    assert KEY not in caplog.text
    for record in caplog.records:
        assert KEY not in record.getMessage()
        assert KEY not in repr(record.args)


def test_key_is_hidden_in_the_settings() -> None:
    settings = load_settings(api_key=KEY)
    assert settings.api_key.get_secret_value() == KEY
    for text in [repr(settings), str(settings), str(settings.model_dump())]:
        assert KEY not in text
    assert KEY not in settings.model_dump_json()


async def test_selection_ready_without_the_key_tells_readiness_only(
    client: httpx.AsyncClient,
) -> None:
    worker = {"worker_id": 5, "endpoint": "http://10.0.0.5:8000", "block_size": 4,
              "kv_events_endpoint": "tcp://10.0.0.5:5557"}  # fmt: skip
    r = await post_json(client, "/selection/workers", worker, headers=RIGHT)
    assert r.status_code == 201
    for headers in ({}, {"authorization": "Bearer wrong"}):
        r = await client.get("/selection/ready", headers=headers)
        assert (r.status_code, r.json()) == (200, {"ready": True, "schedulable_workers": 1})
        assert r.headers["content-length"] == str(len(r.content))
        assert b"10.0.0.5" not in r.content
    r = await client.get("/selection/ready", headers=RIGHT)
    assert r.status_code == 200
    assert [w["endpoint"] for w in r.json()["workers"]] == ["http://10.0.0.5:8000"]
    await client.delete("/selection/workers/5", headers=RIGHT)
    r = await client.get("/selection/ready")
    assert (r.status_code, r.json()) == (503, {"ready": False, "schedulable_workers": 0})


async def test_metrics_behind_the_key_when_asked(make_client: Any) -> None:
    async with make_client(api_key=KEY, metrics_require_key=True) as (app, client):
        r = await client.get("/metrics")
        assert (r.status_code, r.json()) == (401, UNAUTHORIZED)
        assert (await client.get("/metrics", headers=RIGHT)).status_code == 200
        assert (await client.get("/health")).status_code == 200
        doc = (await client.get("/openapi.json")).json()
        assert "security" not in doc["paths"]["/metrics"]["get"]  # the document's default: key
        assert doc["paths"]["/health"]["get"]["security"] == []


def test_the_config_file_names_the_open_routes() -> None:
    text = DEFAULT_CONFIG_FILE.read_text(encoding="utf-8")
    for path in OPEN_PATHS - {"/docs/oauth2-redirect"}:
        assert path in text, path
