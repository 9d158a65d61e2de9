"""Methods made from the routes of ``Routes`` carry the route's name, documentation and
signature, so ``help()``, ``inspect.signature``, ``typing.get_type_hints`` and documentation
tools show the real arguments and result."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def adopt(method: F, build: Callable[..., Any], owner: str, returns: Any = None) -> F:
    """``method`` of class ``owner``, named, documented and signed as route ``build``, returning
    ``returns`` (by default ``X``, what sending the route's ``Call[X]`` yields)."""
    hints = typing.get_type_hints(build)
    if returns is None:
        (returns,) = typing.get_args(hints["return"])
        if returns is type(None):
            returns = None
    fn: Any = method
    fn.__name__ = build.__name__
    fn.__qualname__ = f"{owner}.{build.__name__}"
    fn.__doc__ = build.__doc__
    fn.__annotations__ = {**hints, "return": returns}
    signature = inspect.signature(build, eval_str=True)
    fn.__signature__ = signature.replace(return_annotation=returns)
    return method
