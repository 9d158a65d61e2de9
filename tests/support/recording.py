"""Helpers shared by the multi-worker and replica-sync unit tests (ports of the seeds' helpers).

``RecordingPublisher`` records everything a tracker publishes; ``naive_potential_loads`` is an
oracle for ``potential_blocks_and_tokens`` that applies the SPEC §4.9 prefix rule by brute force.
"""

from __future__ import annotations

from kv_slot_tracker.core.events import ActiveSequenceEvent
from kv_slot_tracker.core.hashing import sequence_hashes_for_tokens
from kv_slot_tracker.core.tracker import ActiveSequencesMultiWorker, SequencePublisher
from kv_slot_tracker.core.types import (
    NS_PER_S,
    ActiveLoad,
    PrefillLoadHint,
    PrefillTokenDeltas,
    WorkerWithDpRank,
)
from tests.support.prefill import tokens_for
from tests.support.tracker import slots

__all__ = [
    "RecordingPublisher",
    "modeled_hint",
    "naive_overlap",
    "naive_potential_loads",
    "seq_hashes_for_tokens",
    "tracking_hint",
]


class RecordingPublisher(SequencePublisher):
    """Records loads, load batches, observations, topology observations and enqueued events.

    ``observations`` holds ``(worker, blocks, tokens)`` tuples like the seeds' recorder;
    ``worker_types`` holds the ``worker_type`` label of every ``observe_*`` call, in call order. Set
    ``enqueue_error`` to an exception to make ``enqueue_event`` raise it (after recording).
    """

    def __init__(self) -> None:
        self.single_loads: list[ActiveLoad] = []
        self.load_batches: list[list[ActiveLoad]] = []
        self.observations: list[tuple[WorkerWithDpRank, int, int]] = []
        self.registered: list[WorkerWithDpRank] = []
        self.removed: list[WorkerWithDpRank] = []
        self.events: list[ActiveSequenceEvent] = []
        self.worker_types: list[str] = []
        self.enqueue_error: Exception | None = None

    @property
    def enqueued(self) -> list[ActiveSequenceEvent]:
        """Alias of ``events``."""
        return self.events

    def clear(self) -> None:
        self.single_loads.clear()
        self.load_batches.clear()
        self.observations.clear()
        self.registered.clear()
        self.removed.clear()
        self.events.clear()
        self.worker_types.clear()

    def enqueue_event(self, event: ActiveSequenceEvent) -> None:
        self.events.append(event)
        if self.enqueue_error is not None:
            raise self.enqueue_error

    def publish_load(self, load: ActiveLoad) -> None:
        self.single_loads.append(load)

    def publish_load_batch(self, loads: list[ActiveLoad]) -> None:
        self.load_batches.append(list(loads))

    def observe_load(
        self, worker: WorkerWithDpRank, worker_type: str, blocks: int, tokens: int
    ) -> None:
        self.observations.append((worker, blocks, tokens))
        self.worker_types.append(worker_type)

    def observe_worker_registered(self, worker: WorkerWithDpRank, worker_type: str) -> None:
        self.registered.append(worker)
        self.worker_types.append(worker_type)

    def observe_worker_removed(self, worker: WorkerWithDpRank, worker_type: str) -> None:
        self.removed.append(worker)
        self.worker_types.append(worker_type)


def naive_overlap(prompts: list[list[int]], query: list[int] | None) -> int:
    """Longest common prefix of ``query`` with any of ``prompts`` (SPEC §4.9 prefix rule)."""
    if not query:
        return 0
    best = 0
    for prompt in prompts:
        k = 0
        for a, b in zip(query, prompt, strict=False):
            if a != b:
                break
            k += 1
        best = max(best, k)
    return best


def naive_potential_loads(
    tracker: ActiveSequencesMultiWorker,
    query: list[int] | None,
    deltas: PrefillTokenDeltas | None,
    decay_now: int,
) -> tuple[dict[WorkerWithDpRank, int], dict[WorkerWithDpRank, int]]:
    """Brute-force ``(potential_blocks, potential_tokens)`` from each rank slot's requests.

    Reads the per-rank slots (not the tracker's read model or overlap index) so it is an
    independent oracle: blocks = slot's active blocks + len(query) - prefix overlap; tokens =
    slot's active prefill tokens at ``decay_now`` + ``tokens_for(deltas, worker)``.
    """
    deltas = deltas or PrefillTokenDeltas.none()
    q_len = len(query) if query else 0
    blocks: dict[WorkerWithDpRank, int] = {}
    tokens: dict[WorkerWithDpRank, int] = {}
    for worker, slot in slots(tracker).items():
        prompts = [st.prompt_blocks for st in slot.requests.values()]
        overlap = naive_overlap(prompts, query)
        blocks[worker] = slot.active_blocks() + max(0, q_len - overlap)
        tokens[worker] = slot.active_tokens(decay_now) + tokens_for(deltas, worker)
    return blocks, tokens


def seq_hashes_for_tokens(
    tokens: list[int], lora: str | None = None, block_size: int = 4
) -> list[int]:
    """Chained sequence hashes of the full blocks of ``tokens`` (the seeds' helper)."""
    return sequence_hashes_for_tokens(list(tokens), block_size, lora)


def tracking_hint(n: int) -> PrefillLoadHint:
    """``n`` prefill tokens with no modeled duration."""
    return PrefillLoadHint(n, None)


def modeled_hint(n: int, secs: int | float) -> PrefillLoadHint:
    """``n`` prefill tokens expected to take ``secs`` seconds."""
    return PrefillLoadHint(n, round(secs * NS_PER_S))
