"""The OpenAPI document: the committed ``openapi.yaml`` matches the application, every operation
is documented (summary, request body schema with described fields and a working example), and the
interactive docs render.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kv_slot_tracker.main import create_app
from kv_slot_tracker.openapi_export import export_settings, render, to_yaml
from kv_slot_tracker.settings import load_settings
from tests.api.conftest import post_json

OPENAPI_YAML = Path(__file__).resolve().parents[2] / "openapi.yaml"
HTTP_METHODS = ("get", "put", "post", "delete", "patch", "head", "options")
STALE = "openapi.yaml is out of date with the application: run `make openapi` and commit the result"


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return create_app(export_settings()).openapi()


def operations(doc: dict[str, Any]):
    for path, item in sorted(doc["paths"].items()):
        for method in HTTP_METHODS:
            if method in item:
                yield path, method, item[method]


def resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        ref = schema["$ref"]
        assert ref.startswith("#/components/schemas/"), ref
        schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    return schema


def body_schema(doc: dict[str, Any], op: dict[str, Any]) -> dict[str, Any]:
    return resolve(doc, op["requestBody"]["content"]["application/json"]["schema"])


def body_operations(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """POST operations that take a body (a reservation's `prefill_complete` takes none)."""
    return [
        (path, op)
        for path, method, op in operations(doc)
        if method == "post" and path not in BODYLESS_POSTS
    ]


BODYLESS_POSTS = {"/selection/reservations/{selection_id}/prefill_complete"}
"""POSTs whose body is optional (a reservation's outcome, ``cached_tokens``): documented, not
required."""


# -- the committed file ------------------------------------------------------------------------


def test_openapi_yaml_is_up_to_date() -> None:
    assert OPENAPI_YAML.is_file(), f"{OPENAPI_YAML} is missing: run `make openapi`"
    committed = OPENAPI_YAML.read_text()
    current = render()
    if committed != current:
        diff = "".join(
            list(
                difflib.unified_diff(
                    committed.splitlines(keepends=True),
                    current.splitlines(keepends=True),
                    "openapi.yaml (committed)",
                    "openapi.yaml (from the app)",
                )
            )[:60]
        )
        pytest.fail(f"{STALE}\n{diff}", pytrace=False)


def test_openapi_yaml_equals_the_apps_document() -> None:
    doc = create_app(load_settings(api_key="", redis_url="")).openapi()
    assert yaml.safe_load(OPENAPI_YAML.read_text()) == doc, STALE


def test_export_is_stable_across_builds_and_sorted() -> None:
    first, second = render(), render()
    assert first == second
    top = [line.split(":")[0] for line in first.splitlines() if line and line[0] not in " -"]
    assert top == sorted(top)


def test_export_command_prints_the_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    from kv_slot_tracker.openapi_export import main

    assert main() == 0
    assert capsys.readouterr().out == render()


def test_to_yaml_sorts_keys() -> None:
    assert to_yaml({"b": 1, "a": {"d": 2, "c": 3}}) == "a:\n  c: 3\n  d: 2\nb: 1\n"


# -- completeness --------------------------------------------------------------------------------


def test_every_route_is_documented(document: dict[str, Any]) -> None:
    paths = set(document["paths"])
    for expected in (
        "/health",
        "/ready",
        "/metrics",
        "/replication",
        "/register",
        "/upsert",
        "/unregister",
        "/reconcile",
        "/workers",
        "/add",
        "/prefill_complete",
        "/free",
        "/output_block",
        "/loads",
        "/potential_loads",
        "/project_loads",
        "/lora_counts",
        "/batch",
        "/selection/health",
        "/selection/ready",
        "/selection/workers",
        "/selection/workers/{worker_id}",
        "/selection/select",
        "/selection/select_and_reserve",
        "/selection/reservations",
        "/selection/reservations/{selection_id}",
        "/selection/reservations/{selection_id}/prefill_complete",
        "/selection/reservations/{selection_id}/output_block",
        "/selection/loads",
        "/selection/potential_loads",
        "/selection/overlap_scores",
        "/selection/dump",
    ):
        assert expected in paths


def test_bodyless_posts_document_an_optional_body(document: dict[str, Any]) -> None:
    for path in BODYLESS_POSTS:
        body = document["paths"][path]["post"]["requestBody"]
        assert body["required"] is False, path
        assert (
            "cached_tokens" in body_schema(document, document["paths"][path]["post"])["properties"]
        )
    delete = document["paths"]["/selection/reservations/{selection_id}"]["delete"]
    assert delete["requestBody"]["required"] is False


def test_body_model_names_are_unique() -> None:
    """Body models are published under their class name: two models may not share one."""
    from kv_slot_tracker.http.routes import body_models

    names = [m.__name__ for m in body_models()]
    assert len(names) == len(set(names)), names


def test_every_operation_has_a_summary_and_described_responses(document: dict[str, Any]) -> None:
    for path, method, op in operations(document):
        assert op.get("summary", "").strip(), f"{method.upper()} {path} has no summary"
        assert op.get("responses"), f"{method.upper()} {path} documents no response"
        for code, response in op["responses"].items():
            assert response.get("description", "").strip(), f"{method.upper()} {path} {code}"


def test_every_post_has_a_required_json_body_with_described_fields_and_an_example(
    document: dict[str, Any],
) -> None:
    posts = body_operations(document)
    assert len(posts) == 20
    for path, op in posts:
        body = op.get("requestBody")
        assert body is not None and body.get("required") is True, path
        schema = body_schema(document, op)
        assert schema.get("type") == "object", path
        examples = schema.get("examples")
        assert isinstance(examples, list) and examples, f"{path}: no example"
        props = schema["properties"]
        for name, prop in props.items():
            assert prop.get("description", "").strip(), f"{path}: field `{name}` has no description"
        for name in schema.get("required", []):
            assert name in props, f"{path}: required field `{name}` is not a property"
        for example in examples:
            missing = [f for f in schema.get("required", []) if f not in example]
            assert not missing, f"{path}: example misses required {missing}"
            assert set(example) <= set(props), f"{path}: example has undocumented fields"


def test_nested_body_objects_have_described_fields(document: dict[str, Any]) -> None:
    reconcile = body_schema(document, document["paths"]["/reconcile"]["post"])
    nested = resolve(document, reconcile["properties"]["workers"]["items"])
    for name, prop in nested["properties"].items():
        assert prop.get("description", "").strip(), f"ReconcileWorker.{name}"


def test_numeric_bounds_use_standard_json_schema_keywords(document: dict[str, Any]) -> None:
    """Validator-only keywords (``ge``/``le``) must not leak into the document."""

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            assert not {"ge", "le", "gt", "lt"} & set(node), where
            for key, value in node.items():
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}/{i}")

    walk(document["components"]["schemas"], "#/components/schemas")
    add = body_schema(document, document["paths"]["/add"]["post"])
    ms = add["properties"]["expected_prefill_ms"]["anyOf"][0]
    assert (ms["type"], ms["minimum"], ms["maximum"]) == ("number", 0, 1e12)
    frac = body_schema(document, document["paths"]["/output_block"]["post"])["properties"]
    frac = frac["decay_fraction"]["anyOf"][0]
    assert (frac["type"], frac["minimum"], frac["maximum"]) == ("number", 0, 1)


