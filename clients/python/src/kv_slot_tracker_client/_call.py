"""A request and how to read its answer: what both clients send, described once.

A ``Call`` holds the method, path, body or query, and the *reader* that turns the answer into
the method's result (raising the mapped exception for an error status). The clients only do the
I/O, so the sync and async ones cannot disagree on what a route means.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import httpx
from pydantic import TypeAdapter, ValidationError

from kv_slot_tracker_client.errors import error_from_response, transport_error, unexpected_body

T = TypeVar("T")

NEXT_CURSOR = "x-next-cursor"

Reader = Callable[[httpx.Response], T]


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request and how to read its answer."""

    method: str
    path: str
    read: Reader[T]
    json: Any = None
    params: Mapping[str, str] | None = None
    content: bytes | None = None
    headers: Mapping[str, str] | None = None
    # What to return instead of raising when no answer comes back (the probes).
    unreachable: Callable[[], T] | None = None
    # A listing answered in pages: how to join a page to the pages before it. The clients
    # follow the ``x-next-cursor`` header until the last page.
    join: Callable[[T, T], T] | None = None

    def request_args(self) -> dict[str, Any]:
        """The keyword arguments of ``httpx.Client.request`` / ``httpx.AsyncClient.request``."""
        args: dict[str, Any] = {
            "method": self.method,
            "url": self.path,
            "params": self.params,
            "headers": self.headers,
        }
        if self.content is not None:
            args["content"] = self.content
        elif self.json is not None:
            args["json"] = self.json
        return args

    def next_page(self, response: httpx.Response) -> Call[T] | None:
        """The call for the page after ``response``, None when it was the last (or this is no
        listing). A cursor equal to the one sent would never end: taken as the last page."""
        cursor = response.headers.get(NEXT_CURSOR)
        if self.join is None or cursor is None or not response.is_success:
            return None
        params = dict(self.params or {})
        if params.get("cursor") == cursor:
            return None
        params["cursor"] = cursor
        return replace(self, params=params)

    def joined(self, before: T, response: httpx.Response) -> T:
        """The pages before and the page in ``response`` as one answer."""
        assert self.join is not None  # only a listing has a next page
        return self.join(before, self.read(response))

    def failed(self, exc: httpx.TransportError) -> T:
        """The outcome of a request that got no answer: the probe value or a TransportError."""
        if self.unreachable is not None:
            return self.unreachable()
        raise transport_error(exc, self.method, self.path) from exc


def post(path: str, body: Any, read: Reader[T]) -> Call[T]:
    return Call("POST", path, read, json=body)


def get(path: str, read: Reader[T], params: Mapping[str, str] | None = None) -> Call[T]:
    return Call("GET", path, read, params=params)


def listing(
    path: str, read: Reader[T], join: Callable[[T, T], T], params: Mapping[str, str] | None = None
) -> Call[T]:
    """A GET of a listing the service may answer in pages: the clients fetch them all."""
    return Call("GET", path, read, params=params, join=join)


# -- readers -----------------------------------------------------------------------------------


def raise_for_status(response: httpx.Response) -> None:
    if not response.is_success:
        raise error_from_response(response)


def validated(adapter: TypeAdapter[T], response: httpx.Response) -> T:
    """The body of ``response`` validated against ``adapter``, whatever its status."""
    try:
        return adapter.validate_json(response.content)
    except ValidationError as exc:
        raise unexpected_body(response, exc) from exc


def reader(result: type[T]) -> Reader[T]:
    """Reader of a success body of type ``result`` (a model or a type such as ``list[Row]``)."""
    adapter = TypeAdapter(result)

    def read(response: httpx.Response) -> T:
        raise_for_status(response)
        return validated(adapter, response)

    return read


def no_content(response: httpx.Response) -> None:
    raise_for_status(response)


def created(response: httpx.Response) -> bool:
    """True for 201 (created), False for another success."""
    raise_for_status(response)
    return response.status_code == 201


def text(response: httpx.Response) -> str:
    raise_for_status(response)
    return response.text


def raw(response: httpx.Response) -> httpx.Response:
    raise_for_status(response)
    return response


def probe(response: httpx.Response) -> bool:
    """2xx: yes; 5xx (503 = not ready): no. A 4xx means a wrong base_url or route rather than a
    state of the service, so it raises instead of reading as "not up yet" forever."""
    if response.is_success:
        return True
    if response.status_code >= 500:
        return False
    raise error_from_response(response)


def unreachable_is_no() -> bool:
    return False
