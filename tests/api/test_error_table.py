"""The error table (``kv_slot_tracker.http.errors``): an error is looked up along its class
hierarchy, so a subclass of a listed domain error answers as its nearest listed ancestor."""

from __future__ import annotations

import pytest

from kv_slot_tracker.core import errors as core
from kv_slot_tracker.http.errors import EXPECTED, STATUS, HttpError, describe, error_result
from kv_slot_tracker.service import errors as svc


class ExpiredRequest(core.RequestNotFound):
    """A narrower not-found that the table does not list."""


class Narrower(ExpiredRequest):
    pass


def test_a_listed_error_answers_with_its_own_entry() -> None:
    assert describe(core.RequestNotFound("r1")) == (404, "Request r1 not found")
    assert describe(core.InvalidDpSize(7)) == (400, "dp_size must be greater than 0")


def test_a_subclass_answers_as_its_nearest_listed_ancestor() -> None:
    assert ExpiredRequest not in STATUS
    assert isinstance(ExpiredRequest("r1"), EXPECTED)  # the routes' except clauses catch it
    assert describe(ExpiredRequest("r1")) == (404, "Request r1 not found")
    assert describe(Narrower("r2")) == (404, "Request r2 not found")
    assert error_result(Narrower("r3")) == (404, b'{"error":"Request r3 not found"}')


def test_an_http_error_subclass_keeps_its_status_and_message() -> None:
    class Teapot(HttpError):
        pass

    assert describe(Teapot(418, "short and stout")) == (418, "short and stout")


def test_an_error_outside_the_table_is_not_described() -> None:
    with pytest.raises(KeyError):
        describe(ValueError("not a domain error"))
    with pytest.raises(KeyError):
        describe(svc.ServiceError("the base class is not listed"))
