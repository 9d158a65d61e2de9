"""The route table served by FastAPI: each ``Route`` of ``kv_slot_tracker.http.routes`` made a
FastAPI endpoint.

``fastapi_route_args`` documents a route (and so the OpenAPI document); ``call_endpoint`` makes
a call route's endpoint, which runs the operation (``kv_slot_tracker.http.answers``) on the path
parameters and body, and ``query_endpoint`` a query route's, which hands the raw query string to
its handler (``kv_slot_tracker.http.queries``). The hot routes are also served before FastAPI
(``kv_slot_tracker.http.dispatch``), from the same table.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from fastapi import Path, Query, Request, Response
from starlette.datastructures import QueryParams

from kv_slot_tracker.http.answers import Call, Later
from kv_slot_tracker.http.auth import PROBE_SCOPE_KEY
from kv_slot_tracker.http.body import declares_body, read_asgi_body
from kv_slot_tracker.http.errors import EXPECTED, error_result
from kv_slot_tracker.http.queries import PROBE
from kv_slot_tracker.http.responses import JSON, raw_response
from kv_slot_tracker.http.routes import Route, error_responses


def fastapi_route_args(route: Route) -> dict[str, Any]:
    """``add_api_route`` arguments that document ``route``."""
    args: dict[str, Any] = {
        "summary": route.summary,
        "methods": [route.method],
        "name": route.operation_id,
        "operation_id": route.operation_id,
        "tags": [route.tag or route.api],
    }
    if route.description:
        args["description"] = route.description
    if route.is_call:
        if route.body is not None:
            ref = f"#/components/schemas/{route.body.__name__}"
            args["openapi_extra"] = {
                "requestBody": {
                    "required": not route.optional_body,
                    "content": {JSON: {"schema": {"$ref": ref}}},
                }
            }
        args["status_code"] = route.status
        args["response_model"] = None
        args["responses"] = {
            route.status: {"model": route.response, "description": "Success."},
            **{c: {"model": route.response, "description": d} for c, d in route.other_ok.items()},
            **error_responses(route.errors),
        }
    else:
        if route.response is not None:
            args["response_model"] = route.response
        args["responses"] = error_responses(route.errors)
    if route.needs_state:
        args["responses"].update(error_responses((503,)))
    for k, v in route.extra.items():
        if k == "responses":
            args["responses"] = {**args["responses"], **v}
        else:
            args[k] = v
    return args


def call_endpoint(route: Route, operation: Call, max_body: int) -> Callable[..., Any]:
    """A FastAPI endpoint running ``operation(body, *path parameters)``: path parameters are
    parsed first, then the body is read (when the route has one), as the reference does. The
    operation answers its ``Result``, or ``Later`` (``kv_slot_tracker.http.answers``)."""

    async def endpoint(request: Request, **_: Any) -> Response:
        try:
            args = [p.parse(request.path_params[p.name]) for p in route.path_params]
            raw = (
                await read_asgi_body(request.scope, request.receive, max_body)
                if route.body is not None
                and (not route.optional_body or declares_body(request.scope["headers"]))
                else b""
            )
        except EXPECTED as e:
            status, payload = error_result(e)
        else:
            answer = operation(raw, *args)
            status, payload = await answer if isinstance(answer, Later) else answer
        return raw_response(payload, status)

    params = [
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)
    ]
    for p in route.path_params:  # declared as text: the route parses (and rejects) the value
        params.append(
            inspect.Parameter(
                p.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=Path(description=p.description, json_schema_extra=p.schema),
                annotation=str,
            )
        )
    endpoint.__signature__ = inspect.Signature(params, return_annotation=Response)  # type: ignore[attr-defined]
    endpoint.__name__ = route.name
    return endpoint


def query_endpoint(route: Route, handler: Callable[[QueryParams], Response]) -> Callable[..., Any]:
    """A FastAPI endpoint whose signature declares the route's query parameters (so FastAPI
    validates and documents them); the handler reads the raw query string itself."""

    async def endpoint(request: Request, **_: Any) -> Response:
        try:
            params = request.query_params
            if request.scope.get(PROBE_SCOPE_KEY):  # a caller without the key: the probe's part
                params = QueryParams([*params.multi_items(), (PROBE, "1")])
            return handler(params)
        except EXPECTED as e:
            status, payload = error_result(e)
            return raw_response(payload, status)

    params = [
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)
    ]
    for q in route.query:
        default = (
            Query(q.default, description=q.description, json_schema_extra=q.schema)
            if q.default is not ...
            else Query(description=q.description, json_schema_extra=q.schema)
        )
        params.append(
            inspect.Parameter(
                q.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=q.annotation
            )
        )
    endpoint.__signature__ = inspect.Signature(params, return_annotation=Response)  # type: ignore[attr-defined]
    endpoint.__name__ = route.name
    return endpoint
