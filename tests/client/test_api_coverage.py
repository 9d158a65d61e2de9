"""The client against the service's own OpenAPI document: it calls every documented route (the
slot tracker's through the client's methods, the selection API's through ``client.selection``),
and its result models have the fields, types and required set of the service's response
schemas."""

from __future__ import annotations

import inspect
import re
from typing import Any

import httpx
import kv_slot_tracker_client as client_pkg
import pytest
from kv_slot_tracker_client import (
    AsyncSelectionClient,
    AsyncSlotTrackerClient,
    SelectionClient,
    ServerError,
    SlotTrackerClient,
    models,
)
from pydantic import BaseModel

from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import load_settings

# One call per public client method (``selection.x``: method ``x`` of ``client.selection``), with
# arguments that make a well-formed request.
CALLS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "register": ((1, "m", 4), {}),
    "upsert": ((1, "m", 4), {}),
    "unregister": ((1, "m"), {}),
    "heartbeat": ((1, "m"), {}),
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
    "selection.health": ((), {}),
    "selection.ready": ((), {}),
    "selection.readiness": ((), {}),
    "selection.upsert_worker": ((1,), {"endpoint": "http://w1", "block_size": 4}),
    "selection.workers": ((), {}),
    "selection.patch_worker": ((1,), {"data_parallel_size": 2}),
    "selection.delete_worker": ((1,), {}),
    "selection.select": (("m",), {"token_ids": [1, 2, 3, 4]}),
    "selection.select_and_reserve": (("m",), {"token_ids": [1, 2, 3, 4]}),
    "selection.reserve_pending": (("s", "m"), {}),
    "selection.reserve": (("s", 1, 0), {"sequence_hashes": [1], "isl_tokens": 4}),
    "selection.prefill_complete": (("s",), {}),
    "selection.output_block": (("s",), {}),
    "selection.free": (("s",), {}),
    "selection.loads": ((), {}),
    "selection.potential_loads": (("m",), {"token_ids": [1, 2, 3, 4]}),
    "selection.overlap_scores": (("m",), {"token_ids": [1, 2, 3, 4]}),
    "selection.dump": ((), {}),
    "selection.kv_index": ((), {}),
    "selection.receipt": (("s",), {}),
    "selection.receipts": (("m",), {"worker_id": 1, "non_optimal": True, "limit": 5}),
    "selection.explain": (("m",), {"token_ids": [1, 2, 3, 4]}),
}
PROBES = 4  # health() and ready(), of both APIs, answer False instead of raising
# Not API routes of the service: the OpenAPI document itself and the generic escape hatch.
NOT_DOCUMENTED = {("GET", "/openapi.json"), ("DELETE", "/anything")}


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    return create_app(load_settings()).openapi()


def public_methods(cls: type, prefix: str = "") -> set[str]:
    return {
        prefix + name
        for name, fn in vars(cls).items()
        if inspect.isfunction(fn) and not name.startswith("_") and name not in ("close", "aclose")
    }


def method(client: Any, name: str) -> Any:
    """The bound method ``name`` of ``client`` (``selection.x``: of ``client.selection``)."""
    *namespace, attr = name.split(".")
    for part in namespace:
        client = getattr(client, part)
    return getattr(client, attr)


class Failing:
    """Records each request and answers 500, so every method sends exactly one request."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str, bytes]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(
            (request.method, request.url.path, request.url.query.decode(), request.content)
        )
        return httpx.Response(500, json={"error": "recorded"})

    def routes(self, templates: set[tuple[str, str]]) -> set[tuple[str, str]]:
        """The routes called: each sent path as the documented template it matches (a path
        parameter, ``{name}``, matches one non-empty segment), else as it is."""
        patterns = [
            (m, t, re.compile(re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", re.escape(t)) + "$"))
            for m, t in templates
        ]
        out = set()
        for method, path, _, _ in self.sent:
            hits = [t for m, t, p in patterns if m == method and p.match(path)]
            assert len(hits) <= 1, (method, path, hits)
            out.add((method, hits[0] if hits else path))
        return out


def call_every_method(failing: Failing) -> int:
    """Call every method of the blocking client once; returns how many raised ``ServerError``."""
    raised = 0
    with SlotTrackerClient("http://tracker", transport=httpx.MockTransport(failing)) as c:
        for name, (args, kwargs) in CALLS.items():
            try:
                method(c, name)(*args, **kwargs)
            except ServerError as err:
                assert err.status == 500
                raised += 1
    return raised


def test_the_table_names_every_method() -> None:
    sync = public_methods(SlotTrackerClient) | public_methods(SelectionClient, "selection.")
    async_ = public_methods(AsyncSlotTrackerClient) | public_methods(
        AsyncSelectionClient, "selection."
    )
    assert set(CALLS) == sync == async_
    assert len(CALLS) == 22 + 22


def test_every_documented_route_is_called(openapi: dict[str, Any]) -> None:
    documented = {
        (method.upper(), path) for path, item in openapi["paths"].items() for method in item
    }
    assert len(documented) == 39
    failing = Failing()
    raised = call_every_method(failing)
    assert raised == len(CALLS) - PROBES
    assert len(failing.sent) == len(CALLS)  # one request per method
    assert failing.routes(documented) - NOT_DOCUMENTED == documented


async def test_async_client_sends_the_same_requests() -> None:
    blocking, awaiting = Failing(), Failing()
    call_every_method(blocking)
    raised = 0
    transport = httpx.MockTransport(awaiting)
    async with AsyncSlotTrackerClient("http://tracker", transport=transport) as c:
        for name, (args, kwargs) in CALLS.items():
            try:
                await method(c, name)(*args, **kwargs)
            except ServerError:
                raised += 1
    assert raised == len(CALLS) - PROBES
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