def test_prompt_bodies_document_exactly_one_prompt_form(document: dict[str, Any]) -> None:
    for path in ("/add", "/potential_loads", "/project_loads"):
        schema = body_schema(document, document["paths"][path]["post"])
        assert schema["oneOf"] == [
            {"required": ["sequence_hashes"]},
            {"required": ["token_ids"]},
        ], path


def test_metrics_is_documented_as_prometheus_text(document: dict[str, Any]) -> None:
    content = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["text/plain"]


# -- the examples work ---------------------------------------------------------------------------

# What must exist before each documented example is sent, and the status it then gets.
EXAMPLE_SETUP: dict[str, tuple[list[tuple[str, dict[str, Any]]], int]] = {}
_LLAMA = {"worker_id": 1, "model_name": "llama", "block_size": 16, "dp_start": 0, "dp_size": 2}
_R1 = {
    "model_name": "llama",
    "request_id": "r1",
    "worker_id": 1,
    "dp_rank": 0,
    "sequence_hashes": [1, 2, 3],
    "new_isl_tokens": 48,
}
_SEL_W1 = {"worker_id": 1, "model_name": "llama", "endpoint": "http://w1", "block_size": 16}
_SEL_PICK = {"model_name": "llama", "selection_id": "req-1", "token_ids": list(range(32))}
_SEL_BOOK = {
    "model_name": "llama",
    "selection_id": "req-9",
    "worker_id": 1,
    "sequence_hashes": [7],
    "isl_tokens": 16,
}
for _path, _setup, _status in [
    ("/register", [], 201),
    ("/upsert", [], 201),
    ("/reconcile", [], 200),
    ("/unregister", [("/register", _LLAMA)], 200),
    ("/heartbeat", [("/register", _LLAMA)], 200),
    ("/add", [("/register", _LLAMA)], 201),
    ("/prefill_complete", [("/register", _LLAMA), ("/add", _R1)], 200),
    ("/free", [("/register", _LLAMA), ("/add", _R1)], 200),
    ("/output_block", [("/register", _LLAMA), ("/add", _R1)], 200),
    ("/potential_loads", [("/register", _LLAMA)], 200),
    ("/project_loads", [("/register", _LLAMA)], 200),
    ("/batch", [("/register", _LLAMA)], 200),
    ("/selection/workers", [], 201),
    ("/selection/select", [("/selection/workers", _SEL_W1)], 200),
    ("/selection/select_and_reserve", [("/selection/workers", _SEL_W1)], 200),
    (
        "/selection/reservations",
        [("/selection/workers", _SEL_W1), ("/selection/select", _SEL_PICK)],
        201,
    ),
    (
        "/selection/reservations/{selection_id}/output_block",
        [("/selection/workers", _SEL_W1), ("/selection/reservations", _SEL_BOOK)],
        200,
    ),
    ("/selection/potential_loads", [("/selection/workers", _SEL_W1)], 200),
    ("/selection/overlap_scores", [("/selection/workers", _SEL_W1)], 200),
    ("/selection/explain", [("/selection/workers", _SEL_W1)], 200),
]:
    EXAMPLE_SETUP[_path] = (_setup, _status)
