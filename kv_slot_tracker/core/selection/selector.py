"""Pick one worker rank for a prompt: eligibility, scoring, argmin or softmax sampling.

Why it is pure and takes a ``random.Random``: the reference breaks exact ties with a coin flip and
samples when the temperature is positive; injecting the generator makes both reproducible in tests
and lets a differential comparison replay choices. The rules follow the reference's
``pick_default_worker`` and ``RoutingEligibility``:

* a pinned rank must belong to an allowed worker (``PinnedWorkerNotAllowed``) and exist among the
  candidates (``NoEndpoints``); it is then chosen without scoring the others;
* ``allowed_worker_ids`` keeps the ranks of the listed workers; nothing left -> ``NoEndpoints``;
* temperature 0: minimum cost, exact ties uniformly at random (one ``randrange`` over the tied
  ranks); temperature T > 0: one ``random()`` draw against the cumulative softmax of
  ``-(cost - min) / ((max - min) * T)``, uniform when all costs are equal.

The caller reports an empty partition itself (``NoSchedulableWorkers``, with the partition's
name); ``select`` raises ``NoEndpoints`` for an empty candidate list.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ..types import WorkerWithDpRank
from .config import RouterConfig
from .cost import (
    RankInput,
    effective_prefill_tokens,
    lower_credit_tokens,
    rank_logits,
    request_blocks,
)
from .errors import NoEndpoints, PinnedWorkerNotAllowed


@dataclass(frozen=True, slots=True)
class WorkerOverlap:
    """The select response's ``overlap`` block: the chosen worker's cached prefix, in tokens.

    ``dp_tokens`` has one entry per rank of the chosen worker among the candidates
    (``overlap.dp``); ``max_tokens`` is their maximum, which the reference reports as
    ``longest_matched``, ``gpu``, ``cpu`` and ``disk`` alike (the cache is device-only, and the
    lower tiers are cumulative).
    """

    dp_tokens: dict[int, int]
    max_tokens: int
    cpu_tokens: int | None = None
    """KV events on: the largest device + host prefix in tokens (``None``: ``max_tokens``)."""
    disk_tokens: int | None = None
    """KV events on: the largest device + host + disk prefix in tokens; also
    ``longest_matched`` (``None``: ``max_tokens``)."""


@dataclass(frozen=True, slots=True)
class Selection:
    """The outcome of one selection: the rank and what the response echoes about it."""

    worker: WorkerWithDpRank
    logit: float
    overlap_blocks: int
    effective_prefill_tokens: int
    """``isl - min(isl, k*bs)`` on the chosen rank: the prefill tokens a booking adds."""
    potential_decode_blocks: int
    """D + new + uncovered tail blocks on the chosen rank (the response field)."""
    overlap: WorkerOverlap
    scored: Sequence[WorkerWithDpRank]
    costs: Sequence[float]
    """Cost of each rank of ``scored`` (only the pinned rank when pinned)."""

    @property
    def logits(self) -> dict[WorkerWithDpRank, float]:
        """Cost of every rank that was scored (only the pinned rank when pinned)."""
        return dict(zip(self.scored, self.costs, strict=True))


def pick_min(logits: Sequence[float], rng: random.Random) -> int:
    """Index of the minimum; exact ties uniformly at random (one draw when tied)."""
    lo = min(logits)
    ties = [row for row, cost in enumerate(logits) if cost == lo]
    if len(ties) == 1:
        return ties[0]
    return ties[rng.randrange(len(ties))]


def softmax_probabilities(logits: Sequence[float], temperature: float) -> list[float]:
    """Sampling probabilities of the costs at ``temperature`` > 0 (lower cost, higher chance)."""
    lo, hi = min(logits), max(logits)
    if lo == hi:
        return [1.0 / len(logits)] * len(logits)
    rng_span = hi - lo
    magnitude = 1.0 if math.isfinite(rng_span) else max(abs(lo), abs(hi))
    lo_n = lo / magnitude
    scale = -1.0 / ((hi / magnitude - lo_n) * temperature)
    shift = lo_n * scale
    weights = [math.exp(c / magnitude * scale - shift) for c in logits]
    total = sum(weights)
    return [w / total for w in weights]


def pick_softmax(logits: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Index drawn from ``softmax_probabilities`` with one ``rng.random()`` draw."""
    sample = rng.random()
    cumulative = 0.0
    for row, p in enumerate(softmax_probabilities(logits, temperature)):
        cumulative += p
        if sample <= cumulative:
            return row
    return len(logits) - 1


def select(
    candidates: Sequence[RankInput],
    *,
    isl_tokens: int,
    block_size: int,
    num_sequence_hashes: int,
    config: RouterConfig,
    rng: random.Random,
    pinned_worker: WorkerWithDpRank | None = None,
    allowed_worker_ids: Collection[int] | None = None,
) -> Selection:
    """Choose a rank among ``candidates`` (every rank of the partition's schedulable workers).

    ``config`` holds the cost knobs. Raises ``PinnedWorkerNotAllowed`` or ``NoEndpoints``.
    ``select_columns`` is the same with the candidates given as parallel lists.
    """
    return select_columns(
        [c.worker for c in candidates],
        [c.active_prefill_tokens for c in candidates],
        [c.potential_decode_blocks for c in candidates],
        [c.active_requests for c in candidates],
        [c.overlap_blocks for c in candidates],
        isl_tokens=isl_tokens,
        block_size=block_size,
        num_sequence_hashes=num_sequence_hashes,
        config=config,
        rng=rng,
        pinned_worker=pinned_worker,
        allowed_worker_ids=allowed_worker_ids,
    )


