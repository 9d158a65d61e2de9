"""The HTTP edge: builds the FastAPI application from the route table.

FastAPI is how the app is built, documented (``/docs``, ``openapi.json``) and extended; the lean
dispatcher (``kv_slot_tracker.http.dispatch``) serves the hot routes the table marks, before FastAPI's stack.
Errors FastAPI itself raises (no such route, wrong method, bad query string) get the same
``{"error": ...}`` bodies as everything else.
"""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from kv_slot_tracker import __version__
from kv_slot_tracker.http.answers import CallRoutes
from kv_slot_tracker.http.auth import BearerAuth, open_paths
from kv_slot_tracker.http.dashboard import build_dashboard_router
from kv_slot_tracker.http.dispatch import LeanDispatcher, LeanRoute
from kv_slot_tracker.http.docs import build_docs_router
from kv_slot_tracker.http.endpoints import call_endpoint, fastapi_route_args, query_endpoint
from kv_slot_tracker.http.errors import (
    INTERNAL_ERROR,
    METHOD_NOT_ALLOWED,
    QUERY_SHAPE,
    ROUTE_NOT_FOUND,
)
from kv_slot_tracker.http.gate import ReadinessGate
from kv_slot_tracker.http.middleware import HeadAsGet
from kv_slot_tracker.http.operations import Operations
from kv_slot_tracker.http.queries import Queries
from kv_slot_tracker.http.replicated import DurableAcks, ReplicatedEdge
from kv_slot_tracker.http.responses import JSON, json_response
from kv_slot_tracker.http.routes import ROUTES, TAGS, body_models, response_examples
from kv_slot_tracker.http.schemas import INTEGER_LITERALS
from kv_slot_tracker.http.selection.operations import SelectionOperations, SelectionQueries
from kv_slot_tracker.http.selection.receipts import build_receipts_router, is_receipt_path
from kv_slot_tracker.http.selection.replica_sync import ReplicaSync
from kv_slot_tracker.http.selection.replicated import ReplicatedSelectionEdge
from kv_slot_tracker.ingest.peers import IndexPeers
from kv_slot_tracker.observability.http import HttpMetrics, access_logged
from kv_slot_tracker.replication.port import Replication
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service.consistency import Consistency
from kv_slot_tracker.service.selection.service import SelectionService
from kv_slot_tracker.settings import Settings

DESCRIPTION = (
    "Tracks active requests, KV blocks and prefill tokens of every LLM worker rank, and answers "
    "what each rank's load would be if a prompt went there. A drop-in superset of Dynamo's "
    "standalone slot tracker API.\n\n" + INTEGER_LITERALS
)

# FastAPI's native OpenTelemetry probes global providers and the environment on every request
# unless switched off; nothing here uses it, and it costs as much as the tracker work.
_NO_NATIVE_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


class SlotTrackerApp(FastAPI):
    """FastAPI, with the hot routes handed to the lean dispatcher first."""

    lean: LeanDispatcher | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lean = self.lean
        found = lean.route_for(scope) if lean is not None else None
        if found is None:
            await super().__call__(scope, receive, send)
        else:
            await lean.serve(found, scope, receive, send)  # type: ignore[union-attr]


