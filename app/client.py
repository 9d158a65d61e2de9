"""Typed Python client of the kv-slot-tracker HTTP API, synchronous and asynchronous.

``SlotTrackerClient`` and ``AsyncSlotTrackerClient`` expose one method per route and return the
response models of :mod:`app.http.schemas`, so a caller works with validated objects instead of
dicts, and the client cannot drift from what the service documents in its OpenAPI schema.

Design:

* Each method only *describes* its request (a ``_Call``: method, path, body, and how to read the
  answer). Building bodies and reading answers is shared; the two clients differ only in the one
  line that sends the request, so they cannot disagree on semantics.
* One ``httpx.Client`` / ``httpx.AsyncClient`` per instance, kept for the instance's life: a
  router calls the tracker on every request, and reusing keep-alive connections saves a TCP
  handshake per call. Use the client as a context manager, or call ``close()`` / ``aclose()``.
* Every non-success status becomes a typed ``SlotTrackerError`` carrying the HTTP ``status`` and
  the service's ``message`` (the ``error`` field of its JSON body), and every connection failure
  or timeout a ``TransportError``, so callers never handle httpx exceptions directly.
* Nothing is retried: ``/add`` is not idempotent (a repeated request id is a 409), and after a
  timeout the first attempt may or may not have been applied. The caller knows whether a retry is
  safe (a ``Conflict`` on a retried add means the first attempt landed).

Sequence hashes are unsigned 64-bit values in Dynamo, but the API takes them as signed 64-bit
JSON integers (values >= 2^63 as their two's-complement negative). Methods accept either form and
convert (``to_i64``), so hashes computed in Python as ``u64`` can be passed unchanged.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

import httpx
from pydantic import TypeAdapter, ValidationError

from app.http.schemas import (
    I64_MAX,
    I64_MIN,
    U64_MAX,
    BatchResponse,
    BatchResult,
    LoadRow,
    LoraCounts,
    PotentialLoadRow,
    ProjectedLoadRow,
    Rank,
    ReadyBody,
    ReconcileResult,
    ReplicationStatus,
    WorkerRow,
)

__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_ROUTING_GROUP",
    "DEFAULT_TIMEOUT",
    "AsyncSlotTrackerClient",
    "BadRequest",
    "BatchBuilder",
    "BatchResult",
    "Conflict",
    "LoadRow",
    "LoraCounts",
    "NotFound",
    "PotentialLoadRow",
    "ProjectedLoadRow",
    "Rank",
    "ReadyBody",
    "ReconcileResult",
    "ReplicationStatus",
    "ServerError",
    "SlotTrackerClient",
    "SlotTrackerError",
    "TransportError",
    "Unauthorized",
    "WorkerRange",
    "WorkerRow",
    "to_i64",
]

DEFAULT_BASE_URL = "http://127.0.0.1:8091"
DEFAULT_TIMEOUT = 5.0
DEFAULT_ROUTING_GROUP = "default"

T = TypeVar("T")


# -- errors ------------------------------------------------------------------------------------


class SlotTrackerError(Exception):
    """A request the service did not carry out.

    ``status`` is the HTTP status (``None`` when no answer came back), ``message`` the service's
    own explanation (its ``{"error": ...}`` body), ``method`` and ``path`` the request. Statuses
    without a dedicated subclass (405, for instance) raise this class itself.
    """

    def __init__(
        self,
        message: str,
        status: int | None = None,
        *,
        method: str | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.method = method
        self.path = path

    def __str__(self) -> str:
        where = f"{self.method} {self.path}" if self.method and self.path else ""
        code = f" -> {self.status}" if self.status is not None else ""
        prefix = f"{where}{code}: " if where or code else ""
        return f"{prefix}{self.message}"


class BadRequest(SlotTrackerError):
    """400, 413, 415 or 422: the request itself is wrong (bad value, shape, size or type).

    Retrying the same request cannot succeed; the message says which field is at fault.
    """


class Unauthorized(SlotTrackerError):
    """401: the service requires a bearer key and ``api_key`` is missing or wrong."""


class NotFound(SlotTrackerError):
    """404: no such tracker (model and routing group), worker, rank or request.

    A 404 for a request id usually means it was already freed or expired, which a caller may
    treat as done.
    """


class Conflict(SlotTrackerError):
    """409: contradicts the current state (worker already registered, request id already
    active, or a block size different from the tracker's)."""


class ServerError(SlotTrackerError):
    """5xx: the service failed; the same request may succeed later."""


class TransportError(SlotTrackerError):
    """No answer: connection refused or reset, DNS failure, or a timeout (``timed_out``).

    Wraps the ``httpx`` exception (available as ``__cause__``). For a mutation the outcome is
    unknown: the service may have applied it before the connection broke.
    """

    def __init__(
        self,
        message: str,
        *,
        method: str | None = None,
        path: str | None = None,
        timed_out: bool = False,
    ) -> None:
        super().__init__(message, None, method=method, path=path)
        self.timed_out = timed_out


_ERRORS_BY_STATUS: dict[int, type[SlotTrackerError]] = {
    400: BadRequest,
    413: BadRequest,
    415: BadRequest,
    422: BadRequest,
    401: Unauthorized,
    404: NotFound,
    409: Conflict,
}


def _error_class(status: int) -> type[SlotTrackerError]:
    if status >= 500:
        return ServerError
    return _ERRORS_BY_STATUS.get(status, SlotTrackerError)


def _service_message(response: httpx.Response) -> str:
    """The ``error`` of a JSON error body; else the body text; else the reason phrase."""
    try:
        body = response.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, str):
        return error
    text = response.text.strip()
    return text or response.reason_phrase or f"HTTP {response.status_code}"


