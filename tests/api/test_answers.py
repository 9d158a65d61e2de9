"""``Later`` (``kv_slot_tracker.http.answers``): the answer of a call that waits gives its
``Result`` when awaited, an expected error answered with its status as a synchronous call's is,
and anything else (a bug) raised to the dispatcher, which answers 500."""

from __future__ import annotations

import pytest

from kv_slot_tracker.core.errors import RequestNotFound
from kv_slot_tracker.http.answers import Answer, Later, Result
from kv_slot_tracker.http.errors import HttpError


async def test_awaiting_later_gives_the_result_of_what_it_waited_for() -> None:
    async def pending() -> Result:
        return 201, b'{"status":"ok"}'

    answer: Answer = Later(pending())
    assert isinstance(answer, Later)
    assert await answer == (201, b'{"status":"ok"}')


async def test_an_expected_error_while_waiting_is_answered_with_its_status() -> None:
    async def not_found() -> Result:
        raise RequestNotFound("r-1")

    async def too_large() -> Result:
        raise HttpError(413, "too large")

    assert await Later(not_found()) == (404, b'{"error":"Request r-1 not found"}')
    assert await Later(too_large()) == (413, b'{"error":"too large"}')


async def test_a_bug_while_waiting_is_raised_to_the_dispatcher() -> None:
    async def bug() -> Result:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        await Later(bug())
