"""Fixtures for the HTTP API tests.

Every test gets a fresh application built with ``create_app(load_settings(...), clock=...)``,
run inside its lifespan, and an ``httpx.AsyncClient`` talking to it in-process.

* ``clock``: the ``FakeClock`` the application reads; advance it instead of sleeping.
* ``settings_overrides``: keyword overrides for ``load_settings``; empty by default. Override
  the fixture in a test module (or parametrize it) to build the app with other settings.
* ``kv_slot_tracker`` / ``client``: the running application and a client for it.
* ``make_client``: an async context manager factory for a second, differently configured
  application inside one test: ``async with make_client(api_key="k") as (app, client): ...``.
* ``post_json(client, path, body)``: POST ``body`` serialised as JSON; the ``post`` fixture is
  the same bound to ``client``: ``resp = await post("/register", {...})``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import load_settings
from tests.fakes import FakeClock

BASE_URL = "http://test"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {}


@contextlib.asynccontextmanager
async def running_app(
    clock: FakeClock, **overrides: Any
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """Build an app with ``load_settings(**overrides)``, run its lifespan, yield it and a client."""
    app = create_app(load_settings(**overrides), clock=clock.now)
    async with app.router.lifespan_context(app):
        await app.state.replication.settled(10)  # what a probe of /ready would wait for
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
            yield app, client


@pytest.fixture
def make_client(
    clock: FakeClock,
) -> Callable[..., contextlib.AbstractAsyncContextManager[tuple[FastAPI, httpx.AsyncClient]]]:
    def factory(**overrides: Any):
        return running_app(clock, **overrides)

    return factory


@pytest.fixture
async def _running(
    clock: FakeClock, settings_overrides: dict[str, Any]
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    async with running_app(clock, **settings_overrides) as pair:
        yield pair


@pytest.fixture
def app(_running: tuple[FastAPI, httpx.AsyncClient]) -> FastAPI:
    return _running[0]


@pytest.fixture
def client(_running: tuple[FastAPI, httpx.AsyncClient]) -> httpx.AsyncClient:
    return _running[1]


async def post_json(
    client: httpx.AsyncClient,
    path: str,
    body: Any,
    *,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """POST ``body`` as compact JSON with ``Content-Type: application/json``."""
    all_headers = {"content-type": "application/json"}
    if headers:
        all_headers.update(headers)
    content = json.dumps(body, separators=(",", ":")).encode()
    return await client.post(path, content=content, headers=all_headers)


PostJson = Callable[..., Awaitable[httpx.Response]]


@pytest.fixture
def post(client: httpx.AsyncClient) -> PostJson:
    async def bound(path: str, body: Any, **kwargs: Any) -> httpx.Response:
        return await post_json(client, path, body, **kwargs)

    return bound