def _error_from_response(response: httpx.Response) -> SlotTrackerError:
    request = response.request
    return _error_class(response.status_code)(
        _service_message(response),
        response.status_code,
        method=request.method,
        path=request.url.path,
    )


def _raise_for_status(response: httpx.Response) -> None:
    if not response.is_success:
        raise _error_from_response(response)


# -- request bodies ----------------------------------------------------------------------------


def to_i64(value: int) -> int:
    """A sequence hash in the signed 64-bit form the API takes.

    Accepts unsigned (0 .. 2^64-1) and signed (-2^63 .. 2^63-1) values: values >= 2^63 become
    ``value - 2^64``, the same 64 bits read as signed, which the service reinterprets as unsigned
    again. Rejects booleans and non-integers (``TypeError``) and values outside both ranges
    (``ValueError``) here, where the mistake is, rather than as a 422 from the service.
    """
    if isinstance(value, bool):
        raise TypeError("a sequence hash must be an integer, not a bool")
    v = operator.index(value)
    if v < I64_MIN or v > U64_MAX:
        raise ValueError(f"sequence hash {v} is outside both the i64 and the u64 range")
    return v - (1 << 64) if v > I64_MAX else v


def _hashes(values: Iterable[int] | None) -> list[int] | None:
    return None if values is None else [to_i64(v) for v in values]


def _tokens(values: Iterable[int] | None) -> list[int] | None:
    return None if values is None else list(values)


def _without_none(body: dict[str, Any]) -> dict[str, Any]:
    """Drop unset optional fields: the service rejects an explicit ``null`` for most of them."""
    return {k: v for k, v in body.items() if v is not None}


class WorkerRange(Protocol):
    """Anything with ``worker_id``, ``dp_start`` and ``dp_size``, such as the ``WorkerRow``s of
    ``workers()`` or ``app.http.schemas.ReconcileWorker``."""

    @property
    def worker_id(self) -> int: ...

    @property
    def dp_start(self) -> int: ...

    @property
    def dp_size(self) -> int: ...


def _worker_range(w: WorkerRange | tuple[int, int, int]) -> dict[str, int]:
    if isinstance(w, tuple):
        worker_id, dp_start, dp_size = w
    else:
        worker_id, dp_start, dp_size = w.worker_id, w.dp_start, w.dp_size
    return {"worker_id": worker_id, "dp_start": dp_start, "dp_size": dp_size}


def _topology_body(
    model_name: str,
    routing_group: str,
    worker_id: int,
    block_size: int,
    dp_start: int,
    dp_size: int,
) -> dict[str, Any]:
    return {
        "worker_id": worker_id,
        "model_name": model_name,
        "routing_group": routing_group,
        "block_size": block_size,
        "dp_start": dp_start,
        "dp_size": dp_size,
    }


def _add_body(
    model_name: str,
    request_id: str,
    worker_id: int,
    dp_rank: int,
    sequence_hashes: Iterable[int] | None,
    token_ids: Iterable[int] | None,
    new_isl_tokens: int,
    expected_prefill_ms: float | None,
    track_prefill_tokens: bool | None,
    expected_output_tokens: int | None,
    lora_name: str | None,
    routing_group: str,
) -> dict[str, Any]:
    return _without_none(
        {
            "model_name": model_name,
            "routing_group": routing_group,
            "request_id": request_id,
            "worker_id": worker_id,
            "dp_rank": dp_rank,
            "sequence_hashes": _hashes(sequence_hashes),
            "token_ids": _tokens(token_ids),
            "new_isl_tokens": new_isl_tokens,
            "expected_prefill_ms": expected_prefill_ms,
            "track_prefill_tokens": track_prefill_tokens,
            "expected_output_tokens": expected_output_tokens,
            "lora_name": lora_name,
        }
    )


