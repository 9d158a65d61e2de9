"""One command per operation: the only definition of each operation's inputs.

The HTTP edge builds these from validated bodies (and the batch route from each operation);
the service executes them. Hashes are already unsigned (the edge reinterprets the API's signed
64-bit values bit for bit), and a prompt is given either as ``sequence_hashes`` or as
``token_ids``, never both (the edge enforces that, with the reference's messages).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ROUTING_GROUP = "default"

Key = tuple[str, str]


@dataclass(slots=True, kw_only=True)
class Command:
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
    """Make ``workers`` (``(worker_id, dp_start, dp_size)``) the whole topology of a tracker."""

    block_size: int
    workers: list[tuple[int, int, int]]


# -- lifecycle --------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Prompt(Command):
    """A prompt as block hashes or as token ids (hashed with the tracker's block size)."""

    sequence_hashes: list[int] | None = None
    token_ids: list[int] | None = None
    lora_name: str | None = None


@dataclass(slots=True, kw_only=True)
class Add(Prompt):
    request_id: str
    worker_id: int
    dp_rank: int
    new_isl_tokens: int = 0
    expected_prefill_ms: float | None = None
    track_prefill_tokens: bool | None = None  # None: track when new_isl_tokens > 0
    expected_output_tokens: int | None = None


@dataclass(slots=True, kw_only=True)
class PrefillComplete(Command):
    request_id: str


@dataclass(slots=True, kw_only=True)
class Free(Command):
    request_id: str


@dataclass(slots=True, kw_only=True)
class OutputBlock(Command):
    request_id: str
    decay_fraction: float | None = None


# -- queries ----------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class PotentialLoads(Prompt):
    new_isl_tokens: int = 0


@dataclass(slots=True, kw_only=True)
class ProjectLoads(Prompt):
    pass


Lifecycle = Add | PrefillComplete | Free | OutputBlock
