"""The service's domain errors: rules of the tracker registry and of the API's limits.

Each carries its message; the HTTP edge's error table (``kv_slot_tracker.http.errors``) gives each class
its status. The core's own errors (``kv_slot_tracker.core.errors``: unknown rank or request, duplicate
request, invalid dp range ...) reach the edge unchanged.
"""

from __future__ import annotations

from kv_slot_tracker.service.commands import Key


class ServiceError(Exception):
    """Base class of the service's own errors; ``str(error)`` is the message."""


class NoTracker(ServiceError):
    def __init__(self, key: Key) -> None:
        super().__init__(f"no slot tracker for model={key[0]} routing_group={key[1]}")


class UnknownWorker(ServiceError):
    def __init__(self, key: Key, worker_id: int) -> None:
        super().__init__(f"worker {worker_id} not found for model={key[0]} routing_group={key[1]}")


class WorkerExists(ServiceError):
    def __init__(self, key: Key, worker_id: int) -> None:
        super().__init__(
            f"worker {worker_id} already registered for model={key[0]} routing_group={key[1]}"
        )


class BlockSizeMismatch(ServiceError):
    def __init__(self, key: Key, existing: int, requested: int) -> None:
        super().__init__(
            f"block_size mismatch for model={key[0]} routing_group={key[1]}: "
            f"existing={existing}, requested={requested}"
        )


class TooManyTrackers(ServiceError):
    def __init__(self, key: Key, limit: int) -> None:
        super().__init__(
            f"cannot create a tracker for model={key[0]} routing_group={key[1]}: this instance "
            f"already holds {limit} trackers (max_trackers); unregister unused ones first"
        )


class OverBudget(ServiceError):
    """A call that would grow the state past one of the instance's global budgets
    (``kv_slot_tracker.core.limits.Budgets``): refused before anything changes."""

    def __init__(self, budget: str, held: int, adding: int, limit: int, setting: str) -> None:
        self.budget = budget
        super().__init__(
            f"this instance is at its {budget} budget: it holds {held:,}, the call adds "
            f"{adding:,}, the budget is {limit:,} ({setting}); retry later or on another "
            "instance, or free or unregister what is no longer used"
        )


class OverMemoryBudget(OverBudget):
    def __init__(self, resident: int, limit: int) -> None:
        ServiceError.__init__(
            self,
            f"this instance is at its memory budget: {resident:,} bytes resident, the budget is "
            f"{limit:,} (memory_budget_bytes); retry later or on another instance, or free or "
            "unregister what is no longer used",
        )
        self.budget = "memory"


class InvalidTopology(ServiceError):
    """A topology value the service refuses before the core sees it."""


class TooManyRanks(ServiceError):
    def __init__(self, key: Key, ranks: int, limit: int) -> None:
        super().__init__(
            f"too many ranks for model={key[0]} routing_group={key[1]}: {ranks} > {limit}"
        )


class TooManyHashes(ServiceError):
    def __init__(self, count: int, limit: int) -> None:
        super().__init__(f"too many block hashes: {count} > max_hashes_per_request ({limit})")


class WritesRefused(ServiceError):
    """``replication_ack = "redis"``: Redis is known to be unreachable (or not answering), so a
    mutating call is refused before anything is applied: nothing changed."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"not accepted: {reason}; nothing was changed")


class NotAcknowledged(ServiceError):
    """``replication_ack = "redis"``: the call was applied here, but its record did not reach
    Redis in time. The outcome is unknown to the caller: the change stays on this instance and
    reaches the others when Redis answers again, unless this instance stops first."""

    def __init__(self, timeout_ms: int) -> None:
        super().__init__(
            f"not acknowledged: Redis did not take the change within {timeout_ms} ms; it is "
            "applied on this instance and replicated when Redis answers again (retry: an add "
            "answers 409 once it exists, a free or prefill completion is idempotent)"
        )


class NotReady(ServiceError):
    """The instance has not caught up with its peers yet (bootstrapping): it cannot answer a
    call about tracker state correctly, so it refuses it and changes nothing."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"not ready: {reason}")
