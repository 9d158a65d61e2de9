"""The client against the service's own OpenAPI document: it calls every documented route, and
its result models have the fields, types and required set of the service's response schemas."""

from __future__ import annotations

import inspect
from typing import Any

import httpx
import kv_slot_tracker_client as client_pkg
import pytest
from kv_slot_tracker_client import (
    AsyncSlotTrackerClient,
    ServerError,
    SlotTrackerClient,
    models,
)
from pydantic import BaseModel

from app.main import create_app
from app.settings import load_settings

# One call per public client method, with arguments that make a well-formed request.
CALLS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "register": ((1, "m", 4), {}),
    "upsert": ((1, "m", 4), {}),
    "unregister": ((1, "m"), {}),
    "reconcile": (("m", 4, [(1, 0, 1)]), {}),
    "workers": ((), {}),
    "add": (("m", "r", 1, 0, [1]), {}),
    "prefill_complete": (("m", "r"), {}),
    "free": (("m", "r"), {}),
    "output_block": (("m", "r"), {}),
    "batch": (([],), {}),
    "loads": ((), {}),
    "potential_loads": (("m", [1]), {}),
    "project_loads": (("m", [1]), {}),
    "lora_counts": (("m",), {}),
    "health": ((), {}),
    "ready": ((), {}),
    "readiness": ((), {}),
    "replication_status": ((), {}),
    "metrics": ((), {}),
    "openapi": ((), {}),
    "request": (("DELETE", "/anything"), {}),
}
# Not API routes of the service: the OpenAPI document itself and the generic escape hatch.
NOT_DOCUMENTED = {("GET", "/openapi.json"), ("DELETE", "/anything")}


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    return create_app(load_settings()).openapi()


def public_methods(cls: type) -> set[str]:
    return {
        name
        for name, fn in vars(cls).items()
        if inspect.isfunction(fn) and not name.startswith("_") and name not in ("close", "aclose")
    }


class Failing:
    """Records each request and answers 500, so every method sends exactly one request."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str, bytes]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(
            (request.method, request.url.path, request.url.query.decode(), request.content)
        )
        return httpx.Response(500, json={"error": "recorded"})

    @property
    def routes(self) -> set[tuple[str, str]]:
        return {(method, path) for method, path, _, _ in self.sent}


def call_every_method(failing: Failing) -> int:
    """Call every method of the blocking client once; returns how many raised ``ServerError``."""
    raised = 0
    with SlotTrackerClient("http://tracker", transport=httpx.MockTransport(failing)) as c:
        for name, (args, kwargs) in CALLS.items():
            try:
                getattr(c, name)(*args, **kwargs)
            except ServerError as err:
                assert err.status == 500
                raised += 1
    return raised


def test_the_table_names_every_method() -> None:
    assert set(CALLS) == public_methods(SlotTrackerClient) == public_methods(AsyncSlotTrackerClient)


def test_every_documented_route_is_called(openapi: dict[str, Any]) -> None:
    documented = {
        (method.upper(), path) for path, item in openapi["paths"].items() for method in item
    }
    assert len(documented) == 18
    failing = Failing()
    raised = call_every_method(failing)
    assert raised == len(CALLS) - 2  # the probes health() and ready() answer False instead
    assert len(failing.sent) == len(CALLS)  # one request per method
    assert failing.routes - NOT_DOCUMENTED == documented


async def test_async_client_sends_the_same_requests() -> None:
    blocking, awaiting = Failing(), Failing()
    call_every_method(blocking)
    raised = 0
    transport = httpx.MockTransport(awaiting)
    async with AsyncSlotTrackerClient("http://tracker", transport=transport) as c:
        for name, (args, kwargs) in CALLS.items():
            try:
                await getattr(c, name)(*args, **kwargs)
            except ServerError:
                raised += 1
    assert raised == len(CALLS) - 2
    assert awaiting.sent == blocking.sent  # same methods, paths, queries and bodies, in order


def _comparable(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema without its prose (titles, descriptions) and defaults (the service's document
    omits those of its answers), and with references by name."""
    if isinstance(schema, dict):
        return {
            k: (v.rsplit("/", 1)[-1] if k == "$ref" else _comparable(v))
            for k, v in schema.items()
            if k not in ("title", "description", "default")
        }
    if isinstance(schema, list):
        return [_comparable(v) for v in schema]
    return schema


@pytest.mark.parametrize("name", models.__all__)
def test_result_models_match_the_service_schemas(name: str, openapi: dict[str, Any]) -> None:
    model: type[BaseModel] = getattr(models, name)
    ours = model.model_json_schema(
        ref_template="#/components/schemas/{model}", mode="serialization"
    )
    theirs = openapi["components"]["schemas"][name]
    assert _comparable(ours.get("properties")) == _comparable(theirs.get("properties"))
    assert sorted(ours.get("required", [])) == sorted(theirs.get("required", []))


def test_every_result_model_is_exported() -> None:
    assert set(models.__all__) - {"BatchResponse"} <= set(client_pkg.__all__)