def _request_body(model_name: str, request_id: str, routing_group: str) -> dict[str, Any]:
    return {"model_name": model_name, "routing_group": routing_group, "request_id": request_id}


def _output_block_body(
    model_name: str, request_id: str, decay_fraction: float | None, routing_group: str
) -> dict[str, Any]:
    body = _request_body(model_name, request_id, routing_group)
    if decay_fraction is not None:
        body["decay_fraction"] = decay_fraction
    return body


def _prompt_body(
    model_name: str,
    routing_group: str,
    sequence_hashes: Iterable[int] | None,
    token_ids: Iterable[int] | None,
    lora_name: str | None,
) -> dict[str, Any]:
    return _without_none(
        {
            "model_name": model_name,
            "routing_group": routing_group,
            "sequence_hashes": _hashes(sequence_hashes),
            "token_ids": _tokens(token_ids),
            "lora_name": lora_name,
        }
    )


def _filters(model_name: str | None, routing_group: str | None) -> dict[str, str]:
    return _without_none({"model_name": model_name, "routing_group": routing_group})


# -- batch builder -----------------------------------------------------------------------------


class BatchBuilder:
    """Collects lifecycle operations for one ``/batch`` call.

    A router that frees and adds many requests per scheduling step saves a round trip per
    operation. The service applies the operations in order, each on its own (a failing one
    neither stops nor undoes the others), and ``client.batch(builder)`` returns one
    ``BatchResult`` per operation, in the order they were queued here. The methods take the same
    arguments as the client's and return the builder, so calls chain::

        client.batch(BatchBuilder().free("m", "r0").add("m", "r1", 1, 0, [1, 2]))
    """

    def __init__(self) -> None:
        self._operations: list[dict[str, Any]] = []

    def add(
        self,
        model_name: str,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: Iterable[int] | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        new_isl_tokens: int = 0,
        expected_prefill_ms: float | None = None,
        track_prefill_tokens: bool | None = None,
        expected_output_tokens: int | None = None,
        lora_name: str | None = None,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> Self:
        """Queue an ``add`` (see ``SlotTrackerClient.add``); its result status is 201."""
        body = _add_body(
            model_name,
            request_id,
            worker_id,
            dp_rank,
            sequence_hashes,
            token_ids,
            new_isl_tokens,
            expected_prefill_ms,
            track_prefill_tokens,
            expected_output_tokens,
            lora_name,
            routing_group,
        )
        self._operations.append({"op": "add", **body})
        return self

    def prefill_complete(
        self, model_name: str, request_id: str, *, routing_group: str = DEFAULT_ROUTING_GROUP
    ) -> Self:
        """Queue a ``prefill_complete``."""
        body = _request_body(model_name, request_id, routing_group)
        self._operations.append({"op": "prefill_complete", **body})
        return self

    def free(
        self, model_name: str, request_id: str, *, routing_group: str = DEFAULT_ROUTING_GROUP
    ) -> Self:
        """Queue a ``free`` (succeeds for unknown request ids too)."""
        body = _request_body(model_name, request_id, routing_group)
        self._operations.append({"op": "free", **body})
        return self

    def output_block(
        self,
        model_name: str,
        request_id: str,
        decay_fraction: float | None = None,
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> Self:
        """Queue an ``output_block``."""
        body = _output_block_body(model_name, request_id, decay_fraction, routing_group)
        self._operations.append({"op": "output_block", **body})
        return self

    @property
    def operations(self) -> list[dict[str, Any]]:
        """A copy of the queued operations, as they are sent."""
        return [dict(op) for op in self._operations]

    def clear(self) -> None:
        """Forget the queued operations, to reuse the builder for the next step."""
        self._operations.clear()

    def __len__(self) -> int:
        return len(self._operations)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.operations)

    def __repr__(self) -> str:
        return f"BatchBuilder({len(self._operations)} operations)"


# -- reading answers ---------------------------------------------------------------------------

_WORKERS = TypeAdapter(list[WorkerRow])
_LOADS = TypeAdapter(list[LoadRow])
_POTENTIAL = TypeAdapter(list[PotentialLoadRow])
_PROJECTED = TypeAdapter(list[ProjectedLoadRow])
_RECONCILE = TypeAdapter(ReconcileResult)
_LORA = TypeAdapter(LoraCounts)
_BATCH = TypeAdapter(BatchResponse)
_READY = TypeAdapter(ReadyBody)
_REPLICATION = TypeAdapter(ReplicationStatus)


def _validated(adapter: TypeAdapter[T], response: httpx.Response) -> T:
    try:
        return adapter.validate_json(response.content)
    except ValidationError as exc:
        # A 2xx whose body does not match the service's own schema: most likely not a
        # kv-slot-tracker behind base_url, or an incompatible version.
        first = exc.errors(include_url=False)[0]
        request = response.request
        raise SlotTrackerError(
            f"unexpected response body: {first['msg']} at {list(first['loc'])}",
            response.status_code,
            method=request.method,
            path=request.url.path,
        ) from exc


def _reader(adapter: TypeAdapter[T]) -> Callable[[httpx.Response], T]:
    """Reader of a success body validated against ``adapter``."""

    def read(response: httpx.Response) -> T:
        _raise_for_status(response)
        return _validated(adapter, response)

    return read


def _no_content(response: httpx.Response) -> None:
    _raise_for_status(response)


def _created(response: httpx.Response) -> bool:
    _raise_for_status(response)
    return response.status_code == 201


def _raw(response: httpx.Response) -> httpx.Response:
    _raise_for_status(response)
    return response


def _text(response: httpx.Response) -> str:
    _raise_for_status(response)
    return response.text


def _probe(response: httpx.Response) -> bool:
    """2xx: yes; 5xx (503 = not ready): no. A 4xx means a wrong base_url or route rather than a
    state of the service, so it raises instead of reading as "not up yet" forever."""
    if response.is_success:
        return True
    if response.status_code >= 500:
        return False
    raise _error_from_response(response)


def _readiness(response: httpx.Response) -> ReadyBody:
    if response.status_code == 503:  # not ready is a valid readiness answer, not an error
        return _validated(_READY, response)
    return _reader(_READY)(response)


def _batch_results(response: httpx.Response) -> list[BatchResult]:
    return _reader(_BATCH)(response).results


@dataclass(frozen=True, slots=True)
class _Call(Generic[T]):
    """One request and how to read its answer; the clients only perform the I/O."""

    method: str
    path: str
    read: Callable[[httpx.Response], T]
    json: Any = None
    params: Mapping[str, str] | None = None
    content: bytes | None = None
    headers: Mapping[str, str] | None = None
    # What to return instead of raising when no answer comes back (the probes).
    unreachable: Callable[[], T] | None = None

    def send_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"params": self.params, "headers": self.headers}
        if self.content is not None:
            args["content"] = self.content
        elif self.json is not None:
            args["json"] = self.json
        return args

    def failed(self, exc: httpx.TransportError) -> T:
        """The outcome of a request that got no answer: the probe value or a TransportError."""
        if self.unreachable is not None:
            return self.unreachable()
        timed_out = isinstance(exc, httpx.TimeoutException)
        detail = str(exc) or type(exc).__name__
        raise TransportError(
            f"{'timed out' if timed_out else 'connection failed'}: {detail}",
            method=self.method,
            path=self.path,
            timed_out=timed_out,
        ) from exc


