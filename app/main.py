"""Composition root: ``create_app(settings)`` builds a fresh application with its own service,
replication, metrics registry and background tasks. Nothing lives at module level.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from app import __version__
from app.api import schemas
from app.api.dashboard import build_dashboard_router
from app.api.fast import FastPath, bearer_ok
from app.api.operations import Operations
from app.api.routes import BODY_MODELS, ERRORS, build_router, json_response
from app.observability import HttpMetrics, TrackerCollector
from app.replication import Replication, make_replication
from app.service import ServiceError, SlotTrackerService
from app.settings import Settings, load_settings

log = logging.getLogger(__name__)
JSON_MEDIA = "application/json"

OPEN_PATHS = frozenset(
    {
        "/health",
        "/ready",
        "/metrics",
        "/docs",
        "/redoc",
        "/openapi.json",
        "/docs/oauth2-redirect",
        "/dashboard",
    }
)


class BearerAuth:
    """Pure ASGI middleware: every route but the open ones needs ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if bearer_ok(scope, self.expected):
            await self.app(scope, receive, send)
            return
        body = b'{"error":"missing or invalid bearer key"}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def _send_json(send: Send, status: int, body: bytes, head: bool = False) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": b"" if head else body})


class HeadAsGet:
    """Pure ASGI middleware: HEAD is answered like GET without a body, as the reference does.

    FastAPI's GET routes do not accept HEAD (405). Headers, including ``content-length``, stay
    those of the GET answer; a HEAD on a POST-only route is still a 405.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if b"%" in scope.get("raw_path", b""):
            # routes match the path as sent, like the reference: /%61dd is not /add
            await _send_json(send, 404, b'{"error":"route not found"}', scope["method"] == "HEAD")
            return
        if scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_without_body(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_without_body)


class SlotTrackerApp(FastAPI):
    """FastAPI, with the hot POST routes handed to the lean path (``app.api.fast``) first."""

    fast_path: FastPath | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fast = self.fast_path
        name = fast.route_for(scope) if fast is not None else None
        if name is None:
            await super().__call__(scope, receive, send)
        else:
            await fast.serve(name, scope, receive, send)  # type: ignore[union-attr]


# FastAPI's native OpenTelemetry probes global providers and the environment on every request
# unless switched off; nothing here uses it, and it costs as much as the tracker work.
_NO_NATIVE_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


def create_app(
    settings: Settings | None = None, *, clock=None, replication: Replication | None = None
) -> FastAPI:
    settings = settings if settings is not None else load_settings()
    service_kwargs: dict[str, Any] = {}
    if clock is not None:
        service_kwargs["clock"] = clock
    registry = CollectorRegistry(auto_describe=True)  # this app's own, never the global one
    if replication is None:
        replication = make_replication(settings, registry)
    service = SlotTrackerService(
        expiry_seconds=settings.expiry_seconds,
        expiry_check_seconds=settings.expiry_check_seconds,
        max_hashes_per_request=settings.max_hashes_per_request,
        instance_id=replication.instance_id,
        replicator=None if replication.mode == "embedded" else replication,
        **service_kwargs,
    )
    registry.register(TrackerCollector(service))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(_expiry_sweeper(service, settings), name="expiry-sweep")
        await replication.start(service)
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            await replication.stop()

    app = SlotTrackerApp(
        title="kv-slot-tracker",
        version=__version__,
        description="Tracks active requests, KV blocks and prefill tokens of every LLM worker "
        "rank, and answers what each rank's load would be if a prompt went there. A drop-in "
        "superset of Dynamo's standalone slot tracker API.",
        lifespan=lifespan,
        redirect_slashes=False,  # `/health/` is a 404, as in the reference
        **_NO_NATIVE_TELEMETRY,
    )
    app.state.settings = settings
    app.state.service = service
    app.state.replication = replication
    app.state.registry = registry

    @app.exception_handler(ServiceError)
    async def service_error(_: Request, exc: ServiceError) -> Response:
        return json_response({"error": exc.message}, exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return json_response({"error": "route not found"}, 404)
        if exc.status_code == 405:
            resp = json_response({"error": "method not allowed"}, 405)
            if exc.headers:  # the route's `Allow` header (RFC 9110 requires it on a 405)
                resp.headers.update(exc.headers)
            return resp
        return json_response({"error": str(exc.detail)}, exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def query_error(_: Request, exc: RequestValidationError) -> Response:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        field = err["loc"][-1] if err.get("loc") else ""
        what = f"missing field `{field}`" if err.get("type") == "missing" else err["msg"]
        return json_response({"error": f"Failed to deserialize query string: {what}"}, 400)

    @app.get(
        "/health",
        summary="Liveness: 200 with an empty body",
        response_class=Response,
        responses={200: {"description": "Alive.", "content": {}}},
    )
    async def health() -> Response:
        return Response(status_code=200)

    @app.get(
        "/ready",
        summary="Readiness: 200 once the instance can serve",
        response_model=schemas.ReadyBody,
        responses={503: {"model": schemas.ReadyBody, "description": "Not ready yet."}},
    )
    async def ready() -> Response:
        if replication.ready():
            return json_response({"status": "ready", "reason": None})
        reason = replication.status().not_ready_reason or "replication is catching up"
        return json_response({"status": "not_ready", "reason": reason}, 503)

    @app.get(
        "/replication",
        summary="Replication status of this instance",
        response_model=schemas.ReplicationStatus,
        responses={401: ERRORS[401]},
    )
    async def replication_status() -> Response:
        return json_response(replication.status().as_dict())

    ops = Operations(service)
    app.include_router(build_router(service, ops, settings.max_body_bytes))
    app.include_router(build_dashboard_router())

    api_key = settings.api_key.get_secret_value()
    http_metrics = HttpMetrics(registry)
    Instrumentator(
        registry=registry, excluded_handlers=["/metrics"], should_group_untemplated=True
    ).add(http_metrics.instrumentation).instrument(app).expose(
        app, include_in_schema=True, should_gzip=False
    )
    app.fast_path = FastPath(ops, http_metrics, settings.max_body_bytes, api_key)

    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(HeadAsGet)  # outermost: also strips the body of a 401

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        metrics = doc["paths"].get("/metrics", {}).get("get")
        if metrics is not None:  # the instrumentator documents it as JSON; it is Prometheus text
            metrics["summary"] = "Prometheus metrics (text exposition format)"
            metrics["responses"] = {
                "200": {
                    "description": "Tracker gauges and counters, and HTTP metrics.",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            }
        comps = doc.setdefault("components", {}).setdefault("schemas", {})
        # Query-string errors are answered 400 `ErrorBody` (query_error above), never 422.
        for item in doc["paths"].values():
            for op in item.values():
                responses = op.get("responses", {})
                schema = responses.get("422", {}).get("content", {}).get(JSON_MEDIA, {})
                if schema.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"):
                    del responses["422"]
        for name in ("HTTPValidationError", "ValidationError"):
            comps.pop(name, None)
        for model in BODY_MODELS:
            sch = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, sub in sch.pop("$defs", {}).items():
                comps.setdefault(name, sub)
            comps[model.__name__] = sch
        if api_key:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
    return app


async def _expiry_sweeper(service: SlotTrackerService, settings: Settings) -> None:
    """Force expiry on every tracker now and then every interval; missed ticks are skipped."""
    interval = settings.force_expiry_interval_seconds
    while True:
        try:
            expired = service.expire()
            if expired:
                log.info("expired %d stale requests", expired)
        except Exception:  # never let the sweeper die
            log.exception("expiry sweep failed")
        await asyncio.sleep(interval)
