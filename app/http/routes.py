"""The route table: every API route declared once.

A ``Route`` names its path, method, operation, summary, body and response models, path
parameters and documented errors. From this one table ``app.http.app`` builds both the FastAPI
routes (and so the OpenAPI document and ``/docs``) and the lean dispatcher's table of hot routes.
A route belongs to one API (``api``): the slot tracker's (``app.http.operations`` and
``Queries``) or the selection service's under ``/selection`` (``app.http.selection.operations``).
*Call* routes (a body or path parameters) run an operation ``op(body, *path parameters)``;
*query* routes run a queries method on the query string.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Path, Query, Request, Response
from pydantic import BaseModel
from starlette.datastructures import QueryParams

from app.core.types import U64_MAX
from app.http import schemas as s
from app.http.body import read_asgi_body
from app.http.errors import EXPECTED, HttpError, error_result, query_error
from app.http.responses import JSON, json_response, raw_response
from app.http.selection import schemas as ss
from app.replication.port import Replication
from app.service import DEFAULT_ROUTING_GROUP, SlotTrackerService

ERROR_DOCS: dict[int, str] = {
    400: "Malformed JSON or an invalid value.",
    401: "Missing or wrong bearer key (only when an API key is configured).",
    404: "No such tracker, worker or request.",
    409: "Conflicts with the current state.",
    413: "Body larger than the limit.",
    415: "Content type is not JSON.",
    422: "Well-formed JSON of the wrong shape.",
    503: 'Not ready (still loading the shared state); with `replication_ack = "redis"`, Redis '
    "cannot be reached; no schedulable worker for the partition (selection API). Retry, here or "
    "on another instance.",
}
BODY_ERRORS = (400, 401, 404, 413, 415, 422)
TOPOLOGY_ERRORS = (400, 401, 409, 413, 415, 422)
ADD_ERRORS = (400, 401, 404, 409, 413, 415, 422)


def error_responses(codes: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": s.ErrorBody, "description": ERROR_DOCS[c]} for c in codes}


@dataclass(frozen=True)
class QueryParam:
    name: str
    annotation: Any
    default: Any
    description: str


U64_PATH = r"\+?[0-9]+"


def parse_u64_path(value: str) -> int:
    """A ``u64`` path segment as Rust parses it (optional ``+``, digits only, in range)."""
    if value.isascii() and re.fullmatch(U64_PATH, value) and int(value) <= U64_MAX:
        return int(value)
    raise HttpError(400, f"Invalid URL: Cannot parse `{value}` to a `u64`")


def _text_path(value: str) -> str:
    return value


@dataclass(frozen=True)
class PathParam:
    name: str
    description: str
    parse: Callable[[str], Any] = _text_path  # raises ``HttpError`` on a bad value


@dataclass(frozen=True)
class Route:
    path: str
    method: str
    name: str  # the operation (body routes) or ``Queries`` method (query routes)
    summary: str
    body: type[BaseModel] | None = None  # a body route's request model (documented)
    response: Any = None  # the success model
    status: int = 200
    errors: tuple[int, ...] = BODY_ERRORS
    other_ok: dict[int, str] = field(default_factory=dict)
    query: tuple[QueryParam, ...] = ()
    lean: bool = False  # served by the lean dispatcher (hot routes)
    needs_state: bool = True  # reads or writes tracker state: 503 while not ready (gate.py)
    extra: dict[str, Any] = field(default_factory=dict)  # other FastAPI route arguments
    path_params: tuple[PathParam, ...] = ()
    api: str = "slot"  # "slot" or "selection": which operations serve it

    @property
    def is_call(self) -> bool:
        """Runs an operation on the body and path parameters (else a query handler)."""
        return self.body is not None or bool(self.path_params)


_MODEL_Q = QueryParam("model_name", str | None, None, "Only this model.")
_GROUP_Q = QueryParam("routing_group", str | None, None, "Only this routing group.")

# -- the selection API (SELECTION.md): Dynamo's selection service under /selection ------------

SEL = "/selection"
_SEL_ID = PathParam("selection_id", "Reservation (selection) id, percent-encoded.")
_WORKER_ID = PathParam("worker_id", "Worker id (u64).", parse_u64_path)
SELECT_ERRORS = (400, 401, 409, 413, 415, 422, 503)
BOOK_ERRORS = (400, 401, 404, 409, 413, 415, 422, 503)
QUERY_ERRORS = (400, 401, 413, 415, 422, 503)
LIFECYCLE_ERRORS = (401, 404)

SELECTION_ROUTES: tuple[Route, ...] = (
    Route(SEL + "/health", "GET", "health", "Selection API liveness", response=ss.SelectionStatus,
          errors=(), api="selection", needs_state=False),
    Route(SEL + "/ready", "GET", "ready", "200 while some worker is schedulable, else 503",
          response=ss.SelectionReady, errors=(), api="selection", needs_state=False,
          extra={"responses": {503: {"model": ss.SelectionReady,
                                     "description": "No schedulable worker anywhere."}}}),
    Route(SEL + "/workers", "POST", "upsert_worker",
          "Register a worker or replace it (it may move partition)", ss.WorkerBody,
          ss.WorkerRecord, 201, (400, 401, 413, 415, 422), api="selection"),
    Route(SEL + "/workers", "GET", "workers", "The worker catalog",
          response=list[ss.WorkerRecord], errors=(400, 401), query=(_MODEL_Q, _GROUP_Q),
          api="selection"),
    Route(SEL + "/workers/{worker_id}", "PATCH", "patch_worker",
          "Change some fields of a worker", ss.WorkerPatchBody, ss.WorkerRecord,
          errors=BODY_ERRORS, path_params=(_WORKER_ID,), lean=True, api="selection"),
    Route(SEL + "/workers/{worker_id}", "DELETE", "delete_worker",
          "Remove a worker; its reservations are freed", response=ss.WorkerRecord,
          errors=(400, 401, 404), path_params=(_WORKER_ID,), lean=True, api="selection"),
    Route(SEL + "/select", "POST", "select", "Choose a worker rank for a prompt (books nothing)",
          ss.SelectBody, ss.SelectResponse, errors=SELECT_ERRORS, lean=True, api="selection"),
    Route(SEL + "/select_and_reserve", "POST", "select_and_reserve",
          "Choose a worker rank and book the prompt there", ss.SelectBody,
          ss.SelectAndReserveResponse, errors=SELECT_ERRORS, lean=True, api="selection"),
    Route(SEL + "/reservations", "POST", "reserve",
          "Book a pending selection, or a prompt on a given rank", ss.ReservationBody,
          ss.ReservationResponse, 201, BOOK_ERRORS, lean=True, api="selection"),
    Route(SEL + "/reservations/{selection_id}/prefill_complete", "POST",
          "reservation_prefill_complete", "The reservation's prefill is done",
          response=ss.SelectionStatus, errors=LIFECYCLE_ERRORS, path_params=(_SEL_ID,),
          lean=True, api="selection"),
    Route(SEL + "/reservations/{selection_id}/output_block", "POST", "reservation_output_block",
          "Add a generated block to the reservation", ss.ReservationOutputBlockBody, ss.SelectionStatus,
          errors=BODY_ERRORS, path_params=(_SEL_ID,), lean=True, api="selection"),
    Route(SEL + "/reservations/{selection_id}", "DELETE", "delete_reservation",
          "Free a reservation", response=ss.SelectionStatus, errors=LIFECYCLE_ERRORS,
          path_params=(_SEL_ID,), lean=True, api="selection"),
    Route(SEL + "/loads", "GET", "loads", "Current load of every rank, per partition",
          response=list[ss.PartitionLoads], errors=(400, 401), query=(_MODEL_Q, _GROUP_Q),
          api="selection"),
    Route(SEL + "/potential_loads", "POST", "potential_loads",
          "Load of every rank if a prompt went there", ss.PromptBody, list[ss.RankLoad],
          errors=QUERY_ERRORS, lean=True, api="selection"),
    Route(SEL + "/overlap_scores", "POST", "overlap_scores",
          "Cached prefix of a prompt on every rank (approximate cache)", ss.PromptBody,
          ss.OverlapScoresResponse, errors=QUERY_ERRORS, lean=True, api="selection"),
    Route(SEL + "/dump", "GET", "dump", "The approximate caches as stored events",
          response=dict[str, ss.PartitionDump], errors=(401,), api="selection"),
)  # fmt: skip

ROUTES: tuple[Route, ...] = (
    Route("/health", "GET", "health", "Liveness: 200 with an empty body", errors=(),
          needs_state=False,
          extra={"response_class": Response,
                 "responses": {200: {"description": "Alive.", "content": {}}}}),
    Route("/ready", "GET", "ready", "Readiness: 200 once the instance can serve",
          response=s.ReadyBody, errors=(), needs_state=False,
          extra={"responses": {503: {"model": s.ReadyBody, "description": "Not ready yet."}}}),
    Route("/replication", "GET", "replication_status", "Replication status of this instance",
          response=s.ReplicationStatus, errors=(401,), needs_state=False),
    Route("/register", "POST", "register", "Register a worker's ranks", s.RegisterBody,
          s.StatusOk, 201, TOPOLOGY_ERRORS),
    Route("/upsert", "POST", "upsert", "Register a worker or replace its ranks (201 when created)",
          s.UpsertBody, s.StatusOk, 200, TOPOLOGY_ERRORS,
          other_ok={201: "Created: the worker id was new."}),
    Route("/unregister", "POST", "unregister", "Remove a worker with all its ranks and requests",
          s.UnregisterBody, s.StatusOk),
    Route("/reconcile", "POST", "reconcile",
          "Make a list of workers the whole topology of a tracker", s.ReconcileBody,
          s.ReconcileResult, 200, TOPOLOGY_ERRORS),
    Route("/workers", "GET", "workers", "Registered workers", response=list[s.WorkerRow],
          errors=(400, 401), query=(_MODEL_Q, _GROUP_Q)),
    Route("/add", "POST", "add", "Add an active request to a rank", s.AddBody, s.StatusOk, 201,
          ADD_ERRORS, lean=True),
    Route("/prefill_complete", "POST", "prefill_complete", "Mark a request's prefill as done",
          s.RequestBody, s.StatusOk, lean=True),
    Route("/free", "POST", "free", "Free a request (unknown ids succeed)", s.RequestBody,
          s.StatusOk, lean=True),
    Route("/output_block", "POST", "output_block", "Add a generated (output) block to a request",
          s.OutputBlockBody, s.StatusOk, lean=True),
    Route("/loads", "GET", "loads", "Current load of every rank", response=list[s.LoadRow],
          errors=(400, 401), query=(_MODEL_Q, _GROUP_Q)),
    Route("/potential_loads", "POST", "potential_loads", "Load of every rank if a prompt went there",
          s.PotentialLoadsBody, list[s.PotentialLoadRow], lean=True),
    Route("/project_loads", "POST", "project_loads", "Projected load of every rank for a prompt",
          s.ProjectLoadsBody, list[s.ProjectedLoadRow], lean=True),
    Route("/lora_counts", "GET", "lora_counts", "Active requests per LoRA name",
          response=s.LoraCounts, errors=(400, 401, 404),
          query=(QueryParam("model_name", str, ..., "Model name."),
                 QueryParam("routing_group", str, DEFAULT_ROUTING_GROUP, "Routing group."))),
    Route("/batch", "POST", "batch", "Apply many lifecycle operations in one call", s.BatchBody,
          s.BatchResponse, lean=True),
    *SELECTION_ROUTES,
)  # fmt: skip


def body_models() -> list[type[BaseModel]]:
    """Request models of the body routes, for the OpenAPI document's components."""
    seen: list[type[BaseModel]] = []
    for r in ROUTES:
        if r.body is not None and r.body not in seen:
            seen.append(r.body)
    return seen