# Path parameters of the examples' routes.
EXAMPLE_PATH_VALUES = {"selection_id": "req-9"}


def test_every_body_example_has_a_scenario(document: dict[str, Any]) -> None:
    assert {path for path, _ in body_operations(document)} == set(EXAMPLE_SETUP)


@pytest.mark.parametrize("path", sorted(EXAMPLE_SETUP))
async def test_documented_example_is_accepted(make_client, path: str) -> None:
    setup, status = EXAMPLE_SETUP[path]
    async with make_client() as (app, client):
        schema = body_schema(app.openapi(), app.openapi()["paths"][path]["post"])
        for example in schema["examples"]:
            for setup_path, setup_body in setup:
                r = await post_json(client, setup_path, setup_body)
                assert r.status_code in (200, 201), (setup_path, r.text)
            r = await post_json(client, path.format(**EXAMPLE_PATH_VALUES), example)
            assert r.status_code == status, (path, r.status_code, r.text)
            if path == "/batch":
                assert all(res["status"] < 300 for res in r.json()["results"]), r.text


# -- interactive docs ----------------------------------------------------------------------------


async def test_docs_page_renders(client) -> None:
    r = await client.get("/docs")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "swagger-ui" in r.text
    assert "/openapi.json" in r.text


async def test_openapi_json_is_served(app, client) -> None:
    r = await client.get("/openapi.json")
    assert r.status_code == 200
    assert r.json() == app.openapi()
    assert r.json()["info"]["title"] == "kv-slot-tracker"


