"""The tracker core: pure, synchronous, time passed in. No I/O, no framework imports."""

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
    SequenceRequest,
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
    "SequenceRequest",
    "TrackerError",
    "WorkerDpRange",
    "WorkerIdNotRegistered",
    "WorkerLoadProjection",
    "WorkerNotFound",
    "WorkerTopologyError",
    "WorkerWithDpRank",
]