def _post(path: str, body: Any, read: Callable[[httpx.Response], T]) -> _Call[T]:
    return _Call("POST", path, read, json=body)


def _get(
    path: str, params: Mapping[str, str] | None, read: Callable[[httpx.Response], T]
) -> _Call[T]:
    return _Call("GET", path, read, params=params)


def _false() -> bool:
    return False


class _Calls:
    """One builder per route, each returning the ``_Call`` both clients send."""

    @staticmethod
    def register(body: dict[str, Any]) -> _Call[None]:
        return _post("/register", body, _no_content)

    @staticmethod
    def upsert(body: dict[str, Any]) -> _Call[bool]:
        return _post("/upsert", body, _created)

    @staticmethod
    def unregister(worker_id: int, model_name: str, routing_group: str) -> _Call[None]:
        body = {"worker_id": worker_id, "model_name": model_name, "routing_group": routing_group}
        return _post("/unregister", body, _no_content)

    @staticmethod
    def reconcile(
        model_name: str,
        block_size: int,
        workers: Iterable[WorkerRange | tuple[int, int, int]],
        routing_group: str,
    ) -> _Call[ReconcileResult]:
        body = {
            "model_name": model_name,
            "routing_group": routing_group,
            "block_size": block_size,
            "workers": [_worker_range(w) for w in workers],
        }
        return _post("/reconcile", body, _reader(_RECONCILE))

    @staticmethod
    def workers(model_name: str | None, routing_group: str | None) -> _Call[list[WorkerRow]]:
        return _get("/workers", _filters(model_name, routing_group), _reader(_WORKERS))

    @staticmethod
    def add(body: dict[str, Any]) -> _Call[None]:
        return _post("/add", body, _no_content)

    @staticmethod
    def prefill_complete(model_name: str, request_id: str, routing_group: str) -> _Call[None]:
        body = _request_body(model_name, request_id, routing_group)
        return _post("/prefill_complete", body, _no_content)

    @staticmethod
    def free(model_name: str, request_id: str, routing_group: str) -> _Call[None]:
        return _post("/free", _request_body(model_name, request_id, routing_group), _no_content)

    @staticmethod
    def output_block(
        model_name: str, request_id: str, decay_fraction: float | None, routing_group: str
    ) -> _Call[None]:
        body = _output_block_body(model_name, request_id, decay_fraction, routing_group)
        return _post("/output_block", body, _no_content)

    @staticmethod
    def batch(operations: BatchBuilder | Iterable[Mapping[str, Any]]) -> _Call[list[BatchResult]]:
        if isinstance(operations, BatchBuilder):
            ops = operations.operations
        else:
            ops = [dict(op) for op in operations]
        return _post("/batch", {"operations": ops}, _batch_results)

    @staticmethod
    def loads(model_name: str | None, routing_group: str | None) -> _Call[list[LoadRow]]:
        return _get("/loads", _filters(model_name, routing_group), _reader(_LOADS))

    @staticmethod
    def potential_loads(body: dict[str, Any], new_isl_tokens: int) -> _Call[list[PotentialLoadRow]]:
        body = {**body, "new_isl_tokens": new_isl_tokens}
        return _post("/potential_loads", body, _reader(_POTENTIAL))

    @staticmethod
    def project_loads(body: dict[str, Any]) -> _Call[list[ProjectedLoadRow]]:
        return _post("/project_loads", body, _reader(_PROJECTED))

    @staticmethod
    def lora_counts(model_name: str, routing_group: str) -> _Call[LoraCounts]:
        params = {"model_name": model_name, "routing_group": routing_group}
        return _get("/lora_counts", params, _reader(_LORA))

    @staticmethod
    def health() -> _Call[bool]:
        return _Call("GET", "/health", _probe, unreachable=_false)

    @staticmethod
    def ready() -> _Call[bool]:
        return _Call("GET", "/ready", _probe, unreachable=_false)

    @staticmethod
    def readiness() -> _Call[ReadyBody]:
        return _get("/ready", None, _readiness)

    @staticmethod
    def replication_status() -> _Call[ReplicationStatus]:
        return _get("/replication", None, _reader(_REPLICATION))

    @staticmethod
    def metrics() -> _Call[str]:
        return _get("/metrics", None, _text)

    @staticmethod
    def request(
        method: str,
        path: str,
        json: Any,
        params: Mapping[str, str] | None,
        content: bytes | None,
        headers: Mapping[str, str] | None,
    ) -> _Call[httpx.Response]:
        return _Call(method.upper(), path, _raw, json, params, content, headers)


