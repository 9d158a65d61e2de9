"""The seeds' tracker API that the service does not use, for the ports of their tests, and the
one place the tests read a tracker's internals (``_slots``, ``_trie``, ``_columns``,
``_requests``). The tracker itself offers only what the service calls."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kv_slot_tracker.core.commands import Add
from kv_slot_tracker.core.errors import MissingExpectedDuration
from kv_slot_tracker.core.loads import LoadColumns
from kv_slot_tracker.core.sequences import ActiveSequences
from kv_slot_tracker.core.tracker import ActiveSequencesMultiWorker
from kv_slot_tracker.core.types import (
    NS_PER_MS,
    PrefillLoadHint,
    PrefillTokenDeltas,
    RequestId,
    SequenceHash,
    WorkerWithDpRank,
)

WORKER_TYPE = "test"  # the worker_type label of the tests' trackers

PotentialLoads = tuple[
    dict[WorkerWithDpRank, int],
    dict[WorkerWithDpRank, int],
    dict[WorkerWithDpRank, int] | None,
]


def new_tracker(*args: Any, **kwargs: Any) -> ActiveSequencesMultiWorker:
    """``ActiveSequencesMultiWorker`` labelled ``worker_type="test"`` unless told otherwise."""
    kwargs.setdefault("worker_type", WORKER_TYPE)
    return ActiveSequencesMultiWorker(*args, **kwargs)


def new_without_expiry(*args: Any, **kwargs: Any) -> ActiveSequencesMultiWorker:
    """The seeds' ``new_without_expiry``: a tracker whose requests never expire."""
    return new_tracker(*args, expiry_ns=None, **kwargs)


# -- the seeds' request-object API ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SequenceRequest:
    """The seeds' ``SequenceRequest``, as their tests build it (positions included). The
    tracker takes an add as the API's command (``kv_slot_tracker.core.commands.Add``); ``as_add``
    writes one as the other."""

    request_id: RequestId
    worker: WorkerWithDpRank
    token_sequence: list[SequenceHash] | None = None
    track_prefill_tokens: bool = True
    expected_output_tokens: int | None = None
    prefill_load_hint: PrefillLoadHint | None = None
    lora_name: str | None = None

    def as_add(self) -> Add:
        """The command: the hint's tokens as ``new_isl_tokens``, its duration in ms (exact: an
        int when whole, else a float the tracker rounds back to the same nanoseconds)."""
        hint = self.prefill_load_hint
        tokens, ms = 0, None
        if hint is not None:
            tokens = hint.initial_effective_prefill_tokens
            ns = hint.expected_prefill_duration_ns
            if ns is not None:
                ms = ns // NS_PER_MS if ns % NS_PER_MS == 0 else ns / NS_PER_MS
        return Add(
            model_name="test",
            request_id=self.request_id,
            worker_id=self.worker.worker_id,
            dp_rank=self.worker.dp_rank,
            lora_name=self.lora_name,
            new_isl_tokens=tokens,
            expected_prefill_ms=ms,
            track_prefill_tokens=self.track_prefill_tokens,
            expected_output_tokens=self.expected_output_tokens,
        )


def add_request_if_registered(
    t: ActiveSequencesMultiWorker, req: SequenceRequest, decay_now: int
) -> None:
    """The seeds' ``add_request_if_registered``: only on an existing rank, else WorkerNotFound."""
    t.add_on_rank(req.as_add(), req.token_sequence, decay_now)


def add_request(t: ActiveSequencesMultiWorker, req: SequenceRequest, decay_now: int) -> None:
    """The seeds' ``add_request``: create the rank if it is missing (LazyRegister), then add."""
    t.ensure_rank(req.worker)
    add_request_if_registered(t, req, decay_now)


