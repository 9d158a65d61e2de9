"""Every selection domain error renders the reference's exact text (SELECTION.md §6, §8)."""

from __future__ import annotations

import pytest

from kv_slot_tracker.core.errors import TrackerError
from kv_slot_tracker.core.selection import errors as e


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (
            e.NoSchedulableWorkers("m", "g1"),
            "no schedulable workers for model=m routing_group=g1",
        ),
        (e.NoSchedulableWorkersAvailable(), "no schedulable workers are available"),
        (e.NoEndpoints(), "no endpoints available to route work"),
        (e.PinnedWorkerNotAllowed(7), "pinned worker 7 is not in allowed worker set"),
        (e.ReservationConflict("s1"), "selection s1 is already reserved or being reserved"),
        (e.ReservationConflict(""), "selection  is already reserved or being reserved"),
        (
            e.PendingSelectionNotFound("s1", "m", "default"),
            "no pending selection s1 for model=m routing_group=default "
            "(expired, already used, or never selected)",
        ),
        (e.ReservationNotFound("s1"), "reservation s1 not found"),
        (
            e.SchedulableWorkerNotFound(9, "m", "default"),
            "schedulable worker 9 not found for model=m routing_group=default",
        ),
        (e.RankNotFound(3, 5), "Worker WorkerWithDpRank { worker_id: 3, dp_rank: 5 } not found"),
        (
            e.PrefillExceedsIsl(40, 32),
            "effective_prefill_tokens (40) must not exceed isl_tokens (32)",
        ),
        (e.InvalidDecayFraction(), "decay_fraction must be between 0.0 and 1.0"),
        (e.HashLengthMismatch(3, 2), "block_hashes length 3 must match sequence_hashes length 2"),
    ],
)
def test_texts(error: e.SelectionError, text: str) -> None:
    assert str(error) == text
    assert isinstance(error, e.SelectionError)
    assert isinstance(error, TrackerError)
