"""Per-rank load rows: what the HTTP edge and metrics read, computed in one pass per call.

Rows are plain tuples, sorted by rank: the potential-loads row answers every routing decision
and the edge encodes it directly, so no per-row object is built. The functions take the
tracker's state explicitly (ranks, their sequences and active-block counts).
"""

from __future__ import annotations

from .errors import MissingExpectedDuration
from .sequences import ActiveSequences
from .types import U64_MAX, PrefillTokenDeltas, WorkerWithDpRank

# (worker_id, dp_rank, potential_prefill_tokens, potential_decode_blocks, active_requests)
PotentialLoadRow = tuple[int, int, int, int, int]
# (worker_id, dp_rank, active_prefill_tokens, active_decode_blocks, active_requests,
#  modeled_remaining_prefill_ms | None)
RankLoadRow = tuple[int, int, int, int, int, int | None]

Slots = dict[WorkerWithDpRank, ActiveSequences]


def potential_rows(
    workers: list[WorkerWithDpRank],
    slots: Slots,
    blocks: dict[WorkerWithDpRank, int],
    overlaps: dict[WorkerWithDpRank, int],
    q_len: int,
    deltas: PrefillTokenDeltas | int | None,
    now: int,
) -> list[PotentialLoadRow]:
    """Each rank's prefill tokens and KV blocks if a prompt of ``q_len`` blocks, sharing
    ``overlaps[rank]`` of them with the rank's active prompts, went there. Prefill tokens
    saturate at 2^64-1. ``deltas``: the prompt's tokens per rank, or one count for every rank."""
    if deltas is None or type(deltas) is int:
        by_worker, default = None, deltas or 0
    else:
        by_worker, default = deltas.by_worker, deltas.default_tokens
    rows = []
    append = rows.append
    for w in workers:
        s = slots[w]
        tokens = s.prefill.active_tokens(now) + (
            by_worker.get(w, default) if by_worker else default
        )
        append(
            (
                w[0],
                w[1],
                tokens if tokens <= U64_MAX else U64_MAX,
                blocks[w] + q_len - overlaps.get(w, 0),
                len(s.requests),
            )
        )
    return rows


def rank_rows(
    workers: list[WorkerWithDpRank], slots: Slots, blocks: dict[WorkerWithDpRank, int], now: int
) -> list[RankLoadRow]:
    rows = []
    for w in workers:
        s = slots[w]
        try:
            modeled: int | None = s.prefill.modeled_remaining_prefill_time_ms(now)
        except MissingExpectedDuration:
            modeled = None
        rows.append(
            (
                w.worker_id,
                w.dp_rank,
                s.prefill.active_tokens(now),
                blocks[w],
                len(s.requests),
                modeled,
            )
        )
    return rows


def load_columns(
    workers: list[WorkerWithDpRank],
    slots: Slots,
    blocks: dict[WorkerWithDpRank, int],
    overlaps: dict[WorkerWithDpRank, int],
    q_len: int,
    now: int,
) -> tuple[list[WorkerWithDpRank], list[int], list[int], list[int]]:
    """``potential_rows`` without deltas as parallel lists, for a selection over all ranks: the
    sorted ranks, their prefill tokens, their active blocks plus the prompt's blocks not active
    there (prefix rule), and their active requests. No row object is built."""
    get = overlaps.get
    states = [slots[w] for w in workers]
    prefill = [s.prefill.active_tokens(now) for s in states]
    decode = [blocks[w] + q_len - get(w, 0) for w in workers]
    requests = [len(s.requests) for s in states]
    return workers, prefill, decode, requests
