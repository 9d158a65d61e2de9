"""The one place where errors become HTTP: a table from error class to status (and text).

Below the edge only domain errors exist (``kv_slot_tracker.core.errors``, ``kv_slot_tracker.service.errors``); the edge's
own errors (body too large, not JSON, malformed JSON, wrong shape) are ``HttpError``s raised by
``kv_slot_tracker.http.body``. ``describe`` turns any of them into ``(status, message)``; the messages are the
reference service's texts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from kv_slot_tracker.core import errors as core
from kv_slot_tracker.core.selection import errors as sel
from kv_slot_tracker.service import errors as svc

# The reference's fixed prefixes (serde / axum rejections).
JSON_PARSE = "Failed to parse the request body as JSON: "
JSON_SHAPE = "Failed to deserialize the JSON body into the target type: "
QUERY_SHAPE = "Failed to deserialize query string: "
CONTENT_TYPE = "Expected request with `Content-Type: application/json`"
TOO_LARGE = "Failed to buffer the request body: length limit exceeded"
ROUTE_NOT_FOUND = "route not found"
METHOD_NOT_ALLOWED = "method not allowed"
INTERNAL_ERROR = "internal error"
UNAUTHORIZED = "missing or invalid bearer key"


class HttpError(Exception):
    """An error of the HTTP edge itself (body, content type, shape, query string, limits)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def query_error(detail: str) -> HttpError:
    return HttpError(400, QUERY_SHAPE + detail)


def _text(e: Exception) -> str:
    return str(e)


# Error class -> (status, message). Domain errors whose own text is the API's use it as is.
STATUS: dict[type[Exception], tuple[int, Callable[[Any], str]]] = {
    svc.NoTracker: (404, _text),
    svc.UnknownWorker: (404, _text),
    core.WorkerNotFound: (404, _text),
    core.RequestNotFound: (404, _text),
    svc.WorkerExists: (409, _text),
    svc.BlockSizeMismatch: (409, _text),
    core.DuplicateRequest: (409, _text),
    svc.InvalidTopology: (400, _text),
    svc.TooManyRanks: (400, _text),
    core.InvalidDpSize: (400, lambda e: "dp_size must be greater than 0"),
    core.InvalidDpRange: (
        400,
        lambda e: f"dp range overflows u32: start={e.dp_start} size={e.dp_size}",
    ),
    svc.TooManyHashes: (422, _text),
    svc.NotReady: (503, _text),
    svc.TooManyTrackers: (503, _text),
    svc.OverBudget: (503, _text),  # and its subclass OverMemoryBudget
    svc.WritesRefused: (503, _text),
    svc.NotAcknowledged: (503, _text),
    core.TooManyOutputBlocks: (422, _text),
    core.PrefillTokensOverflow: (
        422,
        lambda e: f"new_isl_tokens would overflow the prefill token sum of {e.worker.debug()}",
    ),
    # the selection API (SELECTION.md §8)
    sel.MissingBlockHashes: (400, _text),
    sel.MissingSequenceHashes: (400, _text),
    sel.MissingIslTokens: (400, _text),
    sel.ZeroIslTokens: (400, _text),
    sel.HashLengthMismatch: (400, _text),
    sel.PrefillExceedsIsl: (400, _text),
    sel.InvalidDecayFraction: (400, _text),
    sel.PinnedWorkerNotAllowed: (400, _text),
    sel.SessionBoundElsewhere: (400, _text),
    sel.InvalidReplayEndpoints: (400, _text),
    sel.CatalogWorkerNotFound: (404, _text),
    sel.SchedulableWorkerNotFound: (404, _text),
    sel.RankNotFound: (404, _text),
    sel.PendingSelectionNotFound: (404, _text),
    sel.PendingWorkerGone: (404, _text),
    sel.ReservationNotFound: (404, _text),
    sel.ReservationConflict: (409, _text),
    sel.InvalidRouterConfigOverride: (
        422,
        lambda e: f"{JSON_SHAPE}router_config_override: {e.detail}",
    ),
    sel.NoSchedulableWorkers: (503, _text),
    sel.NoSchedulableWorkersAvailable: (503, _text),
    sel.NoEndpoints: (503, _text),
}

# Every error class an operation may raise on purpose (``except`` clauses catch exactly these,
# and their subclasses).
EXPECTED: tuple[type[Exception], ...] = (HttpError, *STATUS)

# ``STATUS`` entries by the class actually raised: a subclass of a listed class gets the entry of
# its nearest listed ancestor (its MRO), looked up once per class.
_RESOLVED: dict[type[Exception], tuple[int, Callable[[Any], str]]] = dict(STATUS)


def _resolve(cls: type[Exception]) -> tuple[int, Callable[[Any], str]]:
    for base in cls.__mro__:
        entry = STATUS.get(base)
        if entry is not None:
            _RESOLVED[cls] = entry
            return entry
    raise KeyError(cls)  # not an error of EXPECTED


def describe(exc: Exception) -> tuple[int, str]:
    """``(status, message)`` for an error of ``EXPECTED`` (or of a subclass of one)."""
    if isinstance(exc, HttpError):
        return exc.status, exc.message
    entry = _RESOLVED.get(type(exc)) or _resolve(type(exc))
    status, text = entry
    return status, text(exc)


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def error_result(exc: Exception) -> tuple[int, bytes]:
    status, message = describe(exc)
    return status, error_body(message)
