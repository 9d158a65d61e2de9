"""What a call route answers: a ``Result`` now, or ``Later``.

An operation (``kv_slot_tracker.http.operations``, ``kv_slot_tracker.http.selection.operations``)
is synchronous: body bytes in, ``Result`` (status, JSON bytes) out, a mutation being one call
with no ``await`` inside. On a replicated instance a call may have to wait before it can answer
(for the add of a request id not known here yet, for its records to reach the stream:
``kv_slot_tracker.http.replicated``); it answers ``Later`` then, which the dispatchers
(``kv_slot_tracker.http.dispatch``, ``kv_slot_tracker.http.fast_protocol``, the FastAPI endpoints
of ``kv_slot_tracker.http.endpoints``) await. ``Answer`` is the one type of both, and
``isinstance(answer, Later)`` the one test between them: a call that does not wait answers its
``Result`` as an embedded instance does, with nothing allocated around it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, Protocol, final

from kv_slot_tracker.http.errors import EXPECTED, error_result

Result = tuple[int, bytes]
"""``(status, JSON bytes)``: a call's answer, ready to send."""


@final
class Later:
    """The answer of a call that waits: awaiting it gives its ``Result``, expected errors
    (``kv_slot_tracker.http.errors.EXPECTED``) answered with their status as a synchronous
    call's are. Awaited once, by the dispatcher that got it."""

    __slots__ = ("_pending",)

    def __init__(self, pending: Awaitable[Result]) -> None:
        self._pending = pending

    def __await__(self) -> Generator[Any, None, Result]:
        try:
            return (yield from self._pending.__await__())
        except EXPECTED as e:
            return error_result(e)


Answer = Result | Later
Call = Callable[..., Answer]
"""A call route's operation as the dispatchers run it: ``(body, *path parameters)``."""


class CallRoutes(Protocol):
    """What serves an API's call routes: the operation of each, by the name the route table
    gives it, answering expected errors with their status (it never raises them)."""

    def get(self, name: str) -> Call: ...