async def test_query_errors_are_documented_as_they_are_answered(document, client) -> None:
    """Bad query strings get 400 `ErrorBody` (as the reference does), so no 422 is documented."""
    assert "HTTPValidationError" not in document["components"]["schemas"]
    for path in ("/workers", "/loads", "/lora_counts"):
        responses = document["paths"][path]["get"]["responses"]
        assert "422" not in responses, path
        assert responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorBody"
        }
    r = await client.get("/lora_counts")
    assert r.status_code == 400
    assert r.json() == {"error": "Failed to deserialize query string: missing field `model_name`"}


SUCCESS_CODES = {
    "/register": {"201"},
    "/upsert": {"200", "201"},
    "/add": {"201"},
    "/unregister": {"200"},
    "/heartbeat": {"200"},
    "/reconcile": {"200"},
    "/prefill_complete": {"200"},
    "/free": {"200"},
    "/output_block": {"200"},
    "/potential_loads": {"200"},
    "/project_loads": {"200"},
    "/batch": {"200"},
    "/selection/workers": {"201"},
    "/selection/select": {"200"},
    "/selection/select_and_reserve": {"200"},
    "/selection/reservations": {"201"},
    "/selection/reservations/{selection_id}/output_block": {"200"},
    "/selection/potential_loads": {"200"},
    "/selection/overlap_scores": {"200"},
    "/selection/explain": {"200"},
}


def test_every_success_status_is_documented(document: dict[str, Any]) -> None:
    """Each route's documented 2xx codes are exactly the ones it answers (upsert: 201 created)."""
    for path, op in body_operations(document):
        documented = {code for code in op["responses"] if code.startswith("2")}
        assert documented == SUCCESS_CODES[path], path


def test_operations_are_grouped_named_and_described(document: dict[str, Any]) -> None:
    """Generated clients get short stable method names; /docs groups the operations by tag."""
    tags = [t["name"] for t in document["tags"]]
    assert tags == ["topology", "lifecycle", "loads", "selection", "operations"]
    ids = []
    for path, method, op in operations(document):
        assert len(op["tags"]) == 1 and op["tags"][0] in tags, (method, path)
        assert (op["tags"][0] == "selection") == path.startswith("/selection/"), (method, path)
        assert len(op.get("description", "")) > 40, f"{method} {path} has no description"
        ids.append(op["operationId"])
    assert len(set(ids)) == len(ids) == 39
    assert all(i.replace("_", "").isalnum() and i.islower() and len(i) <= 40 for i in ids), ids
    paths = document["paths"]
    assert paths["/add"]["post"]["operationId"] == "add"
    assert paths["/metrics"]["get"]["operationId"] == "metrics"
    assert (
        paths["/selection/reservations/{selection_id}/prefill_complete"]["post"]["operationId"]
        == "selection_reservation_prefill_complete"
    )


