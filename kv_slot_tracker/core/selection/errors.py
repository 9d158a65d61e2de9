"""Domain errors of the selection service, each carrying the reference's exact message text.

Why here: the HTTP edge maps these classes to status codes in one table; the core and the service
never mention a status. ``str(error)`` is the text the reference puts in ``{"error": ...}``
(SELECTION.md §3, §6, §8). Texts the reference produces inside a deserialisation failure (the
router-config override) carry only the inner detail; the edge adds serde's prefix and position.
"""

from __future__ import annotations

from ..errors import TrackerError


class SelectionError(TrackerError):
    """Base class of every error the selection core raises on purpose."""


# -- prompt input (SELECTION.md §3) ---------------------------------------------------------------


class PromptError(SelectionError):
    """A prompt given as hashes is incomplete or inconsistent."""


class MissingBlockHashes(PromptError):
    def __init__(self) -> None:
        super().__init__("block_hashes is required without token_ids")


class MissingSequenceHashes(PromptError):
    def __init__(self) -> None:
        super().__init__("sequence_hashes is required without token_ids")


class MissingIslTokens(PromptError):
    def __init__(self) -> None:
        super().__init__("isl_tokens is required without token_ids")


class ZeroIslTokens(PromptError):
    def __init__(self) -> None:
        super().__init__("isl_tokens must be greater than 0")


class HashLengthMismatch(PromptError):
    def __init__(self, block_hashes_len: int, sequence_hashes_len: int) -> None:
        self.block_hashes_len, self.sequence_hashes_len = block_hashes_len, sequence_hashes_len
        super().__init__(
            f"block_hashes length {block_hashes_len} must match "
            f"sequence_hashes length {sequence_hashes_len}"
        )


# -- candidates and eligibility (SELECTION.md §8; texts of the reference's scheduler) -------------


class NoSchedulableWorkers(SelectionError):
    """The partition has no schedulable worker (select, select_and_reserve, explicit booking)."""

    def __init__(self, model_name: str, routing_group: str) -> None:
        self.model_name, self.routing_group = model_name, routing_group
        super().__init__(
            f"no schedulable workers for model={model_name} routing_group={routing_group}"
        )


class NoSchedulableWorkersAvailable(SelectionError):
    """Same condition on /potential_loads and /overlap_scores, which use this shorter text."""

    def __init__(self) -> None:
        super().__init__("no schedulable workers are available")


class NoEndpoints(SelectionError):
    """No candidate is left after ``allowed_worker_ids``, or the pinned rank does not exist."""

    def __init__(self) -> None:
        super().__init__("no endpoints available to route work")


class PinnedWorkerNotAllowed(SelectionError):
    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        super().__init__(f"pinned worker {worker_id} is not in allowed worker set")


class SessionBoundElsewhere(SelectionError):
    """A booking whose ``allowed_worker_ids`` exclude the worker its session is bound to."""

    def __init__(self, session_id: str, bound: int, chosen: int) -> None:
        super().__init__(f"session {session_id} is bound to worker {bound}, not {chosen}")


# -- router configuration -------------------------------------------------------------------------


class InvalidRouterConfig(SelectionError):
    """A router knob (environment or settings) is out of range; raised at start-up."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)


class InvalidRouterConfigOverride(SelectionError):
    """A per-request ``router_config_override`` has a wrong type or an out-of-range value.

    The reference rejects it while deserialising the body (422); ``detail`` is serde's inner
    message, e.g. ``prefill_load_scale must be greater than or equal to 0``.
    """

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)


# -- bookings and reservations (SELECTION.md §6, §8) -----------------------------------------------


class ReservationConflict(SelectionError):
    def __init__(self, selection_id: str) -> None:
        self.selection_id = selection_id
        super().__init__(f"selection {selection_id} is already reserved or being reserved")


class ReservationReleased(ReservationConflict):
    """A booking of an id whose reservation was released lately (its tombstone lasts): a late
    duplicate of a booking the client already used and freed (not in the reference, which
    books a freed id again)."""

    def __init__(self, selection_id: str) -> None:
        self.selection_id = selection_id
        SelectionError.__init__(
            self,
            f"selection {selection_id} was released and cannot be reserved again "
            "(a late duplicate of a finished booking; use a new selection_id)",
        )


class PendingSelectionNotFound(SelectionError):
    def __init__(self, selection_id: str, model_name: str, routing_group: str) -> None:
        self.selection_id = selection_id
        self.model_name, self.routing_group = model_name, routing_group
        super().__init__(
            f"no pending selection {selection_id} for model={model_name} "
            f"routing_group={routing_group} (expired, already used, or never selected)"
        )


class ReservationNotFound(SelectionError):
    def __init__(self, selection_id: str) -> None:
        self.selection_id = selection_id
        super().__init__(f"reservation {selection_id} not found")


class SchedulableWorkerNotFound(SelectionError):
    """Explicit booking on a worker that is not schedulable in the partition."""

    def __init__(self, worker_id: int, model_name: str, routing_group: str) -> None:
        self.worker_id = worker_id
        self.model_name, self.routing_group = model_name, routing_group
        super().__init__(
            f"schedulable worker {worker_id} not found for model={model_name} "
            f"routing_group={routing_group}"
        )


class RankNotFound(SelectionError):
    """Explicit booking on a dp rank outside the worker's ranks (Rust debug rendering)."""

    def __init__(self, worker_id: int, dp_rank: int) -> None:
        self.worker_id, self.dp_rank = worker_id, dp_rank
        super().__init__(
            f"Worker WorkerWithDpRank {{ worker_id: {worker_id}, dp_rank: {dp_rank} }} not found"
        )


class PrefillExceedsIsl(SelectionError):
    def __init__(self, effective_prefill_tokens: int, isl_tokens: int) -> None:
        self.effective_prefill_tokens, self.isl_tokens = effective_prefill_tokens, isl_tokens
        super().__init__(
            f"effective_prefill_tokens ({effective_prefill_tokens}) must not exceed "
            f"isl_tokens ({isl_tokens})"
        )


class InvalidDecayFraction(SelectionError):
    def __init__(self) -> None:
        super().__init__("decay_fraction must be between 0.0 and 1.0")


# -- the worker catalog (SELECTION.md §2) -----------------------------------------------------------


class CatalogWorkerNotFound(SelectionError):
    """PATCH or DELETE of a worker id the catalog does not hold."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        super().__init__(f"worker {worker_id} not found")


class InvalidReplayEndpoints(SelectionError):
    """A registration (or the worker a PATCH would leave) whose ``replay_endpoints`` do not fit
    its ranks (``catalog.replay_endpoints_problem`` says why)."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)


class PendingWorkerGone(SelectionError):
    """A replay whose selected rank is no longer schedulable in its partition."""

    def __init__(self, worker_id: int, dp_rank: int, model_name: str, routing_group: str) -> None:
        self.worker_id, self.dp_rank = worker_id, dp_rank
        self.model_name, self.routing_group = model_name, routing_group
        super().__init__(
            f"schedulable worker {worker_id} (dp_rank {dp_rank}) not found for "
            f"model={model_name} routing_group={routing_group}"
        )