def _single(params: QueryParams, name: str) -> str | None:
    values = params.getlist(name)
    if len(values) > 1:
        raise query_error(f"duplicate field `{name}`")
    return values[0] if values else None


class Queries:
    """The GET routes' handlers: query parameters in, ``Response`` out."""

    def __init__(self, service: SlotTrackerService, replication: Replication) -> None:
        self.service = service
        self.replication = replication

    def health(self, params: QueryParams) -> Response:
        return Response(status_code=200)

    def ready(self, params: QueryParams) -> Response:
        if self.replication.ready():
            return json_response({"status": "ready", "reason": None})
        reason = self.replication.status().not_ready_reason or "replication is catching up"
        return json_response({"status": "not_ready", "reason": reason}, 503)

    def replication_status(self, params: QueryParams) -> Response:
        return json_response(self.replication.status().as_dict())

    def workers(self, params: QueryParams) -> Response:
        m, g = _single(params, "model_name"), _single(params, "routing_group")
        return json_response(self.service.workers(m, g))

    def loads(self, params: QueryParams) -> Response:
        m, g = _single(params, "model_name"), _single(params, "routing_group")
        return json_response(self.service.loads(m, g))

    def lora_counts(self, params: QueryParams) -> Response:
        m, g = _single(params, "model_name"), _single(params, "routing_group")
        key = (m or "", g if g is not None else DEFAULT_ROUTING_GROUP)
        counts = self.service.lora_counts(key)
        return json_response({"model_name": key[0], "routing_group": key[1], "lora_counts": counts})


