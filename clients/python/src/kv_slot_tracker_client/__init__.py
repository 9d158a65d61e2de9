"""Typed Python client of the kv-slot-tracker HTTP API, synchronous and asynchronous.

``SlotTrackerClient`` and ``AsyncSlotTrackerClient`` expose one method per route and return
typed, validated results (``kv_slot_tracker_client.models``) instead of dicts.

* One ``httpx.Client`` / ``httpx.AsyncClient`` per instance, kept for the instance's life: a
  router calls the tracker on every request, and reusing keep-alive connections saves a TCP
  handshake per call. Use the client as a context manager, or call ``close()`` / ``aclose()``.
* Every non-success status becomes a typed ``SlotTrackerError`` carrying the HTTP ``status`` and
  the service's ``message`` (the ``error`` field of its JSON body), and every connection failure
  or timeout a ``TransportError``, so callers never handle httpx exceptions directly.
* Nothing is retried: ``/add`` is not idempotent (a repeated request id is a 409), and after a
  timeout the first attempt may or may not have been applied. The caller knows whether a retry is
  safe (a ``Conflict`` on a retried add means the first attempt landed).
* ``BatchBuilder`` collects lifecycle operations for one ``/batch`` round trip.
* ``client.selection`` (``SelectionClient`` / ``AsyncSelectionClient``) speaks the selection API
  (``/selection``): workers, ``select``, ``select_and_reserve``, reservations and loads.

Sequence hashes are unsigned 64-bit values in Dynamo, but the API takes them as signed 64-bit
JSON integers (values >= 2^63 as their two's-complement negative). Methods accept either form and
convert (``to_i64``), so hashes computed in Python as ``u64`` can be passed unchanged.
"""

from kv_slot_tracker_client._routes import DEFAULT_ROUTING_GROUP, WorkerRange, to_i64
from kv_slot_tracker_client._selection import RankRef
from kv_slot_tracker_client._version import __version__
from kv_slot_tracker_client.batch import BatchBuilder
from kv_slot_tracker_client.client import (
    DEFAULT_BASE_URL,
    DEFAULT_TIMEOUT,
    AsyncSelectionClient,
    AsyncSlotTrackerClient,
    SelectionClient,
    SlotTrackerClient,
)
from kv_slot_tracker_client.errors import (
    BadRequest,
    Conflict,
    NotFound,
    ServerError,
    SlotTrackerError,
    TransportError,
    Unauthorized,
    Unavailable,
)
from kv_slot_tracker_client.models import (
    BatchResult,
    KvEventsReady,
    LoadRow,
    LoraCounts,
    Overlap,
    OverlapScoresResponse,
    PartitionDump,
    PartitionLoads,
    PotentialLoadRow,
    ProjectedLoadRow,
    Rank,
    RankLoad,
    RankOverlap,
    ReadyBody,
    ReconcileResult,
    ReplicationStatus,
    ReservationResponse,
    SelectAndReserveResponse,
    SelectionReady,
    SelectionStatus,
    SelectResponse,
    SharedCache,
    WorkerLoad,
    WorkerRecord,
    WorkerRow,
)

__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_ROUTING_GROUP",
    "DEFAULT_TIMEOUT",
    "AsyncSelectionClient",
    "AsyncSlotTrackerClient",
    "BadRequest",
    "BatchBuilder",
    "BatchResult",
    "Conflict",
    "KvEventsReady",
    "LoadRow",
    "LoraCounts",
    "NotFound",
    "Overlap",
    "OverlapScoresResponse",
    "PartitionDump",
    "PartitionLoads",
    "PotentialLoadRow",
    "ProjectedLoadRow",
    "Rank",
    "RankLoad",
    "RankOverlap",
    "RankRef",
    "ReadyBody",
    "ReconcileResult",
    "ReplicationStatus",
    "ReservationResponse",
    "SelectAndReserveResponse",
    "SelectResponse",
    "SelectionClient",
    "SelectionReady",
    "SelectionStatus",
    "ServerError",
    "SharedCache",
    "SlotTrackerClient",
    "SlotTrackerError",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "WorkerLoad",
    "WorkerRange",
    "WorkerRecord",
    "WorkerRow",
    "__version__",
    "to_i64",
]