def potential_blocks_and_tokens(
    t: ActiveSequencesMultiWorker,
    token_sequence: list[int] | None,
    deltas: PrefillTokenDeltas | None = None,
    decay_now: int | None = None,
    include_active_requests: bool = False,
) -> PotentialLoads:
    """The seeds' ``potential_blocks_and_tokens``: ``potential_loads`` as three maps."""
    if decay_now is None:
        decay_now = t.clock()
    rows = t.potential_loads(token_sequence, deltas, decay_now)
    blocks = {WorkerWithDpRank(r[0], r[1]): r[3] for r in rows}
    tokens = {WorkerWithDpRank(r[0], r[1]): r[2] for r in rows}
    requests = {WorkerWithDpRank(r[0], r[1]): r[4] for r in rows}
    return blocks, tokens, requests if include_active_requests else None


def any_worker_matches_active_tokens(
    t: ActiveSequencesMultiWorker,
    decay_now: int,
    predicate: Callable[[WorkerWithDpRank, int], bool],
) -> bool:
    """The seeds' ``any_worker_matches_active_tokens``."""
    return any(predicate(w, tokens) for w, tokens in t.active_tokens(decay_now).items())


@dataclass(slots=True)
class ModeledPrefillTimeLoad:
    worker: WorkerWithDpRank
    # whole milliseconds, or the MissingExpectedDuration error when some prefill is unmodeled
    modeled_remaining_prefill_time_ms: int | MissingExpectedDuration


def modeled_remaining_prefill_time_loads_at(
    t: ActiveSequencesMultiWorker, now: int
) -> list[ModeledPrefillTimeLoad]:
    """The seeds' per-rank modeled remaining prefill time."""
    out = []
    for w, s in t.ranks():
        try:
            ms: int | MissingExpectedDuration = s.prefill.modeled_remaining_prefill_time_ms(now)
        except MissingExpectedDuration as e:
            ms = e
        out.append(ModeledPrefillTimeLoad(w, ms))
    return out


# -- reads ----------------------------------------------------------------------------------


def slots(t: ActiveSequencesMultiWorker) -> dict[WorkerWithDpRank, ActiveSequences]:
    """Every rank's sequences (read only)."""
    return t._slots


def active_request_counts(t: ActiveSequencesMultiWorker) -> dict[WorkerWithDpRank, int]:
    """Every rank's number of active requests (a rank's copy of a request counts there)."""
    return {w: len(s.requests) for w, s in t.ranks()}


def request_ranks(t: ActiveSequencesMultiWorker) -> dict[str, WorkerWithDpRank]:
    """Every indexed request id with its rank (a copy)."""
    return dict(t.indexed_requests())


def request_loras(t: ActiveSequencesMultiWorker) -> dict[str, str]:
    """Every indexed request's LoRA, for those with one (a copy)."""
    return dict(t._requests.loras)


def load_columns(t: ActiveSequencesMultiWorker) -> LoadColumns:
    """The tracker's read model of every rank's load."""
    return t._columns


def is_membership_empty(t: ActiveSequencesMultiWorker) -> bool:
    """Whether the overlap index holds no prompt."""
    return t._trie.is_empty()


def assert_trie_consistent(t: ActiveSequencesMultiWorker) -> None:
    t._trie.assert_consistent()


def assert_completely_drained(t: ActiveSequencesMultiWorker, decay_now: int) -> None:
    """The seeds' ``assert_completely_drained``: no load, request, LoRA or index entry left."""
    blocks = t.active_blocks()
    assert all(v == 0 for v in blocks.values()), f"expected zero active blocks, got {blocks}"
    tokens = t.active_tokens(decay_now)
    assert all(v == 0 for v in tokens.values()), f"expected zero active tokens, got {tokens}"
    reqs = active_request_counts(t)
    assert all(v == 0 for v in reqs.values()), f"expected zero active requests, got {reqs}"
    left = request_ranks(t)
    assert not left, f"expected no request mappings, got {left}"
    loras = t.get_active_lora_counts()
    assert not loras, f"expected no LoRA counts, got {loras}"
    assert is_membership_empty(t), "expected the overlap index to be empty after drain"
    for w, s in t.ranks():
        assert not s.blocks.refcount, f"{w} still references blocks"