def _http_options(
    base_url: str,
    timeout: float | httpx.Timeout | None,
    api_key: str | None,
    headers: Mapping[str, str] | None,
) -> dict[str, Any]:
    all_headers = {"accept": "application/json", **(headers or {})}
    if api_key:
        all_headers["authorization"] = f"Bearer {api_key}"
    return {"base_url": base_url, "timeout": timeout, "headers": all_headers}


# -- clients -----------------------------------------------------------------------------------


class SlotTrackerClient:
    """Blocking client of one kv-slot-tracker instance (or a load balancer in front of several).

    ``base_url`` may carry a path prefix (``http://gateway/tracker``) when the service is
    mounted behind one. ``timeout`` (seconds, or an ``httpx.Timeout``; ``None`` waits forever)
    bounds each phase of a request; the 5 s default keeps a stuck tracker from stalling a router
    indefinitely. ``api_key`` is sent as ``Authorization: Bearer <key>`` to services run with
    ``SLOT_TRACKER_API_KEY``. ``transport`` replaces the network (``httpx.MockTransport``,
    ``httpx.WSGITransport``, ...). ``headers`` are added to every request.

    Thread-safe like the ``httpx.Client`` it wraps: share one per process instead of creating one
    per call, which would give up connection reuse.
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

    def _send(self, call: _Call[T]) -> T:
        try:
            response = self._http.request(call.method, call.path, **call.send_args())
        except httpx.TransportError as exc:
            return call.failed(exc)
        return call.read(response)

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

    # -- topology

    def register(
        self,
        worker_id: int,
        model_name: str,
        block_size: int,
        dp_start: int = 0,
        dp_size: int = 1,
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> None:
        """Register a worker's data-parallel ranks ``dp_start .. dp_start + dp_size - 1``.

        The first worker of a ``(model_name, routing_group)`` creates its tracker and fixes its
        ``block_size``. Raises ``Conflict`` when the worker is already registered or the block
        size differs; use ``upsert`` where announcing a worker twice must be harmless.
        """
        body = _topology_body(model_name, routing_group, worker_id, block_size, dp_start, dp_size)
        self._send(_Calls.register(body))

    def upsert(
        self,
        worker_id: int,
        model_name: str,
        block_size: int,
        dp_start: int = 0,
        dp_size: int = 1,
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> bool:
        """Register a worker or replace its ranks; True when the worker id was new.

        Idempotent, so a worker can announce itself on every (re)start. Ranks it no longer has
        are dropped with their requests; the ranks it keeps keep their load.
        """
        body = _topology_body(model_name, routing_group, worker_id, block_size, dp_start, dp_size)
        return self._send(_Calls.upsert(body))

    def unregister(
        self, worker_id: int, model_name: str, *, routing_group: str = DEFAULT_ROUTING_GROUP
    ) -> None:
        """Remove a worker with all its ranks and requests (``NotFound`` when not registered).

        Removing the last worker drops the tracker, so the next registration may pick another
        block size.
        """
        self._send(_Calls.unregister(worker_id, model_name, routing_group))

    def reconcile(
        self,
        model_name: str,
        block_size: int,
        workers: Iterable[WorkerRange | tuple[int, int, int]],
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> ReconcileResult:
        """Make ``workers`` the tracker's whole topology; returns the ranks added and removed.

        For a controller that periodically lists the live workers from its discovery service:
        workers missing from the list are removed, new ones added, changed ranges updated.
        ``workers`` holds ``(worker_id, dp_start, dp_size)`` tuples or objects with those
        attributes, such as the rows of ``workers()``.
        """
        return self._send(_Calls.reconcile(model_name, block_size, workers, routing_group))

    def workers(
        self, model_name: str | None = None, routing_group: str | None = None
    ) -> list[WorkerRow]:
        """Registered workers sorted by model, routing group and worker id; a ``None`` filter
        matches everything."""
        return self._send(_Calls.workers(model_name, routing_group))

    # -- request lifecycle

    def add(
        self,
        model_name: str,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: Iterable[int] | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        new_isl_tokens: int = 0,
        expected_prefill_ms: float | None = None,
        track_prefill_tokens: bool | None = None,
        expected_output_tokens: int | None = None,
        lora_name: str | None = None,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> None:
        """Record a request routed to ``(worker_id, dp_rank)``.

        Give the prompt either as ``sequence_hashes`` (block hashes, u64 or i64) or as
        ``token_ids`` (the service then hashes the full blocks itself, as Dynamo does, with
        ``lora_name``). ``new_isl_tokens`` are the prompt tokens still to prefill on that rank
        (those not cached there); with ``expected_prefill_ms`` they decay linearly over that
        time instead of counting fully until ``prefill_complete``. ``track_prefill_tokens``
        defaults to ``new_isl_tokens > 0``. Raises ``NotFound`` for an unknown tracker or rank
        and ``Conflict`` for a request id already active in the tracker.
        """
        body = _add_body(
            model_name,
            request_id,
            worker_id,
            dp_rank,
            sequence_hashes,
            token_ids,
            new_isl_tokens,
            expected_prefill_ms,
            track_prefill_tokens,
            expected_output_tokens,
            lora_name,
            routing_group,
        )
        self._send(_Calls.add(body))

    def prefill_complete(
        self, model_name: str, request_id: str, *, routing_group: str = DEFAULT_ROUTING_GROUP
    ) -> None:
        """The request's prefill is done: its prefill tokens stop counting, its blocks stay."""
        self._send(_Calls.prefill_complete(model_name, request_id, routing_group))

    def free(
        self, model_name: str, request_id: str, *, routing_group: str = DEFAULT_ROUTING_GROUP
    ) -> None:
        """The request finished: release its blocks and tokens.

        Succeeds for unknown or already freed ids too, so a router may free unconditionally;
        only an unknown tracker raises ``NotFound``.
        """
        self._send(_Calls.free(model_name, request_id, routing_group))

    def output_block(
        self,
        model_name: str,
        request_id: str,
        decay_fraction: float | None = None,
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> None:
        """The request generated another full block of output, which now occupies KV cache.

        ``decay_fraction`` (0..1) weights the blocks held only by this request, for requests
        expected to finish soon; ``None`` counts them fully.
        """
        self._send(_Calls.output_block(model_name, request_id, decay_fraction, routing_group))

    def batch(self, operations: BatchBuilder | Iterable[Mapping[str, Any]]) -> list[BatchResult]:
        """Apply many lifecycle operations in one round trip; one result per operation, in order.

        A failed operation does not raise: check each result's ``status`` (201 for an add, 200
        for the others) and ``error``. ``operations`` is a ``BatchBuilder`` or raw dicts with an
        ``op`` field, sent as they are (without hash conversion).
        """
        return self._send(_Calls.batch(operations))

    # -- reads

    def loads(
        self, model_name: str | None = None, routing_group: str | None = None
    ) -> list[LoadRow]:
        """Current load of every matching rank, sorted by model, group, worker and rank."""
        return self._send(_Calls.loads(model_name, routing_group))

    def potential_loads(
        self,
        model_name: str,
        sequence_hashes: Iterable[int] | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        lora_name: str | None = None,
        new_isl_tokens: int = 0,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> list[PotentialLoadRow]:
        """Every rank's load if this prompt went there: the input of a routing decision.

        ``potential_decode_blocks`` adds the prompt's blocks not already active on the rank
        (prefix overlap); ``potential_prefill_tokens`` adds ``new_isl_tokens`` on every rank.
        The rows come in no particular order.
        """
        body = _prompt_body(model_name, routing_group, sequence_hashes, token_ids, lora_name)
        return self._send(_Calls.potential_loads(body, new_isl_tokens))

    def project_loads(
        self,
        model_name: str,
        sequence_hashes: Iterable[int] | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        lora_name: str | None = None,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> list[ProjectedLoadRow]:
        """Every rank's current load and the blocks this prompt would add there, sorted by
        worker and rank."""
        body = _prompt_body(model_name, routing_group, sequence_hashes, token_ids, lora_name)
        return self._send(_Calls.project_loads(body))

    def lora_counts(
        self, model_name: str, *, routing_group: str = DEFAULT_ROUTING_GROUP
    ) -> LoraCounts:
        """Active requests per LoRA adapter in one tracker (``NotFound`` for an unknown one)."""
        return self._send(_Calls.lora_counts(model_name, routing_group))

    # -- operations

    def health(self) -> bool:
        """Liveness: True when the process answers. Returns False rather than raising when it
        is unreachable or failing, so it can drive a wait loop."""
        return self._send(_Calls.health())

    def ready(self) -> bool:
        """Readiness: True once the instance serves consistent state (with Redis replication,
        after catching up). False when not ready or unreachable."""
        return self._send(_Calls.ready())

    def readiness(self) -> ReadyBody:
        """The readiness answer, with the ``reason`` when not ready (503 does not raise)."""
        return self._send(_Calls.readiness())

    def replication_status(self) -> ReplicationStatus:
        """Replication state of the instance: ``mode`` plus the mode's counters as extra
        fields."""
        return self._send(_Calls.replication_status())

    def metrics(self) -> str:
        """The Prometheus exposition text of ``/metrics``."""
        return self._send(_Calls.metrics())

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """Send any request with this client's connection, key and error mapping; returns the
        raw response on success. For routes this client does not wrap (yet)."""
        return self._send(_Calls.request(method, path, json, params, content, headers))


class AsyncSlotTrackerClient:
    """Asynchronous client: the constructor, methods and results of ``SlotTrackerClient``.

    ``transport`` accepts ``httpx.ASGITransport(app=...)`` to call an application in-process.
    Share one instance between the tasks of an event loop.
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

    async def _send(self, call: _Call[T]) -> T:
        try:
            response = await self._http.request(call.method, call.path, **call.send_args())
        except httpx.TransportError as exc:
            return call.failed(exc)
        return call.read(response)

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

    # The methods below are documented on SlotTrackerClient.

    async def register(
        self,
        worker_id: int,
        model_name: str,
        block_size: int,
        dp_start: int = 0,
        dp_size: int = 1,
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> None:
        """See ``SlotTrackerClient.register``."""
        body = _topology_body(model_name, routing_group, worker_id, block_size, dp_start, dp_size)
        await self._send(_Calls.register(body))

    async def upsert(
        self,
        worker_id: int,
        model_name: str,
        block_size: int,
        dp_start: int = 0,
        dp_size: int = 1,
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> bool:
        """See ``SlotTrackerClient.upsert``."""
        body = _topology_body(model_name, routing_group, worker_id, block_size, dp_start, dp_size)
        return await self._send(_Calls.upsert(body))

    async def unregister(
        self, worker_id: int, model_name: str, *, routing_group: str = DEFAULT_ROUTING_GROUP
    ) -> None:
        """See ``SlotTrackerClient.unregister``."""
        await self._send(_Calls.unregister(worker_id, model_name, routing_group))

    async def reconcile(
        self,
        model_name: str,
        block_size: int,
        workers: Iterable[WorkerRange | tuple[int, int, int]],
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> ReconcileResult:
        """See ``SlotTrackerClient.reconcile``."""
        return await self._send(_Calls.reconcile(model_name, block_size, workers, routing_group))

    async def workers(
        self, model_name: str | None = None, routing_group: str | None = None
    ) -> list[WorkerRow]:
        """See ``SlotTrackerClient.workers``."""
        return await self._send(_Calls.workers(model_name, routing_group))

    async def add(
        self,
        model_name: str,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: Iterable[int] | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        new_isl_tokens: int = 0,
        expected_prefill_ms: float | None = None,
        track_prefill_tokens: bool | None = None,
        expected_output_tokens: int | None = None,
        lora_name: str | None = None,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> None:
        """See ``SlotTrackerClient.add``."""
        body = _add_body(
            model_name,
            request_id,
            worker_id,
            dp_rank,
            sequence_hashes,
            token_ids,
            new_isl_tokens,
            expected_prefill_ms,
            track_prefill_tokens,
            expected_output_tokens,
            lora_name,
            routing_group,
        )
        await self._send(_Calls.add(body))

    async def prefill_complete(
        self, model_name: str, request_id: str, *, routing_group: str = DEFAULT_ROUTING_GROUP
    ) -> None:
        """See ``SlotTrackerClient.prefill_complete``."""
        await self._send(_Calls.prefill_complete(model_name, request_id, routing_group))

    async def free(
        self, model_name: str, request_id: str, *, routing_group: str = DEFAULT_ROUTING_GROUP
    ) -> None:
        """See ``SlotTrackerClient.free``."""
        await self._send(_Calls.free(model_name, request_id, routing_group))

    async def output_block(
        self,
        model_name: str,
        request_id: str,
        decay_fraction: float | None = None,
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> None:
        """See ``SlotTrackerClient.output_block``."""
        await self._send(_Calls.output_block(model_name, request_id, decay_fraction, routing_group))

    async def batch(
        self, operations: BatchBuilder | Iterable[Mapping[str, Any]]
    ) -> list[BatchResult]:
        """See ``SlotTrackerClient.batch``."""
        return await self._send(_Calls.batch(operations))

    async def loads(
        self, model_name: str | None = None, routing_group: str | None = None
    ) -> list[LoadRow]:
        """See ``SlotTrackerClient.loads``."""
        return await self._send(_Calls.loads(model_name, routing_group))

    async def potential_loads(
        self,
        model_name: str,
        sequence_hashes: Iterable[int] | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        lora_name: str | None = None,
        new_isl_tokens: int = 0,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> list[PotentialLoadRow]:
        """See ``SlotTrackerClient.potential_loads``."""
        body = _prompt_body(model_name, routing_group, sequence_hashes, token_ids, lora_name)
        return await self._send(_Calls.potential_loads(body, new_isl_tokens))

    async def project_loads(
        self,
        model_name: str,
        sequence_hashes: Iterable[int] | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        lora_name: str | None = None,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> list[ProjectedLoadRow]:
        """See ``SlotTrackerClient.project_loads``."""
        body = _prompt_body(model_name, routing_group, sequence_hashes, token_ids, lora_name)
        return await self._send(_Calls.project_loads(body))

    async def lora_counts(
        self, model_name: str, *, routing_group: str = DEFAULT_ROUTING_GROUP
    ) -> LoraCounts:
        """See ``SlotTrackerClient.lora_counts``."""
        return await self._send(_Calls.lora_counts(model_name, routing_group))

    async def health(self) -> bool:
        """See ``SlotTrackerClient.health``."""
        return await self._send(_Calls.health())

    async def ready(self) -> bool:
        """See ``SlotTrackerClient.ready``."""
        return await self._send(_Calls.ready())

    async def readiness(self) -> ReadyBody:
        """See ``SlotTrackerClient.readiness``."""
        return await self._send(_Calls.readiness())

    async def replication_status(self) -> ReplicationStatus:
        """See ``SlotTrackerClient.replication_status``."""
        return await self._send(_Calls.replication_status())

    async def metrics(self) -> str:
        """See ``SlotTrackerClient.metrics``."""
        return await self._send(_Calls.metrics())

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """See ``SlotTrackerClient.request``."""
        return await self._send(_Calls.request(method, path, json, params, content, headers))
