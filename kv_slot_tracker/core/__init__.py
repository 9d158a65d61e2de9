"""The tracker core: pure, synchronous, time passed in. No I/O, no framework imports (the add
command is a msgspec struct, read here only as a record: ``commands``)."""

from .errors import (
    DuplicateRequest,
    DuplicateWorker,
    InvalidDpRange,
    InvalidDpSize,
    MissingExpectedDuration,
    RequestNotFound,
    SequenceError,
    TrackerError,
    WorkerIdNotRegistered,
    WorkerNotFound,
    WorkerTopologyError,
)
from .tracker import (
    ActiveSequencesMultiWorker,
    ReplicaEffects,
    ReplicaWorkerPolicy,
    SequencePublisher,
)
from .types import (
    ActiveLoad,
    PrefillLoadHint,
    PrefillTokenDeltas,
    WorkerDpRange,
    WorkerLoadProjection,
    WorkerWithDpRank,
)

__all__ = [
    "ActiveLoad",
    "ActiveSequencesMultiWorker",
    "DuplicateRequest",
    "DuplicateWorker",
    "InvalidDpRange",
    "InvalidDpSize",
    "MissingExpectedDuration",
    "PrefillLoadHint",
    "PrefillTokenDeltas",
    "ReplicaEffects",
    "ReplicaWorkerPolicy",
    "RequestNotFound",
    "SequenceError",
    "SequencePublisher",
    "TrackerError",
    "WorkerDpRange",
    "WorkerIdNotRegistered",
    "WorkerLoadProjection",
    "WorkerNotFound",
    "WorkerTopologyError",
    "WorkerWithDpRank",
]