def fastapi_route_args(route: Route) -> dict[str, Any]:
    """``add_api_route`` arguments that document ``route``."""
    args: dict[str, Any] = {
        "summary": route.summary,
        "methods": [route.method],
        "name": route.name if route.api == "slot" else f"{route.api}_{route.name}",
    }
    if route.is_call:
        if route.body is not None:
            ref = f"#/components/schemas/{route.body.__name__}"
            args["openapi_extra"] = {
                "requestBody": {"required": True, "content": {JSON: {"schema": {"$ref": ref}}}}
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


def call_endpoint(route: Route, operation: Callable[..., Any], max_body: int) -> Callable[..., Any]:
    """A FastAPI endpoint running ``operation(body, *path parameters)``: path parameters are
    parsed first, then the body is read (when the route has one), as the reference does. The
    operation answers ``(status, body)``, or an awaitable of it (``app.http.replicated``)."""

    async def endpoint(request: Request, **_: Any) -> Response:
        try:
            args = [p.parse(request.path_params[p.name]) for p in route.path_params]
            raw = (
                await read_asgi_body(request.scope, request.receive, max_body)
                if route.body is not None
                else b""
            )
        except EXPECTED as e:
            status, payload = error_result(e)
        else:
            result = operation(raw, *args)
            if type(result) is not tuple:
                result = await result
            status, payload = result
        return raw_response(payload, status)

    params = [
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)
    ]
    for p in route.path_params:  # declared as text: the route parses (and rejects) the value
        params.append(
            inspect.Parameter(
                p.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=Path(description=p.description),
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
            return handler(request.query_params)
        except EXPECTED as e:
            status, payload = error_result(e)
            return raw_response(payload, status)

    params = [
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)
    ]
    for q in route.query:
        default = (
            Query(q.default, description=q.description)
            if q.default is not ...
            else Query(description=q.description)
        )
        params.append(
            inspect.Parameter(
                q.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=q.annotation
            )
        )
    endpoint.__signature__ = inspect.Signature(params, return_annotation=Response)  # type: ignore[attr-defined]
    endpoint.__name__ = route.name
    return endpoint
