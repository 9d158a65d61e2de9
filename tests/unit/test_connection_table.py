"""The server's table of open connections (``ConnectionLimits``): which idle connection is closed
to make room. A connection going busy stays in the idle tables (dropped lazily), so these
follow connections through idle and busy periods and check that only an idle one is ever
closed, the longest idle first, of the right client."""

from __future__ import annotations

from typing import Any, cast

from kv_slot_tracker.http.connection import ConnectionLimits, LimitedHttpToolsProtocol


class FakeTransport:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeConnection:
    """What the table reads and writes of a connection."""

    def __init__(self, name: str, address: str) -> None:
        self.name = name
        self._address = address
        self._counted = False
        self._idle = False
        self.connections: set[Any] = set()
        self.transport = FakeTransport()

    def __repr__(self) -> str:
        return self.name


def opened(limits: ConnectionLimits, name: str, address: str = "10.0.0.1") -> Any:
    conn = FakeConnection(name, address)
    counted = limits.count(cast(LimitedHttpToolsProtocol, conn))
    return conn if counted else None


def idle(limits: ConnectionLimits, *conns: Any) -> None:
    for conn in conns:
        limits.went_idle(conn)


def busy(*conns: Any) -> None:
    for conn in conns:
        conn._idle = False  # what the protocol's callbacks do when a request starts


def test_the_longest_idle_connection_is_closed_not_one_that_went_busy() -> None:
    limits = ConnectionLimits(65_536, 10.0, 30.0, max_connections=3, max_per_client=3)
    a, b, c = (opened(limits, n, f"10.0.0.{i}") for i, n in enumerate("abc"))
    idle(limits, a, b, c)
    busy(a)  # a is first in the tables, but serving a request now
    d = opened(limits, "d", "10.0.0.9")
    assert d is not None
    assert not a.transport.closed and b.transport.closed and not c.transport.closed
    assert limits.open == 3 and limits.shed == 1


def test_a_connection_idle_again_goes_last() -> None:
    limits = ConnectionLimits(65_536, 10.0, 30.0, max_connections=3, max_per_client=3)
    a, b, c = (opened(limits, n, f"10.0.0.{i}") for i, n in enumerate("abc"))
    idle(limits, a, b, c)
    busy(a)
    idle(limits, a)  # a's request answered: now the most recently idle
    opened(limits, "d", "10.0.0.9")
    opened(limits, "e", "10.0.0.9")
    assert [x.transport.closed for x in (a, b, c)] == [False, True, True]
    opened(limits, "f", "10.0.0.9")
    assert a.transport.closed
    assert limits.open == 3 and limits.shed == 3


def test_nothing_idle_nothing_closed() -> None:
    limits = ConnectionLimits(65_536, 10.0, 30.0, max_connections=2, max_per_client=2)
    a = opened(limits, "a", "10.0.0.1")
    b = opened(limits, "b", "10.0.0.2")
    idle(limits, a, b)
    busy(a, b)
    c = opened(limits, "c", "10.0.0.3")  # counted: uvicorn's limit answers its request 503
    assert c is not None and not a.transport.closed and not b.transport.closed
    assert limits.open == 3 and limits.shed == 0
    assert limits.idle == {}  # the busy entries were dropped on the way


def test_a_client_at_its_limit_closes_its_own_longest_idle_or_is_refused() -> None:
    limits = ConnectionLimits(65_536, 10.0, 30.0, max_connections=100, max_per_client=2)
    other = opened(limits, "other", "10.0.0.2")
    a = opened(limits, "a")
    b = opened(limits, "b")
    idle(limits, other, a, b)
    busy(a)
    c = opened(limits, "c")
    assert c is not None
    assert b.transport.closed and not a.transport.closed and not other.transport.closed
    busy(c)
    assert opened(limits, "d") is None  # a and c busy: nothing of this client to close
    assert limits.per_client == {"10.0.0.2": 1, "10.0.0.1": 2}


def test_a_lost_connection_leaves_the_tables() -> None:
    limits = ConnectionLimits(65_536, 10.0, 30.0, max_connections=2, max_per_client=2)
    a = opened(limits, "a")
    b = opened(limits, "b", "10.0.0.2")
    idle(limits, a, b)
    limits.forget(a)
    limits.forget(b)
    assert limits.open == 0 and limits.idle == {} and limits.idle_by_client == {}
    assert limits.per_client == {}
    c = opened(limits, "c")
    idle(limits, c)
    busy(c)
    idle(limits, c)
    assert list(limits.idle) == [c] and list(limits.idle_by_client["10.0.0.1"]) == [c]
