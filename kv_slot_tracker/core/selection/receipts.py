"""Routing receipts: what one selection saw, what it chose and why, and what happened to it.

Why it exists: an operator running KV-aware routing cannot tell from counters alone whether the
router routes well. A receipt joins one decision (every candidate rank with its cost terms, the
chosen rank, the rank with the most cached prefix, the ties and what decided) with its outcome
(booked, prefill done, freed, the cached tokens the engine reported, whether the blocks the
prediction counted on were still on the rank when it stored the rest of the prompt).

Why it is cheap: a receipt is one record made in C (a msgspec struct, which the garbage collector
does not track) of references to what the decision computed anyway: the candidate ranks (the
tracker's list, shared), their P, D + new, A and overlap columns and the costs packed into one
bytes object (msgpack, in C; the collector never tracks bytes), the chosen rank and the inputs.
Nothing per rank is computed when it is made: the ranks with the most overlap, what decided,
the tie set, the reason for a non-optimal choice, the per-rank rows with their decayed credits
and the predicted hit rate are worked out when a receipt is read. Recording a decision costs a
``max`` over the overlap column and a few counter updates (the decision statistics,
``decision_stats``, read by the metrics at scrape time).

This module holds the receipt and how a decision is described (what decided, why a choice was
not the most cached one, the hit rate); ``receipt_ring`` keeps the receipts and follows them to
their outcomes, ``decision_stats`` counts them per partition. Receipts are local to the instance
that decided: they are not replicated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec

from ..types import WorkerWithDpRank
from .config import RouterConfig
from .cost import request_blocks

# What decided a selection (``Receipt.decided_by``).
COST = "cost"  # the one rank with the lowest cost
TIE = "tie"  # several ranks shared the lowest cost: a uniform draw among them
TEMPERATURE = "temperature"  # a softmax draw over the costs (temperature > 0)
PIN = "pin"  # pinned_worker: chosen without scoring the others
SESSION = "session"  # session affinity restricted the candidates to the bound worker
ONLY = "only_candidate"  # one rank to choose from (one rank in the partition or allowed)
DECIDERS = (COST, TIE, TEMPERATURE, PIN, SESSION, ONLY)

# Why a decision did not take a rank with the most cached prefix (``non_optimal_reason``).
ALLOWED = "allowed"  # allowed_worker_ids left out every rank with the most overlap
LOAD = "load"  # the cost preferred a less cached, less loaded rank
REASONS = (LOAD, TIE, TEMPERATURE, PIN, SESSION, ALLOWED)

# Receipt states.
SELECTED = "selected"  # chosen, not booked (query-only /select, or explain)
BOOKED = "booked"
FREED = "freed"

Columns = tuple[
    Sequence[WorkerWithDpRank], Sequence[int], Sequence[int], Sequence[int], Sequence[int]
]
"""A selection's candidates as columns: their ranks, P, D + new, A and the overlap k."""

pack_columns = msgspec.msgpack.Encoder().encode
"""``Receipt.values`` of ``(prefill, decode, requests, overlap, costs)``: in C, about ten
instructions a number."""
_unpack = msgspec.msgpack.Decoder(
    tuple[list[int], list[int], list[int], list[int], list[float]]
).decode