def build_http_app(
    *,
    settings: Settings,
    service: SlotTrackerService,
    selection: SelectionService,
    replication: Replication,
    registry: CollectorRegistry,
    lifespan: Any,
    consistency: Consistency | None = None,
    index_peers: IndexPeers | None = None,
) -> SlotTrackerApp:
    """The app; ``consistency`` (replicated mode) makes lifecycle calls wait for unknown ids
    and answer 503 until the instance caught up (``kv_slot_tracker.http.replicated``)."""
    app = SlotTrackerApp(
        title="kv-slot-tracker",
        version=__version__,
        description=DESCRIPTION,
        openapi_tags=list(TAGS),
        lifespan=lifespan,
        redirect_slashes=False,  # `/health/` is a 404, as in the reference
        docs_url=None,  # served without a CDN by build_docs_router
        redoc_url=None,
        **_NO_NATIVE_TELEMETRY,
    )
    _install_error_handlers(app)

    gate = None
    slot_operations: CallRoutes = Operations(service, settings.max_batch_operations)
    selection_operations: CallRoutes = SelectionOperations(selection)
    if consistency is not None:  # the same operations, composed with the replicated calls
        gate = ReadinessGate(replication)
        acks = (
            DurableAcks(consistency, settings.replication_ack_timeout_ms)
            if settings.replication_ack == "redis"
            else None
        )
        slot_operations = ReplicatedEdge(
            Operations(service, settings.max_batch_operations), gate, consistency, acks
        )
        selection_operations = ReplicatedSelectionEdge(
            SelectionOperations(selection), gate, consistency, acks
        )
    replica_sync = ReplicaSync(replication)  # Dynamo's peer routes: no ZMQ mesh here
    operations: dict[str, CallRoutes] = {
        "slot": slot_operations,
        "selection": selection_operations,
        "replica_sync": replica_sync,
    }
    queries = {
        "slot": Queries(
            service, replication, settings.replication_ack == "redis", settings.list_max_items
        ),
        "selection": SelectionQueries(
            selection, index_peers, settings.kv_events_silent_seconds, settings.list_max_items
        ),
        "replica_sync": replica_sync,
    }
    lean_routes = []
    for route in ROUTES:
        if route.is_call:
            op = operations[route.api].get(route.name)  # replicated: the gate built in
            endpoint = call_endpoint(route, op, settings.max_body_bytes)
            if route.lean:
                lean_routes.append(
                    LeanRoute(
                        route.method,
                        route.path,
                        op,
                        route.body is not None,
                        tuple(p.parse for p in route.path_params),
                        optional_body=route.optional_body,
                    )
                )
        else:
            handler = getattr(queries[route.api], route.name)
            if gate is not None and route.needs_state:
                handler = gate.guard(handler)
            endpoint = query_endpoint(route, handler)
        app.add_api_route(route.path, endpoint, **fastapi_route_args(route))
    app.include_router(build_receipts_router(selection, settings.max_body_bytes))
    app.include_router(build_dashboard_router())
    app.include_router(build_docs_router(app.title, app.openapi_url or "/openapi.json"))

    api_key = settings.api_key.get_secret_value()
    http_metrics = HttpMetrics(registry)
    if settings.access_log:  # every path (lean, direct, FastAPI) observes through this
        http_metrics.observe = access_logged(http_metrics.observe)  # type: ignore[assignment]
    Instrumentator(
        registry=registry, excluded_handlers=["/metrics"], should_group_untemplated=True
    ).add(http_metrics.instrumentation).instrument(app).expose(
        app, include_in_schema=True, should_gzip=False
    )
    lean = app.lean = LeanDispatcher(
        lean_routes, http_metrics.observe, settings.max_body_bytes, api_key
    )

    if api_key:
        app.add_middleware(
            BearerAuth, api_key=api_key, metrics_require_key=settings.metrics_require_key
        )
    app.add_middleware(
        HeadAsGet,
        templated=lambda scope: lean.matches_template(scope) or is_receipt_path(scope),
    )  # outermost: also strips the body of a 401
    open_without_key = open_paths(settings.metrics_require_key) if api_key else None
    app.openapi = lambda: _openapi(app, open_without_key)  # type: ignore[method-assign]
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return json_response({"error": ROUTE_NOT_FOUND}, 404)
        if exc.status_code == 405:
            resp = json_response({"error": METHOD_NOT_ALLOWED}, 405)
            # RFC 9110 requires `Allow` on a 405, with every method of the path (Starlette
            # gives the first route's only)
            resp.headers["allow"] = ", ".join(_allowed_methods(request))
            return resp
        return json_response({"error": str(exc.detail)}, exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        """A bug: logged with its traceback (by Starlette), answered with the JSON error body
        every other error has."""
        return json_response({"error": INTERNAL_ERROR}, 500)

    @app.exception_handler(RequestValidationError)
    async def query_error(_: Request, exc: RequestValidationError) -> Response:
        err: dict[str, Any] = (
            exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        )
        field = err["loc"][-1] if err.get("loc") else ""
        what = f"missing field `{field}`" if err.get("type") == "missing" else err["msg"]
        return json_response({"error": QUERY_SHAPE + what}, 400)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route of the request's path serves (HEAD with GET: ``HeadAsGet``)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


def _openapi(app: FastAPI, open_without_key: frozenset[str] | None) -> dict[str, Any]:
    """FastAPI's document, with the body routes' models and the real shape of ``/metrics``."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
        tags=app.openapi_tags,
    )
    metrics = doc["paths"].get("/metrics", {}).get("get")
    if metrics is not None:  # the instrumentator documents it as JSON; it is Prometheus text
        metrics["summary"] = "Prometheus metrics (text exposition format)"
        metrics["description"] = (
            "Every tracker's and partition's gauges and counters, replication and HTTP metrics, "
            "for Prometheus to scrape."
        )
        metrics["operationId"] = "metrics"
        metrics["tags"] = ["operations"]
        metrics["responses"] = {
            "200": {
                "description": "Tracker and selection gauges and counters, and HTTP metrics.",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        }
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    # Query-string errors are answered 400 `ErrorBody`, never 422.
    for item in doc["paths"].values():
        for op in item.values():
            responses = op.get("responses", {})
            schema = responses.get("422", {}).get("content", {}).get(JSON, {})
            if schema.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"):
                del responses["422"]
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    for model in body_models():
        sch = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in sch.pop("$defs", {}).items():
            comps.setdefault(name, sub)
        comps[model.__name__] = sch
    for name, examples in response_examples().items():  # with their nulls
        comps[name]["examples"] = examples
    if open_without_key is not None:  # a key is set
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]  # so "Try it out" in /docs sends the key
        for path in open_without_key & doc["paths"].keys():
            for op in doc["paths"][path].values():
                op["security"] = []
    app.openapi_schema = doc
    return doc