def select_columns(
    workers: Sequence[WorkerWithDpRank],
    prefill: Sequence[int],
    decode: Sequence[int],
    requests: Sequence[int],
    overlap: Sequence[int],
    *,
    isl_tokens: int,
    block_size: int,
    num_sequence_hashes: int,
    config: RouterConfig,
    rng: random.Random,
    pinned_worker: WorkerWithDpRank | None = None,
    allowed_worker_ids: Collection[int] | None = None,
    grouped: bool = False,
    lower: Sequence[tuple[int, int]] | None = None,
) -> Selection:
    """``select`` on candidates given as columns: each rank's P, D + new, A and k (the
    ``RankInput`` fields) at the same index. Building no object per rank is what makes a
    selection over many ranks cheap. ``grouped``: each worker's ranks are adjacent (sorted
    ranks, as a tracker lists them), so the answer's per-rank overlap looks only at them."""
    if pinned_worker is not None:
        if allowed_worker_ids is not None and pinned_worker.worker_id not in set(
            allowed_worker_ids
        ):
            raise PinnedWorkerNotAllowed(pinned_worker.worker_id)
        try:
            rows: Sequence[int] = (workers.index(pinned_worker),)
        except ValueError:
            raise NoEndpoints() from None
        i = rows[0]
        floor = prefill[i]
    elif allowed_worker_ids is not None:
        allowed = frozenset(allowed_worker_ids)
        rows = [i for i, w in enumerate(workers) if w.worker_id in allowed]
        floor = min((prefill[i] for i in rows), default=0)
    else:
        rows = range(len(workers))
        floor = min(prefill, default=0)
    if not rows:
        raise NoEndpoints()
    columns: tuple[Sequence[int], ...]
    if isinstance(rows, range):
        columns = (prefill, decode, requests, overlap)
    else:
        columns = tuple([col[i] for i in rows] for col in (prefill, decode, requests, overlap))
    credit_of = None
    if lower is not None:
        hw, dw = config.host_cache_hit_weight, config.disk_cache_hit_weight
        credit_of = [hw * h + dw * d for h, d in lower]
    costs = rank_logits(
        *columns,
        isl_tokens=isl_tokens,
        block_size=block_size,
        config=config,
        min_prefill_tokens=floor,
        lower_credit=None if credit_of is None else [credit_of[i] for i in rows],
    )
    if len(costs) == 1:
        pick = 0
    elif config.router_temperature == 0.0:
        pick = pick_min(costs, rng)
    else:
        pick = pick_softmax(costs, config.router_temperature, rng)
    i = rows[pick]
    chosen, k = workers[i], overlap[i]
    tail = request_blocks(isl_tokens, block_size) - num_sequence_hashes
    ept = effective_prefill_tokens(isl_tokens, k, block_size)
    answer = (
        worker_overlap(workers, overlap, chosen.worker_id, block_size)
        if not grouped
        else _adjacent_overlap(workers, overlap, i, block_size)
    )
    if lower is not None and credit_of is not None:
        ept = max(0, ept - lower_credit_tokens(credit_of[i], block_size))
        ranks = [j for j, w in enumerate(workers) if w.worker_id == chosen.worker_id]
        answer = WorkerOverlap(
            answer.dp_tokens,
            answer.max_tokens,
            max((overlap[j] + lower[j][0]) * block_size for j in ranks),
            max((overlap[j] + lower[j][0] + lower[j][1]) * block_size for j in ranks),
        )
    return Selection(
        worker=chosen,
        logit=costs[pick],
        overlap_blocks=k,
        effective_prefill_tokens=ept,
        potential_decode_blocks=decode[i] + (tail if tail > 0 else 0),
        overlap=answer,
        scored=workers if isinstance(rows, range) else [workers[r] for r in rows],
        costs=costs,
    )


def worker_overlap(
    workers: Sequence[WorkerWithDpRank],
    overlap: Sequence[int],
    worker_id: int,
    block_size: int,
) -> WorkerOverlap:
    dp = {
        w.dp_rank: k * block_size
        for w, k in zip(workers, overlap, strict=True)
        if w.worker_id == worker_id
    }
    return WorkerOverlap(dp_tokens=dp, max_tokens=max(dp.values(), default=0))


def _adjacent_overlap(
    workers: Sequence[WorkerWithDpRank], overlap: Sequence[int], i: int, block_size: int
) -> WorkerOverlap:
    """``worker_overlap`` of the worker of ``workers[i]`` when its ranks are adjacent."""
    wid = workers[i].worker_id
    lo = i
    while lo > 0 and workers[lo - 1].worker_id == wid:
        lo -= 1
    hi = i + 1
    while hi < len(workers) and workers[hi].worker_id == wid:
        hi += 1
    dp = {workers[j].dp_rank: overlap[j] * block_size for j in range(lo, hi)}
    return WorkerOverlap(dp_tokens=dp, max_tokens=max(dp.values()))
