"""Pick one worker rank for a prompt: eligibility, scoring, argmin or softmax sampling.

Why it is pure and takes a ``random.Random``: the reference breaks exact ties with a coin flip and
samples when the temperature is positive; injecting the generator makes both reproducible in tests
and lets a differential comparison replay choices. The rules follow the reference's
``pick_default_worker`` and ``RoutingEligibility``:

* a pinned rank must belong to an allowed worker (``PinnedWorkerNotAllowed``) and exist among the
  candidates (``NoEndpoints``); it is then chosen without scoring the others;
* ``allowed_worker_ids`` keeps the ranks of the listed workers; nothing left -> ``NoEndpoints``;
* temperature 0: minimum cost, exact ties uniformly at random (reservoir sampling, one
  ``randrange`` per tie met); temperature T > 0: one ``random()`` draw against the cumulative
  softmax of ``-(cost - min) / ((max - min) * T)``, uniform when all costs are equal.

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
    min_active_prefill_tokens,
    rank_logit,
    response_decode_blocks,
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
    logits: dict[WorkerWithDpRank, float]
    """Cost of every rank that was scored (only the pinned rank when pinned)."""


def eligible_ranks(
    candidates: Sequence[RankInput], allowed_worker_ids: Collection[int] | None
) -> list[RankInput]:
    if allowed_worker_ids is None:
        return list(candidates)
    allowed = frozenset(allowed_worker_ids)
    return [r for r in candidates if r.worker.worker_id in allowed]


def pick_min(logits: Sequence[float], rng: random.Random) -> int:
    """Index of the minimum; exact ties uniformly at random (one draw per extra tie met)."""
    best_row, best_cost, ties = 0, math.inf, 0
    for row, cost in enumerate(logits):
        if cost < best_cost:
            best_row, best_cost, ties = row, cost, 1
        elif cost == best_cost:
            ties += 1
            if rng.randrange(ties) == 0:
                best_row = row
    return best_row


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

    ``config`` is the router config with the request's override applied
    (``RouterConfig.with_override``). Raises ``PinnedWorkerNotAllowed`` or ``NoEndpoints``.
    """
    if pinned_worker is not None:
        if allowed_worker_ids is not None and pinned_worker.worker_id not in set(
            allowed_worker_ids
        ):
            raise PinnedWorkerNotAllowed(pinned_worker.worker_id)
        chosen = next((r for r in candidates if r.worker == pinned_worker), None)
        if chosen is None:
            raise NoEndpoints()
        logit = rank_logit(
            chosen,
            isl_tokens=isl_tokens,
            block_size=block_size,
            config=config,
            min_prefill_tokens=chosen.active_prefill_tokens,
        )
        logits = {chosen.worker: logit}
    else:
        ranks = eligible_ranks(candidates, allowed_worker_ids)
        if not ranks:
            raise NoEndpoints()
        floor = min_active_prefill_tokens(ranks)
        costs = [
            rank_logit(
                r,
                isl_tokens=isl_tokens,
                block_size=block_size,
                config=config,
                min_prefill_tokens=floor,
            )
            for r in ranks
        ]
        if config.router_temperature == 0.0:
            row = pick_min(costs, rng)
        else:
            row = pick_softmax(costs, config.router_temperature, rng)
        chosen, logit = ranks[row], costs[row]
        logits = {r.worker: c for r, c in zip(ranks, costs, strict=True)}
    return Selection(
        worker=chosen.worker,
        logit=logit,
        overlap_blocks=chosen.overlap_blocks,
        effective_prefill_tokens=effective_prefill_tokens(
            isl_tokens, chosen.overlap_blocks, block_size
        ),
        potential_decode_blocks=response_decode_blocks(
            chosen, isl_tokens, block_size, num_sequence_hashes
        ),
        overlap=worker_overlap(candidates, chosen.worker.worker_id, block_size),
        logits=logits,
    )


def worker_overlap(
    candidates: Sequence[RankInput], worker_id: int, block_size: int
) -> WorkerOverlap:
    dp = {
        r.worker.dp_rank: r.overlap_blocks * block_size
        for r in candidates
        if r.worker.worker_id == worker_id
    }
    return WorkerOverlap(dp_tokens=dp, max_tokens=max(dp.values(), default=0))
