"""One command per operation: what the HTTP edge decodes a body into and the service executes.

The lifecycle and query commands are msgspec structs whose fields carry the API's types and
ranges, so the edge's fast path decodes a plain body straight into the command (in C, strict:
no bool for an int, no float for an int, no null for a field with a default) and hands it to
the service as it is. The pydantic models in ``kv_slot_tracker.http.schemas`` exist only for the OpenAPI
document and the reference's error texts; ``tests/api/test_commands.py`` checks them equal to
these structs field for field (names, types, bounds, defaults). The lifecycle commands are
tagged by ``op``: a ``/batch`` body is a list of their union (``BatchOperation``).

The add command and what it builds on (``Keyed``, ``Prompt``, the API's types) are defined in
``kv_slot_tracker.core.commands``, because the tracker takes an add as it is (one definition of
an add's fields, read by the tracker without a copy or a positional tuple, and the core imports
nothing from the service); this module re-exports them and builds the other commands on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from kv_slot_tracker.core import commands as core
from kv_slot_tracker.core.commands import DEFAULT_ROUTING_GROUP, U64, Id, Key, Keyed, Prompt
from kv_slot_tracker.core.types import WorkerDpRange

__all__ = ["DEFAULT_ROUTING_GROUP", "Key", "Keyed", "Prompt"]  # re-exported: defined in the core

Fraction = Annotated[int, Meta(ge=0, le=1)] | Annotated[float, Meta(ge=0, le=1)]

MAX_CACHED_TOKENS = 1 << 40
CachedTokens = Annotated[int, Meta(ge=0, le=MAX_CACHED_TOKENS)]
"""Prompt tokens an engine reported cached (``usage.prompt_tokens_details.cached_tokens``):
the observed outcome of a selection's routing receipt (``kv_slot_tracker.core.selection.receipts``)."""


@dataclass(slots=True, kw_only=True)
class Command:
    """A topology command's key (the topology commands are plain dataclasses)."""

    model_name: str
    routing_group: str = DEFAULT_ROUTING_GROUP

    @property
    def key(self) -> Key:
        return (self.model_name, self.routing_group)


# -- topology ---------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Register(Command):
    """Register a worker's ranks ``dp_start .. dp_start + dp_size - 1``."""

    worker_id: int
    block_size: int
    dp_start: int = 0
    dp_size: int = 1

    @property
    def ranks(self) -> WorkerDpRange:
        """The registration as the tracker and the replica records take it."""
        return WorkerDpRange(worker_id=self.worker_id, dp_start=self.dp_start, dp_size=self.dp_size)


@dataclass(slots=True, kw_only=True)
class Upsert(Register):
    """Register a worker or replace its ranks."""


@dataclass(slots=True, kw_only=True)
class Unregister(Command):
    worker_id: int


@dataclass(slots=True, kw_only=True)
class Heartbeat(Command):
    """Renew a worker's lease (``worker_ttl_seconds``)."""

    worker_id: int


@dataclass(slots=True, kw_only=True)
class Reconcile(Command):
    """Make ``workers`` (each a registration of its ranks) the whole topology of a tracker."""

    block_size: int
    workers: list[WorkerDpRange]


# -- lifecycle and queries --------------------------------------------------------------------


class Add(core.Add, tag_field="op", tag="add", kw_only=True):
    """The core's add (``kv_slot_tracker.core.commands.Add``: every field is declared there),
    tagged ``op: add`` for ``/batch``'s union."""


class PrefillComplete(Keyed, tag_field="op", tag="prefill_complete", kw_only=True):
    request_id: Id
    cached_tokens: CachedTokens | None = None
    """Reported for the routing receipt of the selection ``request_id`` names, if any."""


class Free(Keyed, tag_field="op", tag="free", kw_only=True):
    request_id: Id
    cached_tokens: CachedTokens | None = None
    """Reported for the routing receipt of the selection ``request_id`` names, if any."""


class OutputBlock(Keyed, tag_field="op", tag="output_block", kw_only=True):
    request_id: Id
    decay_fraction: Fraction | None = None


class PotentialLoads(Prompt, kw_only=True):
    new_isl_tokens: U64 = 0


class ProjectLoads(Prompt, kw_only=True):
    pass


Lifecycle = Add | PrefillComplete | Free | OutputBlock
BatchOperation = Lifecycle  # a ``/batch`` operation: the command its ``op`` names
