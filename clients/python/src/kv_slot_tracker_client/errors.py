"""The exceptions of the client, and the one place that maps an HTTP outcome to them.

Every non-success status becomes a ``SlotTrackerError`` carrying the HTTP ``status`` and the
service's ``message`` (the ``error`` field of its JSON body); every connection failure or
timeout a ``TransportError``. Callers never handle httpx exceptions directly.
"""

from __future__ import annotations

import httpx
from pydantic import ValidationError

__all__ = [
    "BadRequest",
    "Conflict",
    "NotFound",
    "ServerError",
    "SlotTrackerError",
    "TransportError",
    "Unauthorized",
    "Unavailable",
]


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


class Unavailable(ServerError):
    """503: the service cannot serve the request now. The selection API answers it when no
    worker of the partition is schedulable (unknown model or routing group, no worker posted,
    or none with an endpoint and a block size); the same request succeeds once one is."""


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
    503: Unavailable,
}


def error_class(status: int) -> type[SlotTrackerError]:
    """The exception class of an HTTP error status."""
    if status in _ERRORS_BY_STATUS:
        return _ERRORS_BY_STATUS[status]
    return ServerError if status >= 500 else SlotTrackerError


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


def error_from_response(response: httpx.Response) -> SlotTrackerError:
    """The exception for an answer with an error status."""
    request = response.request
    return error_class(response.status_code)(
        _service_message(response),
        response.status_code,
        method=request.method,
        path=request.url.path,
    )


def unexpected_body(response: httpx.Response, exc: ValidationError) -> SlotTrackerError:
    """The exception for a success answer whose body does not match the service's schema: most
    likely no kv-slot-tracker behind ``base_url``, or an incompatible version."""
    first = exc.errors(include_url=False)[0]
    request = response.request
    return SlotTrackerError(
        f"unexpected response body: {first['msg']} at {list(first['loc'])}",
        response.status_code,
        method=request.method,
        path=request.url.path,
    )


def transport_error(exc: httpx.TransportError, method: str, path: str) -> TransportError:
    """The exception for a request that got no answer."""
    timed_out = isinstance(exc, httpx.TimeoutException)
    detail = str(exc) or type(exc).__name__
    return TransportError(
        f"{'timed out' if timed_out else 'connection failed'}: {detail}",
        method=method,
        path=path,
        timed_out=timed_out,
    )
