"""Routes. Handlers are thin: read and validate the body, call the service, encode the answer.

Handlers take the raw ``Request`` and return ready ``Response``s, so FastAPI does no parameter
resolution or response-model serialization on the hot path; the models are declared for the
OpenAPI document only.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel

from app.api import schemas as s
from app.api.body import read_body
from app.api.operations import Operations
from app.service import ServiceError, SlotTrackerService

JSON = "application/json"

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": s.ErrorBody, "description": desc}
    for code, desc in {
        400: "Malformed JSON or an invalid value.",
        401: "Missing or wrong bearer key (only when an API key is configured).",
        404: "No such tracker, worker or request.",
        409: "Conflicts with the current state.",
        413: "Body larger than the limit.",
        415: "Content type is not JSON.",
        422: "Well-formed JSON of the wrong shape.",
    }.items()
}


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type=JSON)


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI request body for a handler that validates the body itself."""
    return {
        "requestBody": {
            "required": True,
            "content": {JSON: {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }


BODY_MODELS: list[type[BaseModel]] = []


def _route(
    router: APIRouter,
    path: str,
    model: type[BaseModel],
    ok_model,
    ok_status=200,
    summary: str = "",
    errors=(400, 401, 404, 413, 415, 422),
    other_ok: dict[int, str] | None = None,
):
    if model not in BODY_MODELS:  # every app built in one process registers the same models
        BODY_MODELS.append(model)
    return router.post(
        path,
        summary=summary,
        openapi_extra=body_doc(model),
        status_code=ok_status,
        response_model=None,
        responses={
            ok_status: {"model": ok_model, "description": "Success."},
            **{c: {"model": ok_model, "description": d} for c, d in (other_ok or {}).items()},
            **{c: ERRORS[c] for c in errors},
        },
    )


def _single_query(request: Request, name: str) -> str | None:
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise ServiceError(400, f"Failed to deserialize query string: duplicate field `{name}`")
    return values[0] if values else None


def build_router(service: SlotTrackerService, ops: Operations, max_body: int) -> APIRouter:
    router = APIRouter()

    async def run(name: str, request: Request) -> Response:
        status, payload = ops.run(name, await read_body(request, max_body))
        return Response(payload, status_code=status, media_type=JSON)

    @_route(
        router,
        "/register",
        s.RegisterBody,
        s.StatusOk,
        201,
        "Register a worker's ranks",
        (400, 401, 409, 413, 415, 422),
    )
    async def register(request: Request) -> Response:
        return await run("register", request)

    @_route(
        router,
        "/upsert",
        s.UpsertBody,
        s.StatusOk,
        200,
        "Register a worker or replace its ranks (201 when created)",
        (400, 401, 409, 413, 415, 422),
        {201: "Created: the worker id was new."},
    )
    async def upsert(request: Request) -> Response:
        return await run("upsert", request)

    @_route(
        router,
        "/unregister",
        s.UnregisterBody,
        s.StatusOk,
        200,
        "Remove a worker with all its ranks and requests",
    )
    async def unregister(request: Request) -> Response:
        return await run("unregister", request)

    @_route(
        router,
        "/reconcile",
        s.ReconcileBody,
        s.ReconcileResult,
        200,
        "Make a list of workers the whole topology of a tracker",
        (400, 401, 409, 413, 415, 422),
    )
    async def reconcile(request: Request) -> Response:
        return await run("reconcile", request)

    @router.get(
        "/workers",
        summary="Registered workers",
        response_model=list[s.WorkerRow],
        responses={400: ERRORS[400], 401: ERRORS[401]},
    )
    async def workers(
        request: Request,
        model_name: str | None = Query(None, description="Only this model."),
        routing_group: str | None = Query(None, description="Only this routing group."),
    ) -> Response:
        return json_response(
            service.workers(
                _single_query(request, "model_name"), _single_query(request, "routing_group")
            )
        )

    @_route(
        router,
        "/add",
        s.AddBody,
        s.StatusOk,
        201,
        "Add an active request to a rank",
        (400, 401, 404, 409, 413, 415, 422),
    )
    async def add(request: Request) -> Response:
        return await run("add", request)

    @_route(
        router,
        "/prefill_complete",
        s.RequestBody,
        s.StatusOk,
        200,
        "Mark a request's prefill as done",
    )
    async def prefill_complete(request: Request) -> Response:
        return await run("prefill_complete", request)

    @_route(router, "/free", s.RequestBody, s.StatusOk, 200, "Free a request (unknown ids succeed)")
    async def free(request: Request) -> Response:
        return await run("free", request)

    @_route(
        router,
        "/output_block",
        s.OutputBlockBody,
        s.StatusOk,
        200,
        "Add a generated (output) block to a request",
    )
    async def output_block(request: Request) -> Response:
        return await run("output_block", request)

    @router.get(
        "/loads",
        summary="Current load of every rank",
        response_model=list[s.LoadRow],
        responses={400: ERRORS[400], 401: ERRORS[401]},
    )
    async def loads(
        request: Request,
        model_name: str | None = Query(None, description="Only this model."),
        routing_group: str | None = Query(None, description="Only this routing group."),
    ) -> Response:
        return json_response(
            service.loads(
                _single_query(request, "model_name"), _single_query(request, "routing_group")
            )
        )

    @_route(
        router,
        "/potential_loads",
        s.PotentialLoadsBody,
        list[s.PotentialLoadRow],
        200,
        "Load of every rank if a prompt went there",
    )
    async def potential_loads(request: Request) -> Response:
        return await run("potential_loads", request)

    @_route(
        router,
        "/project_loads",
        s.ProjectLoadsBody,
        list[s.ProjectedLoadRow],
        200,
        "Projected load of every rank for a prompt",
    )
    async def project_loads(request: Request) -> Response:
        return await run("project_loads", request)

    @router.get(
        "/lora_counts",
        summary="Active requests per LoRA name",
        response_model=s.LoraCounts,
        responses={400: ERRORS[400], 401: ERRORS[401], 404: ERRORS[404]},
    )
    async def lora_counts(
        request: Request,
        model_name: str = Query(description="Model name."),
        routing_group: str = Query("default", description="Routing group."),
    ) -> Response:
        m = _single_query(request, "model_name")
        g = _single_query(request, "routing_group")
        key = (m or "", g if g is not None else "default")
        return json_response(
            {"model_name": key[0], "routing_group": key[1], "lora_counts": service.lora_counts(key)}
        )

    @_route(
        router,
        "/batch",
        s.BatchBody,
        s.BatchResponse,
        200,
        "Apply many lifecycle operations in one call",
    )
    async def batch(request: Request) -> Response:
        return await run("batch", request)

    return router
