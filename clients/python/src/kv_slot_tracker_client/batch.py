"""``BatchBuilder``: lifecycle operations collected for one ``/batch`` call."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

from kv_slot_tracker_client._call import Call
from kv_slot_tracker_client._routes import ROUTES, Routes
from kv_slot_tracker_client._signature import adopt

P = ParamSpec("P")
T = TypeVar("T")


def _queue(
    build: Callable[Concatenate[Routes, P], Call[T]],
) -> Callable[Concatenate[BatchBuilder, P], BatchBuilder]:
    """A builder method queuing the body of route ``build`` as the operation of that name."""
    op = build.__name__

    def method(self: BatchBuilder, /, *args: P.args, **kwargs: P.kwargs) -> BatchBuilder:
        call = build(ROUTES, *args, **kwargs)
        self._operations.append({"op": op, **call.json})
        return self

    return adopt(method, build, "BatchBuilder", returns="BatchBuilder")


class BatchBuilder:
    """Collects lifecycle operations for one ``/batch`` call.

    A router that frees and adds many requests per scheduling step saves a round trip per
    operation. The service applies the operations in order, each on its own (a failing one
    neither stops nor undoes the others), and ``client.batch(builder)`` returns one
    ``BatchResult`` per operation, in the order they were queued here; nothing raises for a
    failed operation. The methods take the same arguments as the client's (an add's result
    status is 201, the others' 200) and return the builder, so calls chain::

        client.batch(BatchBuilder().free("m", "r0").add("m", "r1", 1, 0, [1, 2]))
    """

    def __init__(self) -> None:
        self._operations: list[dict[str, Any]] = []

    add = _queue(Routes.add)
    prefill_complete = _queue(Routes.prefill_complete)
    free = _queue(Routes.free)
    output_block = _queue(Routes.output_block)

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