async def test_error_examples_are_real_answers(document: dict[str, Any], make_client) -> None:
    """Each documented error example is the text the service answers for that status."""
    examples = {}
    for _, _, op in operations(document):
        for status, response in op["responses"].items():
            body = response.get("content", {}).get("application/json", {})
            if status.startswith(("4", "5")) and body["schema"]["$ref"].endswith("/ErrorBody"):
                example = body.get("example")
                assert example is not None and set(example) == {"error"}, (status, op["summary"])
                examples.setdefault(int(status), example["error"])
    async with make_client(api_key="k") as (_, c):
        auth = {"authorization": "Bearer k"}
        assert (await c.get("/loads")).json()["error"] == examples[401]
        bad = await c.post(
            "/add",
            content=b'{"model_name": "m"',
            headers={**auth, "content-type": "application/json"},
        )
        assert bad.status_code == 400 and bad.json()["error"] == examples[400]
        reg = {"model_name": "m", "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 1}
        assert (await c.post("/register", json=reg, headers=auth)).status_code == 201
        add = {"model_name": "m", "request_id": "r-1", "worker_id": 1, "dp_rank": 0}
        add["sequence_hashes"] = []
        assert (await c.post("/add", json=add, headers=auth)).status_code == 201
        again = await c.post("/add", json=add, headers=auth)
        assert (again.status_code, again.json()["error"]) == (409, examples[409])
        done = {"model_name": "m", "request_id": "r-1"}
        assert (await c.post("/free", json=done, headers=auth)).status_code == 200
        gone = await c.post("/prefill_complete", json=done, headers=auth)
        assert (gone.status_code, gone.json()["error"]) == (404, examples[404])
        shape = await c.post("/free", json={"model_name": "m"}, headers=auth)
        assert (shape.status_code, shape.json()["error"]) == (422, examples[422])
        text = await c.post("/free", content=b"{}", headers={**auth, "content-type": "text/plain"})
        assert (text.status_code, text.json()["error"]) == (415, examples[415])


async def test_the_replication_status_schema_is_the_answer(
    document: dict[str, Any], make_client, redis_url: str, redis_namespace: str
) -> None:
    """``GET /replication`` answers exactly the documented fields, embedded and replicated."""
    schema = document["components"]["schemas"]["ReplicationStatus"]
    assert set(schema["required"]) == set(schema["properties"])
    assert len(schema["properties"]) >= 20
    types = {"string": str, "integer": int, "boolean": bool, "number": (int, float)}
    types |= {"object": dict, "array": list, "null": type(None)}

    def check(answer: dict[str, Any]) -> None:
        assert set(answer) == set(schema["properties"])
        for name, value in answer.items():
            prop = schema["properties"][name]
            allowed = [p["type"] for p in prop.get("anyOf", [prop])]
            assert isinstance(value, tuple(types[t] for t in allowed)), (name, value, allowed)

    async with make_client() as (_, c):
        embedded = (await c.get("/replication")).json()
        check(embedded)
        assert embedded["mode"] == "embedded"
    async with make_client(redis_url=redis_url, namespace=redis_namespace) as (_, c):
        replicated = (await c.get("/replication")).json()
        check(replicated)
        assert replicated["mode"] == "redis" and replicated["connected"] is True


def test_topology_sizes_are_documented_with_the_minimum_the_service_accepts(
    document: dict[str, Any],
) -> None:
    schemas = document["components"]["schemas"]
    for name in ("RegisterBody", "UpsertBody"):
        props = schemas[name]["properties"]
        assert props["block_size"]["minimum"] == 1, name
        assert props["dp_size"]["minimum"] == 1, name
    reconcile = schemas["ReconcileBody"]["properties"]
    assert reconcile["block_size"]["minimum"] == 1
    worker = resolve(document, reconcile["workers"]["items"])
    assert worker["properties"]["dp_size"]["minimum"] == 1


async def test_a_size_of_0_is_refused_as_the_schema_says(client) -> None:
    for field in ("block_size", "dp_size"):
        body = {"model_name": "zero", "worker_id": 1, "block_size": 16, "dp_start": 0,
                "dp_size": 1, field: 0}  # fmt: skip
        r = await post_json(client, "/register", body)
        assert r.status_code == 400, r.text


def test_worker_id_path_parameters_are_typed_as_u64(document: dict[str, Any]) -> None:
    seen = 0
    for path, _, op in operations(document):
        for param in op.get("parameters", []):
            if param["in"] == "path" and param["name"] == "worker_id":
                schema = param["schema"]
                assert (schema["type"], schema["minimum"], schema["maximum"]) == (
                    "integer", 0, 2**64 - 1), path  # fmt: skip
                seen += 1
    assert seen == 2  # PATCH and DELETE /selection/workers/{worker_id}


async def test_integer_fields_refuse_a_fraction_literal_and_the_document_says_so(
    document: dict[str, Any], client
) -> None:
    assert "`1.0`" in document["info"]["description"]
    props = document["components"]["schemas"]["RegisterBody"]["properties"]
    assert props["worker_id"]["format"] == "uint64"
    assert props["dp_start"]["format"] == "uint32"
    r = await client.post(
        "/register",
        content=b'{"model_name":"f","worker_id":1.0,"block_size":16,"dp_start":0,"dp_size":1}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 422, r.text
    assert "floating point `1.0`, expected u64" in r.json()["error"]
