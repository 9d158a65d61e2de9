"""The seam between the service and replication, both ways, and the one status model.

Wiring is in two phases, construction then hook-up. The composition root builds the
replication from settings first (it owns the instance id), then the service with
``instance_id=replication.instance_id`` and, unless the mode is embedded,
``replicator=replication``; ``start(service)`` then hands it the service as its
``ReplicatedState``. Between the two, collaborators are joined by setting attributes after
construction: the service sets its replica records' and registry's limits, the Redis facade
points its reader's callbacks at its read barrier and at itself (and its outbox's group-commit
observer at a histogram), ``Consistency`` registers ``on_applied`` on the service's replica
records, the composition root calls ``use_early_calls``, and the index peers set the ingest's
``seed``. The service only ever calls ``publish``; replication only ever calls the
``ReplicatedState`` methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from pydantic import ConfigDict

from kv_slot_tracker.replication.records import Delivered


@dataclass(frozen=True, slots=True)
class OwnReadBack:
    """A control message among a batch's records: this instance's own records up to ``seq``
    were read back from the stream at this point of the order (the records after it were
    appended after those). Not a record: nothing is applied for it."""

    seq: int


Batch = list[Delivered | OwnReadBack]
"""Peers' records in stream order, with the control messages where they fall."""


class ReplicatedState(Protocol):
    """What replication needs of the service whose state it keeps in agreement."""

    def apply_remote(self, records: Batch) -> int:
        """Apply other instances' records in order (one batch); how many changed state."""
        ...

    def export_state(self) -> list[dict[str, Any]]:
        """Every tracker's state, for a snapshot."""
        ...

    def rejections(self) -> tuple[dict[str, int], int | None]:
        """Peers' records refused by ``apply_remote`` so far, by reason, and the wall-clock
        time (ns) of the newest refusal (None: none yet)."""
        ...

    def export_early(self) -> list[list[Any]]:
        """The early lifecycle calls kept (tombstones, pending marks), for a snapshot."""
        ...

    def export_selection(self) -> dict[str, Any] | None:
        """The selection service's state (catalog, reservations, caches, pending selections),
        for a snapshot."""
        ...

    def restore_state(
        self,
        trackers: list[dict[str, Any]],
        early: list[list[Any]] | None = None,
        selection: dict[str, Any] | None = None,
    ) -> None:
        """Replace every tracker by those of an ``export_state``, the early calls by those of
        an ``export_early`` and the selection state by an ``export_selection``; all or
        nothing."""
        ...


class Replication(Protocol):
    """What the app needs of replication, in either mode."""

    mode: str  # "embedded" (nothing to replicate), "redis" or "local" (a supervisor's hub)
    instance_id: int  # non-zero; the origin of this instance's records
    # a confirmed ``caught_up`` also covers every change a peer acknowledged before the call,
    # whatever ``replication_ack`` (the hub has each sibling send what it accepted first)
    barrier_covers_acknowledged: bool

    def publish(self, record: bytes, ts: int) -> int:
        """Queue one of the service's records (its bytes, never read here; ``ts``: the
        producer's wall-clock time) for the peers; never blocks, never raises. Returns the
        record's sequence number among this process's records (0: not queued)."""
        ...

    async def start(self, target: ReplicatedState) -> None:
        """Start keeping ``target`` in agreement with the peers, in the background: returns at
        once (the instance listens while it bootstraps); never raises for I/O trouble."""
        ...

    async def settled(self, timeout_s: float) -> None:
        """Until the bootstrap settled (ready, or Redis unreachable, or failed), at most
        ``timeout_s``: for callers that want to wait for the state before going on."""
        ...

    async def stop(self) -> None: ...

    def ready(self) -> bool:
        """Whether the local state may be served (caught up with the peers)."""
        ...

    def write_refusal(self) -> str | None:
        """Why a change must not be accepted now, with durable acknowledgements (None: it
        may): Redis is known to be unreachable."""
        ...

    def last_accepted(self) -> int:
        """The sequence number of this instance's newest record queued for its peers."""
        ...

    def acknowledged_through(self) -> int:
        """This instance's records up to this sequence number are in the shared stream (and
        held by the replicas that durable acknowledgements wait for)."""
        ...

    async def appended(self, seq: int, timeout_s: float) -> bool:
        """Until this instance's records up to ``seq`` are in the shared stream (True), at most
        ``timeout_s`` (False)."""
        ...

    async def caught_up(self, timeout_s: float) -> bool:
        """The read barrier: True once this instance has applied every record that was in the
        shared stream when called; False when that could not be established in time."""
        ...

    def status(self) -> ReplicationStatus: ...


@dataclass(slots=True)
class ReplicationStatus:
    """``GET /replication``: the fields in the order they are answered. The defaults are what
    embedded mode answers (a single instance: nothing to connect to, publish or apply)."""

    # the HTTP edge documents this class as the answer's schema: every field is always answered
    __pydantic_config__ = ConfigDict(json_schema_serialization_defaults_required=True)

    mode: str
    instance_id: int
    namespace: str | None = None
    redis: str | None = None  # where Redis is (password masked)
    ready: bool = True
    not_ready_reason: str | None = None
    connected: bool | None = None
    degraded: bool = False
    degraded_reasons: list[str] = field(default_factory=list)
    stream_position: str | None = None
    outbox_depth: int = 0  # records accepted and not yet appended to the stream
    outbox_capacity: int = 0
    published: int = 0
    applied: int = 0
    duplicates: int = 0
    dropped: int = 0
    records_rejected: dict[str, int] = field(default_factory=dict)  # peers' records, by reason
    anomalies: dict[str, int] = field(default_factory=dict)  # by reason (replication/metrics.py)
    gaps: int = 0
    resets: int = 0
    resent: int = 0
    bootstraps: int = 0
    snapshots_written: int = 0
    last_applied_lag_ms: float | None = None
    snapshot_age_seconds: float | None = None
    snapshot_stream_id: str | None = None
    # mode "local": the supervisor's hub as last heard (``head``: its newest position, which
    # ``stream_position`` reaches once caught up; ``kept_from``/``kept_bytes``: the frames it
    # keeps; its counters of frames refused, cut, resyncs and states handed over)
    hub: dict[str, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON object of ``GET /replication`` (keys in field order)."""
        return {name: getattr(self, name) for name in _FIELD_NAMES}


_FIELD_NAMES = tuple(f.name for f in fields(ReplicationStatus))
