"""Typed domain errors with the reference's exact message texts."""

from __future__ import annotations

from .types import WorkerWithDpRank


class TrackerError(Exception):
    """Base class of every error the core raises on purpose."""


class WorkerTopologyError(TrackerError):
    pass


class InvalidDpSize(WorkerTopologyError):
    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        super().__init__(f"dp_size must be greater than 0 for worker {worker_id}")


class InvalidDpRange(WorkerTopologyError):
    def __init__(self, worker_id: int, dp_start: int, dp_size: int) -> None:
        self.worker_id, self.dp_start, self.dp_size = worker_id, dp_start, dp_size
        super().__init__(
            f"dp range overflows u32 for worker {worker_id}: start={dp_start} size={dp_size}"
        )


class DuplicateWorker(WorkerTopologyError):
    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        super().__init__(f"worker {worker_id} is already registered")


class WorkerIdNotRegistered(WorkerTopologyError):
    """``WorkerTopologyError::WorkerNotFound``: the worker id has no authoritative range."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        super().__init__(f"worker {worker_id} is not registered")


class SequenceError(TrackerError):
    pass


class WorkerNotFound(SequenceError):
    def __init__(self, worker: WorkerWithDpRank) -> None:
        self.worker = worker
        super().__init__(f"Worker {worker.debug()} not found")


class DuplicateRequest(SequenceError):
    def __init__(self, request_id: str, worker: WorkerWithDpRank) -> None:
        self.request_id, self.worker = request_id, worker
        super().__init__(
            f"Request {request_id} already exists (assigned to worker {worker.debug()})"
        )


class RequestNotFound(SequenceError):
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"Request {request_id} not found")


class TooManyOutputBlocks(SequenceError):
    def __init__(self, request_id: str, limit: int) -> None:
        super().__init__(f"request {request_id} already holds the most output blocks, {limit}")
        self.request_id = request_id


class PrefillTokensOverflow(SequenceError):
    """Tracking this request's prefill would overflow the rank's 64-bit prefill-token sum."""

    def __init__(self, worker: WorkerWithDpRank) -> None:
        self.worker = worker
        super().__init__(f"prefill token sum of {worker.debug()} would overflow u64")


class MissingExpectedDuration(TrackerError):
    """Modeled remaining prefill time is unknown: some tracked prefill has no duration."""

    def __init__(self) -> None:
        super().__init__("missing expected prefill duration")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MissingExpectedDuration)

    def __hash__(self) -> int:
        return hash(MissingExpectedDuration)


class PublishRejected(TrackerError):
    """A publisher refused a replica event (``SequencePublisher.enqueue_event``).

    The tracker logs it (at debug level when ``during_shutdown``, else as an error) and keeps its
    local change. Publishers raise their own subclasses.
    """

    during_shutdown: bool = False
