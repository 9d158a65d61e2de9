"""Per-rank loads: what the HTTP edge, selection and metrics read.

Potential loads come as parallel columns in rank order (``LoadColumns``, kept between queries
and refreshed only where a rank changed), which the edge encodes directly; current loads as
plain tuples, one pass per call. No per-rank object is built.
"""

from __future__ import annotations

from typing import NamedTuple

from .errors import MissingExpectedDuration
from .sequences import ActiveSequences
from .types import WorkerWithDpRank

# (worker_id, dp_rank, potential_prefill_tokens, potential_decode_blocks, active_requests)
PotentialLoadRow = tuple[int, int, int, int, int]


class RankLoadRow(NamedTuple):
    """One rank's load now (what ``/loads`` and the metrics read, by name: four ints in a
    row are easily swapped by position)."""

    worker_id: int
    dp_rank: int
    active_prefill_tokens: int
    active_decode_blocks: int
    active_requests: int
    modeled_remaining_prefill_ms: int | None


Slots = dict[WorkerWithDpRank, ActiveSequences]


class Columns(NamedTuple):
    """Per rank, in rank order, as parallel lists: ``ranks`` (the tracker's sorted rank list,
    replaced, never changed, when its topology changes) and each rank's ``prefill`` tokens,
    ``decode`` blocks and active ``requests``. Named, so that no reader takes two of the three
    ``list[int]`` columns for each other by position."""

    ranks: list[WorkerWithDpRank]
    prefill: list[int]
    decode: list[int]
    requests: list[int]


def rank_rows(workers: list[WorkerWithDpRank], slots: Slots, now: int) -> list[RankLoadRow]:
    rows = []
    for w in workers:
        s = slots[w]
        try:
            modeled: int | None = s.prefill.modeled_remaining_prefill_time_ms(now)
        except MissingExpectedDuration:
            modeled = None
        rows.append(
            RankLoadRow(
                worker_id=w.worker_id,
                dp_rank=w.dp_rank,
                active_prefill_tokens=s.prefill.active_tokens(now),
                active_decode_blocks=s.blocks.active_blocks(),
                active_requests=len(s.requests),
                modeled_remaining_prefill_ms=modeled,
            )
        )
    return rows


class LoadColumns:
    """Every rank's load as parallel columns in rank order, kept between queries.

    A potential-loads query reads every rank; recomputing each rank's values per query costs
    more than the rest of the query. The columns keep, per rank, its active blocks, active
    requests and prefill tokens, and the tracker marks a rank ``changed`` whenever one of them
    may have moved: a query refreshes only the changed ranks, so it costs O(ranks + ranks
    changed since the last query) plus the prompt's overlap, and a lifecycle call one set
    insertion. Prefill tokens that decay with time (a modeled anchor) are read at query time.
    ``assert_fresh`` checks every unchanged rank against its sequences.
    """

    __slots__ = ("workers", "index", "tokens", "blocks", "requests", "decaying", "changed")

    def __init__(self, workers: list[WorkerWithDpRank]) -> None:
        self.workers = workers
        self.index = {w: i for i, w in enumerate(workers)}
        n = len(workers)
        self.tokens = [0] * n  # the static prefill tokens; 0 where they decay
        self.blocks = [0] * n
        self.requests = [0] * n
        self.decaying: dict[int, ActiveSequences] = {}  # rank index -> its sequences
        self.changed: set[WorkerWithDpRank] = set(workers)

    def refresh(self, slots: Slots) -> None:
        """Bring the changed ranks up to date."""
        index, decaying = self.index, self.decaying
        for w in self.changed:
            i = index[w]
            s = slots[w]
            self.blocks[i] = s.blocks.active_blocks()
            self.requests[i] = len(s.requests)
            tokens = s.prefill.static_tokens()
            if tokens is None:
                decaying[i] = s
                self.tokens[i] = 0
            else:
                decaying.pop(i, None)
                self.tokens[i] = tokens
        self.changed.clear()

    def columns(
        self, overlaps: dict[WorkerWithDpRank, int], q_len: int, extra_tokens: int, now: int
    ) -> Columns:
        """The sorted ranks, their prefill tokens plus ``extra_tokens``, their active blocks
        plus the prompt's blocks not active there (prefix rule: ``q_len - overlaps[rank]``),
        and their active requests (call ``refresh`` first)."""
        prefill = [t + extra_tokens for t in self.tokens] if extra_tokens else self.tokens[:]
        for i, s in self.decaying.items():
            prefill[i] = s.prefill.active_tokens(now) + extra_tokens
        decode = [b + q_len for b in self.blocks] if q_len else self.blocks[:]
        index = self.index
        for w, k in overlaps.items():
            decode[index[w]] -= k
        return Columns(self.workers, prefill, decode, self.requests[:])

    def assert_fresh(self, slots: Slots) -> None:
        """Every rank not marked changed holds its current values (a missed mark fails here)."""
        assert self.workers == sorted(slots), "columns kept after a topology change"
        for w, i in self.index.items():
            if w in self.changed:
                continue
            s = slots[w]
            assert self.blocks[i] == s.blocks.active_blocks(), f"stale block count of {w}"
            assert self.requests[i] == len(s.requests), f"stale request count of {w}"
            static = s.prefill.static_tokens()
            assert (i in self.decaying) == (static is None), f"stale decay state of {w}"
            if static is not None:
                assert self.tokens[i] == static, f"stale prefill tokens of {w}"
