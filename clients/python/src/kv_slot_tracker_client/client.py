"""``SlotTrackerClient`` (blocking) and ``AsyncSlotTrackerClient`` (asyncio).

Both expose one method per route, made from the route's description in ``Routes``, and the
selection API's routes (``SelectionRoutes``) as the methods of their ``selection`` attribute
(``SelectionClient`` / ``AsyncSelectionClient``, sending through the same connection pool): the
classes differ only in how a ``Call`` is sent (``_send``), so they cannot disagree on a route's
arguments, body, result or errors. To add a route, describe it in ``Routes`` (or
``SelectionRoutes``) and add a line ``name = _blocking(Routes.name)`` / ``name =
_awaiting(Routes.name)`` to the classes below.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, Protocol, Self, TypeVar

import httpx

from kv_slot_tracker_client._call import Call
from kv_slot_tracker_client._routes import ROUTES, Routes
from kv_slot_tracker_client._selection import SELECTION_ROUTES, SelectionRoutes
from kv_slot_tracker_client._signature import adopt
from kv_slot_tracker_client._version import __version__

__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_TIMEOUT",
    "AsyncSelectionClient",
    "AsyncSlotTrackerClient",
    "SelectionClient",
    "SlotTrackerClient",
]

DEFAULT_BASE_URL = "http://127.0.0.1:8091"
DEFAULT_TIMEOUT = 5.0

P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R", Routes, SelectionRoutes)


def _http_options(
    base_url: str,
    timeout: float | httpx.Timeout | None,
    api_key: str | None,
    headers: Mapping[str, str] | None,
) -> dict[str, Any]:
    """The ``httpx.Client`` / ``httpx.AsyncClient`` options of both clients.

    A ``base_url`` without ``http://`` or ``https://`` is refused here: httpx would take
    ``127.0.0.1:8091`` for a scheme and a path, and every call would fail later.
    """
    text = str(base_url)
    scheme = text.partition("://")[0].lower() if "://" in text else ""
    if scheme not in ("http", "https"):
        hint = f" (did you mean 'http://{text}'?)" if not scheme else ""
        raise ValueError(f"base_url must start with http:// or https://, got {text!r}{hint}")
    all_headers = {
        "accept": "application/json",
        "user-agent": f"kv-slot-tracker-client/{__version__}",
        **(headers or {}),
    }
    if api_key:
        all_headers["authorization"] = f"Bearer {api_key}"
    return {"base_url": base_url, "timeout": timeout, "headers": all_headers}


def _blocking(
    build: Callable[Concatenate[R, P], Call[T]],
    owner: str = "SlotTrackerClient",
    routes: R = ROUTES,  # type: ignore[assignment]
) -> Callable[Concatenate[Any, P], T]:
    """The blocking method of ``owner`` sending route ``build`` (a method of ``routes``)."""

    def method(self: _Sends, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._send(build(routes, *args, **kwargs))

    return adopt(method, build, owner)


def _awaiting(
    build: Callable[Concatenate[R, P], Call[T]],
    owner: str = "AsyncSlotTrackerClient",
    routes: R = ROUTES,  # type: ignore[assignment]
) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]:
    """The coroutine method of ``owner`` sending route ``build`` (a method of ``routes``)."""

    async def method(self: _AwaitsSends, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._send(build(routes, *args, **kwargs))

    return adopt(method, build, owner)


class _Sends(Protocol):
    def _send(self, call: Call[T]) -> T: ...


class _AwaitsSends(Protocol):
    async def _send(self, call: Call[T]) -> T: ...


def _selection_blocking(
    build: Callable[Concatenate[SelectionRoutes, P], Call[T]],
) -> Callable[Concatenate[Any, P], T]:
    return _blocking(build, "SelectionClient", SELECTION_ROUTES)


def _selection_awaiting(
    build: Callable[Concatenate[SelectionRoutes, P], Call[T]],
) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]:
    return _awaiting(build, "AsyncSelectionClient", SELECTION_ROUTES)


class SelectionClient:
    """The selection API (``/selection``) of a ``SlotTrackerClient``: ``client.selection``.

    Post workers (``upsert_worker``), let the service choose a rank for each prompt and book it
    (``select_and_reserve``, or ``select`` then ``reserve_pending``; ``reserve`` books on a rank
    of the caller's choice), report the request's progress (``prefill_complete``,
    ``output_block``) and ``free`` it when it finished. Sends through its client's connection
    pool, key and timeout; the errors are the client's, plus ``Unavailable`` (503) when no
    worker of the partition is schedulable.
    """

    def __init__(self, send: Callable[[Call[Any]], Any]) -> None:
        self._send = send

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"

    # probes
    health = _selection_blocking(SelectionRoutes.health)
    ready = _selection_blocking(SelectionRoutes.ready)
    readiness = _selection_blocking(SelectionRoutes.readiness)
    # workers
    upsert_worker = _selection_blocking(SelectionRoutes.upsert_worker)
    workers = _selection_blocking(SelectionRoutes.workers)
    patch_worker = _selection_blocking(SelectionRoutes.patch_worker)
    delete_worker = _selection_blocking(SelectionRoutes.delete_worker)
    # selection and reservations
    select = _selection_blocking(SelectionRoutes.select)
    select_and_reserve = _selection_blocking(SelectionRoutes.select_and_reserve)
    reserve_pending = _selection_blocking(SelectionRoutes.reserve_pending)
    reserve = _selection_blocking(SelectionRoutes.reserve)
    prefill_complete = _selection_blocking(SelectionRoutes.prefill_complete)
    output_block = _selection_blocking(SelectionRoutes.output_block)
    free = _selection_blocking(SelectionRoutes.free)
    # reads
    loads = _selection_blocking(SelectionRoutes.loads)
    potential_loads = _selection_blocking(SelectionRoutes.potential_loads)
    overlap_scores = _selection_blocking(SelectionRoutes.overlap_scores)
    dump = _selection_blocking(SelectionRoutes.dump)
    kv_index = _selection_blocking(SelectionRoutes.kv_index)
    # routing receipts
    receipt = _selection_blocking(SelectionRoutes.receipt)
    receipts = _selection_blocking(SelectionRoutes.receipts)
    explain = _selection_blocking(SelectionRoutes.explain)


class AsyncSelectionClient:
    """The selection API of an ``AsyncSlotTrackerClient`` (``client.selection``): the methods of
    ``SelectionClient``, each a coroutine."""

    def __init__(self, send: Callable[[Call[Any]], Coroutine[Any, Any, Any]]) -> None:
        self._send = send

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"

    # probes
    health = _selection_awaiting(SelectionRoutes.health)
    ready = _selection_awaiting(SelectionRoutes.ready)
    readiness = _selection_awaiting(SelectionRoutes.readiness)
    # workers
    upsert_worker = _selection_awaiting(SelectionRoutes.upsert_worker)
    workers = _selection_awaiting(SelectionRoutes.workers)
    patch_worker = _selection_awaiting(SelectionRoutes.patch_worker)
    delete_worker = _selection_awaiting(SelectionRoutes.delete_worker)
    # selection and reservations
    select = _selection_awaiting(SelectionRoutes.select)
    select_and_reserve = _selection_awaiting(SelectionRoutes.select_and_reserve)
    reserve_pending = _selection_awaiting(SelectionRoutes.reserve_pending)
    reserve = _selection_awaiting(SelectionRoutes.reserve)
    prefill_complete = _selection_awaiting(SelectionRoutes.prefill_complete)
    output_block = _selection_awaiting(SelectionRoutes.output_block)
    free = _selection_awaiting(SelectionRoutes.free)
    # reads
    loads = _selection_awaiting(SelectionRoutes.loads)
    potential_loads = _selection_awaiting(SelectionRoutes.potential_loads)
    overlap_scores = _selection_awaiting(SelectionRoutes.overlap_scores)
    dump = _selection_awaiting(SelectionRoutes.dump)
    kv_index = _selection_awaiting(SelectionRoutes.kv_index)
    # routing receipts
    receipt = _selection_awaiting(SelectionRoutes.receipt)
    receipts = _selection_awaiting(SelectionRoutes.receipts)
    explain = _selection_awaiting(SelectionRoutes.explain)


class SlotTrackerClient:
    """Blocking client of one kv-slot-tracker instance (or a load balancer in front of several).

    ``base_url`` may carry a path prefix (``http://gateway/tracker``) when the service is
    mounted behind one. ``timeout`` (seconds, or an ``httpx.Timeout``; ``None`` waits forever)
    bounds each phase of a request; the 5 s default keeps a stuck tracker from stalling a router
    indefinitely. ``api_key`` is sent as ``Authorization: Bearer <key>`` to services run with
    ``SLOT_TRACKER_API_KEY``. ``transport`` replaces the network (``httpx.MockTransport``,
    ``httpx.WSGITransport``, ...). ``headers`` are added to every request.

    Thread-safe like the ``httpx.Client`` it wraps: share one per process instead of creating one
    per call, which would give up connection reuse. Nothing is retried (see the package
    documentation).
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        api_key: str | None = None,
        transport: httpx.BaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        options = _http_options(base_url, timeout, api_key, headers)
        self._http = httpx.Client(transport=transport, **options)
        self.selection = SelectionClient(self._send)
        """The selection API (``/selection``) through this client's connections."""

    def _send(self, call: Call[T]) -> T:
        try:
            response = self._http.request(**call.request_args())
        except httpx.TransportError as exc:
            return call.failed(exc)
        result = call.read(response)
        page = call.next_page(response)  # a listing in pages: fetch the rest
        while page is not None:
            try:
                response = self._http.request(**page.request_args())
            except httpx.TransportError as exc:
                return page.failed(exc)
            result = page.joined(result, response)
            page = page.next_page(response)
        return result

    @property
    def base_url(self) -> str:
        return str(self._http.base_url)

    def close(self) -> None:
        """Close the pooled connections; the client cannot be used afterwards."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    # topology
    register = _blocking(Routes.register)
    upsert = _blocking(Routes.upsert)
    unregister = _blocking(Routes.unregister)
    heartbeat = _blocking(Routes.heartbeat)
    reconcile = _blocking(Routes.reconcile)
    workers = _blocking(Routes.workers)
    # request lifecycle
    add = _blocking(Routes.add)
    prefill_complete = _blocking(Routes.prefill_complete)
    free = _blocking(Routes.free)
    output_block = _blocking(Routes.output_block)
    batch = _blocking(Routes.batch)
    # reads
    loads = _blocking(Routes.loads)
    potential_loads = _blocking(Routes.potential_loads)
    project_loads = _blocking(Routes.project_loads)
    lora_counts = _blocking(Routes.lora_counts)
    # operations
    health = _blocking(Routes.health)
    ready = _blocking(Routes.ready)
    readiness = _blocking(Routes.readiness)
    replication_status = _blocking(Routes.replication_status)
    metrics = _blocking(Routes.metrics)
    openapi = _blocking(Routes.openapi)
    request = _blocking(Routes.request)


class AsyncSlotTrackerClient:
    """Asynchronous client: the constructor, methods and results of ``SlotTrackerClient``.

    ``transport`` accepts ``httpx.ASGITransport(app=...)`` to call an application in-process.
    Share one instance between the tasks of an event loop; close it with ``aclose()`` or
    ``async with``.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        options = _http_options(base_url, timeout, api_key, headers)
        self._http = httpx.AsyncClient(transport=transport, **options)
        self.selection = AsyncSelectionClient(self._send)
        """The selection API (``/selection``) through this client's connections."""

    async def _send(self, call: Call[T]) -> T:
        try:
            response = await self._http.request(**call.request_args())
        except httpx.TransportError as exc:
            return call.failed(exc)
        result = call.read(response)
        page = call.next_page(response)  # a listing in pages: fetch the rest
        while page is not None:
            try:
                response = await self._http.request(**page.request_args())
            except httpx.TransportError as exc:
                return page.failed(exc)
            result = page.joined(result, response)
            page = page.next_page(response)
        return result

    @property
    def base_url(self) -> str:
        return str(self._http.base_url)

    async def aclose(self) -> None:
        """Close the pooled connections; the client cannot be used afterwards."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    # topology
    register = _awaiting(Routes.register)
    upsert = _awaiting(Routes.upsert)
    unregister = _awaiting(Routes.unregister)
    heartbeat = _awaiting(Routes.heartbeat)
    reconcile = _awaiting(Routes.reconcile)
    workers = _awaiting(Routes.workers)
    # request lifecycle
    add = _awaiting(Routes.add)
    prefill_complete = _awaiting(Routes.prefill_complete)
    free = _awaiting(Routes.free)
    output_block = _awaiting(Routes.output_block)
    batch = _awaiting(Routes.batch)
    # reads
    loads = _awaiting(Routes.loads)
    potential_loads = _awaiting(Routes.potential_loads)
    project_loads = _awaiting(Routes.project_loads)
    lora_counts = _awaiting(Routes.lora_counts)
    # operations
    health = _awaiting(Routes.health)
    ready = _awaiting(Routes.ready)
    readiness = _awaiting(Routes.readiness)
    replication_status = _awaiting(Routes.replication_status)
    metrics = _awaiting(Routes.metrics)
    openapi = _awaiting(Routes.openapi)
    request = _awaiting(Routes.request)