class Receipt(msgspec.Struct, gc=False):
    """One selection: references to what the decision computed anyway (its columns, the
    scored ranks and their costs, the inputs), and later its outcome. Everything else (the most
    overlap and the ranks holding it, what decided, the tie set, the reason for a non-optimal
    choice, the per-rank rows, the predicted hit rate) is derived when it is read. ``as_dict``
    renders it.

    A msgspec struct: made in C from its positional fields (no Python ``__init__``), and never
    tracked by the garbage collector (it can hold no cycle: nothing it references refers back
    to it). Its numbers are one bytes object, so thousands of kept receipts give collections
    nothing to traverse."""

    receipt_id: str
    selection_id: str | None
    action: str  # "select", "select_and_reserve" or "explain"
    at: float
    decided_ns: int
    key: tuple[str, str]
    """The partition ``(model_name, routing_group)``."""
    block_size: int
    isl_tokens: int
    prompt_blocks: int
    workers: Sequence[WorkerWithDpRank]
    """The candidate ranks (the tracker's list, shared: not copied)."""
    values: bytes
    """The candidates' P, D + new, A and overlap k columns and the scored ranks' costs, packed
    (``pack_columns``): one bytes object, which the garbage collector never tracks. Kept as
    tuples or lists, the numbers were traversed by every collection while young (more than a
    third of a receipt's cost), and the tuples, holding ranks, were never untracked."""
    max_overlap: int
    """The most cached blocks of the prompt on any candidate."""
    lower: Sequence[tuple[int, int]] | None
    """KV events on, when some rank holds prompt blocks in host or disk memory: per rank its
    ``(host_pinned_extension, disk_extension)`` blocks."""
    scored: Sequence[WorkerWithDpRank]
    chosen: WorkerWithDpRank
    chosen_overlap: int
    effective_prefill_tokens: int
    config: RouterConfig
    pinned_worker: WorkerWithDpRank | None = None
    allowed: Sequence[int] | None = None
    session_id: str | None = None
    session_worker: int | None = None
    by_session: bool = False
    """Session affinity restricted the candidates to the bound worker."""
    state: str = SELECTED
    booked_at: float | None = None
    booked_ns: int | None = None
    prefill_done_at: float | None = None
    prefill_seconds: float | None = None
    freed_at: float | None = None
    cached_tokens: int | None = None
    """The cached prompt tokens the client reported (the engine's ``cached_tokens``)."""
    kv_predicted_blocks: int | None = None
    kv_still_held_blocks: int | None = None
    """KV events: when the chosen rank stored the rest of the prompt, how many of the predicted
    cached blocks it still held."""
    size: int = 0

    # -- derived when read ----------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.key[0]

    @property
    def routing_group(self) -> str:
        return self.key[1]

    @property
    def columns(self) -> Columns:
        """The candidates' ``(workers, prefill, decode, requests, overlap)`` columns."""
        prefill, decode, requests, overlap, _ = _unpack(self.values)
        return (self.workers, prefill, decode, requests, overlap)

    @property
    def costs(self) -> list[float]:
        """The cost of each scored rank."""
        return _unpack(self.values)[4]

    @property
    def overlap(self) -> list[int]:
        return _unpack(self.values)[3]

    @property
    def pinned(self) -> bool:
        return self.pinned_worker is not None

    @property
    def optimal(self) -> bool:
        """The chosen rank has the most cached prefix of the prompt among the candidates."""
        return self.chosen_overlap >= self.max_overlap

    @property
    def predicted_cached_tokens(self) -> int:
        return min(self.isl_tokens, self.chosen_overlap * self.block_size)

    @property
    def decided_by(self) -> str:
        """What decided (``decided_by``)."""
        return decided_by(
            self.pinned_worker is not None,
            self.by_session,
            len(self.costs),
            self.costs,
            self.config.router_temperature,
        )

    def tie_set(self) -> list[WorkerWithDpRank]:
        """The scored ranks sharing the lowest cost."""
        costs = self.costs
        if not costs:
            return []
        lo = min(costs)
        return [w for w, c in zip(self.scored, costs, strict=True) if c == lo]

    def non_optimal_reason(self) -> str | None:
        """Why the decision did not take a rank with the most overlap (None when it did):
        ``pin`` or ``session`` (the choice was made for it), ``allowed`` (no rank with the most
        overlap was allowed), ``tie`` or ``temperature`` (such a rank had the lowest cost but
        the draw took another), else ``load`` (the cost preferred a less cached rank)."""
        best = self.max_overlap
        if self.chosen_overlap >= best:
            return None
        if self.pinned_worker is not None:
            return PIN
        if self.by_session:
            return SESSION
        workers, overlap, costs = self.workers, self.overlap, self.costs
        drawn: str | None = None  # TIE or TEMPERATURE when a draw decided (``decided_by``)
        if len(costs) > 1:
            if self.config.router_temperature > 0.0:
                drawn = TEMPERATURE
            elif costs.count(min(costs)) > 1:
                drawn = TIE
        if len(self.scored) == len(workers):  # every candidate scored: costs align with overlaps
            if drawn is not None:
                lo = min(costs)
                if any(k == best for c, k in zip(costs, overlap, strict=True) if c == lo):
                    return drawn
            return LOAD
        best_ranks = {w for w, k in zip(workers, overlap, strict=True) if k == best}
        if best_ranks.isdisjoint(self.scored):
            return ALLOWED
        if drawn is not None and not best_ranks.isdisjoint(self.tie_set()):
            return drawn
        return LOAD

    def candidate_rows(self) -> list[dict[str, Any]]:
        """Every candidate rank with its cost terms (``cost`` and ``decayed_credit`` null for a
        rank that was not scored: pinned, or left out by the allowed list or a session)."""
        cost_of = dict(zip(self.scored, self.costs, strict=True))
        cfg = self.config
        bs = self.block_size
        workers, prefill, decode, requests, overlap = self.columns
        scored_prefill = [p for w, p in zip(workers, prefill, strict=True) if w in cost_of]
        floor = min(scored_prefill, default=0)
        rb = request_blocks(self.isl_tokens, bs)
        with_decay = cfg.track_prefill_tokens and cfg.overlap_score_credit_decay > 0.0
        rows = []
        for i, w in enumerate(workers):
            k = overlap[i]
            host, disk = self.lower[i] if self.lower is not None else (0, 0)
            decay = 1.0
            if with_decay:
                excess = max(0, prefill[i] - floor) / bs
                normalised = excess / rb if rb else (math.inf if excess else math.nan)
                decay = 1.0 / (1.0 + cfg.overlap_score_credit_decay * normalised)
            cost = cost_of.get(w)
            rows.append(
                {
                    "worker_id": w.worker_id,
                    "dp_rank": w.dp_rank,
                    "device_blocks": k,
                    "host_pinned_extension_blocks": host,
                    "disk_extension_blocks": disk,
                    "overlap_credit_blocks": None
                    if cost is None
                    else _finite(
                        cfg.overlap_score_credit * decay * k
                        + cfg.host_cache_hit_weight * host
                        + cfg.disk_cache_hit_weight * disk
                    ),
                    "credit_decay": _finite(decay),
                    "active_prefill_tokens": prefill[i],
                    "potential_decode_blocks": decode[i],
                    "active_requests": requests[i],
                    "cost": None if cost is None else _finite(cost),
                }
            )
        return rows

    def as_dict(self, instance: str) -> dict[str, Any]:
        chosen = self.chosen
        most = self.max_overlap
        best = [
            {"worker_id": w.worker_id, "dp_rank": w.dp_rank}
            for w, k in zip(self.workers, self.overlap, strict=True)
            if k == most
        ]
        return {
            "receipt_id": self.receipt_id,
            "selection_id": self.selection_id,
            "instance": instance,
            "action": self.action,
            "time": self.at,
            "model_name": self.model_name,
            "routing_group": self.routing_group,
            "block_size": self.block_size,
            "isl_tokens": self.isl_tokens,
            "prompt_blocks": self.prompt_blocks,
            "chosen": {"worker_id": chosen.worker_id, "dp_rank": chosen.dp_rank},
            "chosen_overlap_blocks": self.chosen_overlap,
            "max_overlap_blocks": most,
            "max_overlap_ranks": best,
            "optimal": self.optimal,
            "non_optimal_reason": self.non_optimal_reason(),
            "overlap_blocks_lost": most - self.chosen_overlap,
            "decided_by": self.decided_by,
            "tie_set": [{"worker_id": w.worker_id, "dp_rank": w.dp_rank} for w in self.tie_set()],
            "temperature": self.config.router_temperature,
            "pinned": self.pinned_worker is not None,
            "allowed_worker_ids": None if self.allowed is None else list(self.allowed),
            "session_id": self.session_id,
            "session_worker_id": self.session_worker,
            "candidates": self.candidate_rows(),
            "predicted": {
                "hit_rate": hit_rate(self.chosen_overlap, self.prompt_blocks),
                "cached_tokens": self.predicted_cached_tokens,
                "effective_prefill_tokens": self.effective_prefill_tokens,
            },
            "outcome": {
                "state": self.state,
                "booked_at": self.booked_at,
                "prefill_done_at": self.prefill_done_at,
                "prefill_seconds": self.prefill_seconds,
                "freed_at": self.freed_at,
                "cached_tokens": self.cached_tokens,
                "observed_hit_rate": None
                if self.cached_tokens is None
                else hit_rate(self.cached_tokens, self.isl_tokens),
                "prediction_error_tokens": None
                if self.cached_tokens is None
                else self.predicted_cached_tokens - self.cached_tokens,
                "kv_predicted_blocks": self.kv_predicted_blocks,
                "kv_still_held_blocks": self.kv_still_held_blocks,
            },
        }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def hit_rate(part: int, whole: int) -> float:
    """``part / whole`` capped at 1 (0 for an empty prompt)."""
    if whole <= 0:
        return 0.0
    return min(1.0, part / whole)


def decided_by(
    pinned: bool,
    session: bool,
    scored: int,
    costs: Sequence[float],
    temperature: float,
) -> str:
    """What decided a selection among ``scored`` ranks with ``costs``."""
    if pinned:
        return PIN
    if session:
        return SESSION
    if scored == 1:
        return ONLY
    if temperature > 0.0:
        return TEMPERATURE
    lo = min(costs)
    return TIE if costs.count(lo) > 1 else COST
