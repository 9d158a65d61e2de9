"""Value types shared by the tracker core.

Everything here is an immutable (or plain) record; the behaviour lives in the modules that use them.
Durations and instants are integer nanoseconds on the injected monotonic clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

# the ranges live in ``bounds``; re-exported for the modules that import them from here
from .bounds import I64_MAX as I64_MAX
from .bounds import I64_MIN as I64_MIN
from .bounds import U32_MAX as U32_MAX
from .bounds import U64_MAX as U64_MAX

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000

SequenceHash = int
RequestId = str


class WorkerWithDpRank(NamedTuple):
    """One data-parallel rank of one worker: the unit that owns requests, blocks and load."""

    worker_id: int
    dp_rank: int = 0

    def debug(self) -> str:
        """The Rust debug rendering used in error messages."""
        return f"WorkerWithDpRank {{ worker_id: {self.worker_id}, dp_rank: {self.dp_rank} }}"


class WorkerDpRange(NamedTuple):
    """An authoritative registration: ranks ``dp_start .. dp_start + dp_size - 1``."""

    worker_id: int
    dp_start: int = 0
    dp_size: int = 1

    def ranks(self) -> list[WorkerWithDpRank]:
        return [
            WorkerWithDpRank(self.worker_id, r)
            for r in range(self.dp_start, self.dp_start + self.dp_size)
        ]


@dataclass(frozen=True, slots=True)
class PrefillLoadHint:
    """Prompt tokens still to prefill on the chosen worker, and optionally a modeled duration (ns)."""

    initial_effective_prefill_tokens: int
    expected_prefill_duration_ns: int | None = None


@dataclass(frozen=True, slots=True)
class ActiveLoad:
    """What a tracker publishes after each operation (kv_used_blocks is for engine loads only)."""

    worker_id: int
    dp_rank: int
    active_decode_blocks: int | None
    active_prefill_tokens: int | None
    kv_used_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerLoadProjection:
    active_prefill_tokens: int
    active_decode_blocks: int
    additional_active_blocks: int

    def potential_decode_blocks(self) -> int:
        return self.active_decode_blocks + self.additional_active_blocks


@dataclass(frozen=True, slots=True)
class PrefillTokenDeltas:
    """Prefill tokens a prospective request would add; ``default_tokens`` for unlisted workers."""

    default_tokens: int = 0
    by_worker: dict[WorkerWithDpRank, int] = field(default_factory=dict)

    @classmethod
    def none(cls) -> PrefillTokenDeltas:
        return cls(0, {})

    @classmethod
    def uniform(cls, tokens: int) -> PrefillTokenDeltas:
        return cls(tokens, {})

    @classmethod
    def new(cls, default_tokens: int, by_worker: dict[WorkerWithDpRank, int]) -> PrefillTokenDeltas:
        return cls(default_tokens, dict(by_worker))


@dataclass(slots=True)
class LifecycleCounts:
    """Requests a tracker added (locally or from a peer), freed, and expired in its sweeps
    (``force_expire_requests_across_all_workers``), since the counts were created."""

    added: int = 0
    freed: int = 0
    expired: int = 0


@dataclass(slots=True)
class SequenceMutationOutcome:
    """What a rank's expiry check freed (adds run one first)."""

    expired_request_ids: set[RequestId] = field(default_factory=set)
    # prompt of each expired request, so indexes built on whole prompt paths can drop them
    expired_prompts: dict[RequestId, list[SequenceHash]] = field(default_factory=dict)


def round_half_away_from_zero_usize(x: float) -> int:
    """Rust's ``f64::round() as usize``: half away from zero, negatives and NaN become 0."""
    if not x > 0.0:  # also catches NaN
        return 0
    if x >= 18446744073709551616.0:  # 2^64 and inf: ``as usize`` saturates
        return U64_MAX
    t = int(x)
    return t + 1 if x - t >= 0.5 else t
