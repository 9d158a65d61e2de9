"""Every response schema of the OpenAPI document has examples, every example validates against
its schema, and the examples are real answers: a scenario (the README's round trip, then the
selection API's) is run through the ASGI app and each example must be one of the answers it
got for that schema.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import httpx
import jsonschema
import pytest

from kv_slot_tracker.main import create_app
from kv_slot_tracker.openapi_export import export_settings
from kv_slot_tracker.settings import load_settings

REF = "#/components/schemas/"


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return create_app(export_settings()).openapi()


def response_schema_names(doc: dict[str, Any]) -> set[str]:
    """The component schemas a JSON response is made of: the body itself, the items of an
    array body, the values of an object body."""
    names = set()
    for item in doc["paths"].values():
        for op in item.values():
            for response in op["responses"].values():
                media = response.get("content", {}).get("application/json")
                if media is None:
                    continue
                schema = media["schema"]
                schema = schema.get("items") or schema.get("additionalProperties") or schema
                assert "$ref" in schema, (op["operationId"], schema)
                names.add(schema["$ref"].removeprefix(REF))
    return names


def validator(doc: dict[str, Any], name: str) -> jsonschema.Draft202012Validator:
    """A validator of the component ``name`` that resolves ``#/components/schemas/...``."""
    schema = {"$ref": REF + name, "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


def test_every_response_schema_has_examples(document: dict[str, Any]) -> None:
    names = response_schema_names(document)
    assert len(names) >= 21  # every schema a route answers with, errors included
    schemas = document["components"]["schemas"]
    lacking = sorted(n for n in names if not schemas[n].get("examples"))
    assert lacking == []


def test_every_example_validates_against_its_schema(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    checked = 0
    for name, schema in sorted(schemas.items()):
        for example in schema.get("examples", []):
            errors = [e.message for e in validator(document, name).iter_errors(example)]
            assert errors == [], (name, example)
            checked += 1
    # the error bodies documented per status, too
    for item in document["paths"].values():
        for op in item.values():
            for response in op["responses"].values():
                media = response.get("content", {}).get("application/json", {})
                if "example" in media:
                    name = media["schema"]["$ref"].removeprefix(REF)
                    validator(document, name).validate(media["example"])
                    checked += 1
    assert checked > 40


def test_the_validation_refuses_a_wrong_example(document: dict[str, Any]) -> None:
    row = copy.deepcopy(document["components"]["schemas"]["LoadRow"]["examples"][0])
    row["worker_id"] = "1"
    assert not validator(document, "LoadRow").is_valid(row)
    del row["worker_id"]
    assert not validator(document, "LoadRow").is_valid(row | {"worker_id": 1, "dp_rank": None})
    record = document["components"]["schemas"]["WorkerRecord"]["examples"][0]
    assert not validator(document, "WorkerRecord").is_valid({**record, "lifecycle": 3})


async def scenario() -> dict[str, list[Any]]:
    """The answers of a scenario, per response schema (a row of an array answer counts alone).
    Embedded, approximate cache, seed 0: every answer but ``/replication`` is deterministic."""
    answers: dict[str, list[Any]] = defaultdict(list)
    app = create_app(load_settings(router_use_kv_events=False, selection_seed=0))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

            async def call(schema: str, status: int, method: str, path: str, body=None) -> Any:
                r = await client.request(method, path, json=body)
                assert r.status_code == status, (path, r.text)
                got = r.json()
                if isinstance(got, list):
                    answers[schema].extend(got)
                elif schema == "PartitionDump":
                    answers[schema].extend(got.values())
                else:
                    answers[schema].append(got)
                return got

            llama = {"model_name": "llama"}
            worker = {**llama, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 2}
            await call("StatusOk", 201, "POST", "/register", worker)
            r1 = {**llama, "request_id": "r1", "worker_id": 1, "dp_rank": 0}
            r1 |= {"sequence_hashes": [1, 2, 3], "new_isl_tokens": 48}
            await call("StatusOk", 201, "POST", "/add", r1)
            await call("LoadRow", 200, "GET", "/loads?model_name=llama")
            prompt = {**llama, "sequence_hashes": [1, 2, 4]}
            await call("PotentialLoadRow", 200, "POST", "/potential_loads",
                       prompt | {"new_isl_tokens": 48})  # fmt: skip
            await call("ProjectedLoadRow", 200, "POST", "/project_loads", prompt)
            await call("WorkerRow", 200, "GET", "/workers")
            r2 = {**llama, "request_id": "r2", "worker_id": 1, "dp_rank": 1}
            r2 |= {"sequence_hashes": [5], "lora_name": "sql-adapter"}
            await call("StatusOk", 201, "POST", "/add", r2)
            await call("LoraCounts", 200, "GET", "/lora_counts?model_name=llama")
            r3 = {**llama, "request_id": "r3"}
            operations = [
                {"op": "add", **r3, "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1, 2]},
                {"op": "free", **r3},
                {"op": "prefill_complete", **llama, "request_id": "r9"},
            ]
            await call("BatchResponse", 200, "POST", "/batch", {"operations": operations})
            await call("ErrorBody", 404, "POST", "/prefill_complete", {**llama, "request_id": "r9"})
            workers = [
                {"worker_id": 1, "dp_start": 0, "dp_size": 1},
                {"worker_id": 2, "dp_start": 0, "dp_size": 2},
            ]
            reconcile = {**llama, "block_size": 16, "workers": workers}
            await call("ReconcileResult", 200, "POST", "/reconcile", reconcile)
            await call("ReadyBody", 200, "GET", "/ready")
            await call("ReplicationStatus", 200, "GET", "/replication")

            sel = "/selection"
            qwen = {"model_name": "qwen"}
            await call("SelectionStatus", 200, "GET", sel + "/health")
            await call("SelectionReady", 503, "GET", sel + "/ready")
            w7 = {**qwen, "worker_id": 7, "endpoint": "http://w7:8000", "block_size": 16}
            await call(
                "WorkerRecord", 201, "POST", sel + "/workers", w7 | {"data_parallel_size": 2}
            )
            await call("SelectionReady", 200, "GET", sel + "/ready")
            w8 = {**qwen, "worker_id": 8, "block_size": 16}
            await call("WorkerRecord", 201, "POST", sel + "/workers", w8)
            await call(
                "WorkerRecord", 200, "PATCH", sel + "/workers/8", {"endpoint": "http://w8:8000"}
            )
            tokens = {**qwen, "token_ids": list(range(1, 34))}
            await call("SelectResponse", 200, "POST", sel + "/select",
                       tokens | {"selection_id": "req-1"})  # fmt: skip
            await call("ReservationResponse", 201, "POST", sel + "/reservations",
                       {**qwen, "selection_id": "req-1"})  # fmt: skip
            await call("SelectAndReserveResponse", 200, "POST", sel + "/select_and_reserve",
                       tokens | {"selection_id": "req-2"})  # fmt: skip
            reservation = sel + "/reservations/req-1"
            await call("SelectionStatus", 200, "POST", reservation + "/prefill_complete")
            await call("SelectionStatus", 200, "POST", reservation + "/output_block",
                       {"decay_fraction": 0.5})  # fmt: skip
            await call("PartitionLoads", 200, "GET", sel + "/loads?model_name=qwen")
            await call("RankLoad", 200, "POST", sel + "/potential_loads", tokens)
            await call("OverlapScoresResponse", 200, "POST", sel + "/overlap_scores", tokens)
            await call("PartitionDump", 200, "GET", sel + "/dump")
            await call("SelectionStatus", 200, "DELETE", reservation)
            await call("RoutingReceipt", 200, "GET", sel + "/receipts/req-1")
            await call("ReceiptList", 200, "GET", sel + "/receipts?limit=1")
            await call("RoutingReceipt", 200, "POST", sel + "/explain", tokens)
            await call("WorkerRecord", 200, "DELETE", sel + "/workers/8")
    return answers


async def not_ready_answers() -> tuple[dict[str, Any], dict[str, Any]]:
    """``/ready`` and ``/replication`` of an instance whose Redis does not answer."""
    app = create_app(load_settings(redis_url="redis://127.0.0.1:1/0", router_use_kv_events=False))
    async with app.router.lifespan_context(app):
        await app.state.replication.settled(10)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            ready = await client.get("/ready")
            assert ready.status_code == 503
            return ready.json(), (await client.get("/replication")).json()


async def test_the_examples_are_real_answers(document: dict[str, Any]) -> None:
    answers = await scenario()
    schemas = document["components"]["schemas"]
    assert set(answers) == response_schema_names(document)
    not_ready, replication = await not_ready_answers()
    for name in sorted(answers):
        for example in schemas[name]["examples"]:
            if name == "ReplicationStatus":  # a Redis instance's answer: ids and counters vary
                assert sorted(example) == sorted(answers[name][0]) == sorted(replication)
                assert example["mode"] == replication["mode"] == "redis"
            elif name == "ReadyBody" and example["status"] == "not_ready":
                assert sorted(example) == sorted(not_ready) and not_ready["status"] == "not_ready"
                assert example["reason"].split(":")[0] == not_ready["reason"].split(":")[0]
            elif name in RECEIPTS:  # times and the instance's name vary
                assert masked(example) in [masked(a) for a in answers[name]], (name, example)
            else:
                assert example in answers[name], (name, example)


RECEIPTS = ("RoutingReceipt", "ReceiptList")
VARYING = {"time", "instance", "booked_at", "prefill_done_at", "freed_at", "prefill_seconds"}


def masked(value: Any) -> Any:
    """A receipt answer without the fields that vary from run to run, and without nulls (the
    document's examples leave them out)."""
    if isinstance(value, dict):
        return {k: masked(v) for k, v in value.items() if k not in VARYING and v is not None}
    if isinstance(value, list):
        return [masked(v) for v in value]
    return value


async def test_an_unknown_model_has_no_loads_and_workers_lists_the_known_ones(
    document: dict[str, Any],
) -> None:
    """As in the reference, ``/loads`` of a model nobody registered is ``200 []``; the
    document says so and points at ``/workers``, which lists the trackers there are."""
    description = document["paths"]["/loads"]["get"]["description"]
    assert "[]" in description and "/workers" in description
    app = create_app(load_settings())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"model_name": "llama", "worker_id": 1, "block_size": 16, "dp_start": 0,
                    "dp_size": 1}  # fmt: skip
            assert (await client.post("/register", json=body)).status_code == 201
            unknown = await client.get("/loads", params={"model_name": "lama"})
            assert (unknown.status_code, unknown.json()) == (200, [])
            known = (await client.get("/workers")).json()
            assert {(w["model_name"], w["routing_group"]) for w in known} == {("llama", "default")}
