"""Fixtures of the KV-event listener tests: a ZMQ context, and fake engines closed after the
test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from .fake_engine import FakeEngine


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def engines(zctx: zmq.Context) -> Iterator[Callable[..., FakeEngine]]:
    made: list[FakeEngine] = []

    def make(**kw: Any) -> FakeEngine:
        made.append(FakeEngine(zctx, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()
