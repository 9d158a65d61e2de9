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
``max`` over the overlap column and a few counter updates (the decision statistics, read by the
metrics at scrape time).

``ReceiptRing`` keeps the newest receipts, bounded by count and by an estimate of their bytes
(an upper bound of what a receipt holds alive, checked against ``tracemalloc`` in the tests).
``DecisionStats`` holds per-partition counters and histograms for the metrics, read at scrape
time. Receipts are local to the instance that decided: they are not replicated.

Pure: no clock is read here; times are passed in (``at``: wall-clock seconds, for the operator;
``now_ns``: the service's monotonic clock, for durations).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
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
FUNNEL = ("prompt", "indexed_any", "chosen", "reported_cached")
"""The cache-loss funnel's stages, in blocks: the prompt's blocks, the most of them cached on
any rank, cached on the chosen rank, and reported cached by the client (where it reports)."""

HIT_RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
ERROR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096)
"""Prediction error in tokens (predicted minus reported cached tokens): negative when the engine
had more cached than the router counted on."""

# Byte estimate of one receipt, an upper bound checked with tracemalloc in the tests: the object,
# its id and the ring's entry, and per candidate rank what it keeps alive (four packed numbers
# and a cost, at most 45 bytes, and the rank list when the tracker no longer shares it: 8 bytes
# and a rank object). Kept from when the columns were Python objects (170-185 bytes a rank).
RECEIPT_BASE_BYTES = 1536
RECEIPT_RANK_BYTES = 200

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


@dataclass(slots=True)
class Histogram:
    """Cumulative-ready bucket counts (``le`` bounds), their sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs for the exposition (``+Inf`` last)."""
        counts = self.counts or [0] * (len(self.bounds) + 1)
        out, running = [], 0
        for bound, c in zip((*self.bounds, math.inf), counts, strict=True):
            running += c
            out.append(("+Inf" if bound == math.inf else _bound_text(bound), running))
        return out


def _bound_text(b: float) -> str:
    return repr(float(b))


@dataclass(slots=True)
class DecisionStats:
    """Decision quality of one partition (never reset; read at scrape time)."""

    decisions: int = 0
    max_overlap_decisions: int = 0
    non_max: dict[str, int] = field(default_factory=dict)
    """Decisions that did not take a rank with the most overlap, by reason."""
    overlap_blocks_lost: int = 0
    """Blocks of overlap given up: the most overlap on any rank minus the chosen rank's."""
    funnel: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    """Blocks per ``FUNNEL`` stage (the last only for decisions with a reported outcome)."""
    reported: int = 0
    """Decisions whose cached tokens a client reported."""
    reported_prompt_blocks: int = 0
    reported_predicted_blocks: int = 0
    reported_predicted_tokens: int = 0
    reported_cached_tokens: int = 0
    """Predicted and reported cached tokens of the reported decisions (their difference over
    ``reported`` is the mean prediction error; the error histogram has negative buckets, which
    the exposition gives no sum)."""
    predicted_hit_rate: Histogram = field(default_factory=lambda: Histogram(HIT_RATE_BUCKETS))
    observed_hit_rate: Histogram = field(default_factory=lambda: Histogram(HIT_RATE_BUCKETS))
    prediction_error: Histogram = field(default_factory=lambda: Histogram(ERROR_BUCKETS))
    kv_checked: int = 0
    """Decisions whose rank later stored the rest of the prompt (KV events)."""
    kv_predicted_blocks: int = 0
    kv_still_held_blocks: int = 0

    def summary(self) -> dict[str, Any]:
        """The partition's decision quality in plain numbers (the load page shows them)."""
        n, reported = self.decisions, self.reported
        return {
            "decisions": n,
            "kv_optimal": self.max_overlap_decisions,
            "non_optimal": {reason: self.non_max.get(reason, 0) for reason in REASONS},
            "overlap_blocks_lost": self.overlap_blocks_lost,
            "funnel_blocks": dict(zip(FUNNEL, self.funnel, strict=True)),
            "predicted_hit_rate": self.predicted_hit_rate.total / n if n else None,
            "reported": reported,
            "reported_predicted_hit_rate": hit_rate(
                self.reported_predicted_blocks, self.reported_prompt_blocks
            )
            if reported
            else None,
            "observed_hit_rate": self.observed_hit_rate.total / reported if reported else None,
            "mean_prediction_error_tokens": (
                self.reported_predicted_tokens - self.reported_cached_tokens
            )
            / reported
            if reported
            else None,
            "kv_checked": self.kv_checked,
            "kv_predicted_blocks": self.kv_predicted_blocks,
            "kv_still_held_blocks": self.kv_still_held_blocks,
        }


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


@dataclass(frozen=True, slots=True)
class ReceiptFilter:
    model_name: str | None = None
    routing_group: str | None = None
    worker_id: int | None = None
    since: float | None = None
    until: float | None = None
    non_optimal: bool = False

    def matches(self, r: Receipt) -> bool:
        return (
            (self.model_name is None or r.model_name == self.model_name)
            and (self.routing_group is None or r.routing_group == self.routing_group)
            and (self.worker_id is None or r.chosen.worker_id == self.worker_id)
            and (self.since is None or r.at >= self.since)
            and (self.until is None or r.at < self.until)
            and (not self.non_optimal or not r.optimal)
        )


class ReceiptRing:
    """The newest receipts by id, bounded by count and estimated bytes (oldest go first)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries <= 0 or max_bytes <= 0:
            raise ValueError("max_entries and max_bytes must be > 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._by_id: OrderedDict[str, Receipt] = OrderedDict()
        self.bytes = 0
        self.evicted = 0
        self.stats: dict[tuple[str, str], DecisionStats] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, receipt_id: str) -> Receipt | None:
        return self._by_id.get(receipt_id)

    def put(self, r: Receipt) -> None:
        """Keep ``r`` (replacing an older receipt of its id) and count its decision in its
        partition's statistics (this runs on every selection: written out in one function)."""
        rid, key = r.receipt_id, r.key
        size = r.size = RECEIPT_BASE_BYTES + len(rid) + RECEIPT_RANK_BYTES * len(r.workers)
        by_id = self._by_id
        old = by_id.pop(rid, None)
        if old is not None:
            self.bytes -= old.size
        by_id[rid] = r
        self.bytes += size
        if len(by_id) > self.max_entries or self.bytes > self.max_bytes:
            self._evict()
        s = self.stats.get(key)
        if s is None:
            s = self.stats[key] = DecisionStats()
        s.decisions += 1
        chosen, best, blocks = r.chosen_overlap, r.max_overlap, r.prompt_blocks
        if chosen >= best:
            s.max_overlap_decisions += 1
        else:
            reason = r.non_optimal_reason() or LOAD
            s.non_max[reason] = s.non_max.get(reason, 0) + 1
            s.overlap_blocks_lost += best - chosen
        f = s.funnel
        f[0] += blocks
        f[1] += best if best < blocks else blocks
        f[2] += chosen if chosen < blocks else blocks
        # Histogram.observe of hit_rate(chosen, blocks), inlined
        rate = (chosen / blocks if chosen < blocks else 1.0) if blocks > 0 else 0.0
        h = s.predicted_hit_rate
        h.counts[bisect_left(h.bounds, rate)] += 1
        h.total += rate
        h.n += 1

    def _evict(self) -> None:
        by_id = self._by_id
        while len(by_id) > self.max_entries or self.bytes > self.max_bytes:
            _, gone = by_id.popitem(last=False)
            self.bytes -= gone.size
            self.evicted += 1

    def forget_partition(self, key: tuple[str, str]) -> None:
        self.stats.pop(key, None)

    # -- outcomes --------------------------------------------------------------------------

    def booked(self, receipt_id: str, at: float, now_ns: int) -> None:
        r = self._by_id.get(receipt_id)
        if r is not None and r.state == SELECTED:
            r.state, r.booked_at, r.booked_ns = BOOKED, at, now_ns

    def prefill_done(self, receipt_id: str, at: float, now_ns: int) -> Receipt | None:
        r = self._by_id.get(receipt_id)
        if r is None or r.state != BOOKED:
            return None
        if r.prefill_done_at is None:
            r.prefill_done_at = at
            if r.booked_ns is not None:
                r.prefill_seconds = (now_ns - r.booked_ns) / 1e9
        return r

    def freed(self, receipt_id: str, at: float) -> Receipt | None:
        r = self._by_id.get(receipt_id)
        if r is None or r.state != BOOKED:
            return None
        r.state, r.freed_at = FREED, at
        return r

    def report_cached(self, r: Receipt, cached_tokens: int) -> None:
        """The client's observed cached tokens for ``r`` (counted once: the first report)."""
        if r.cached_tokens is not None:
            return
        cached = min(cached_tokens, r.isl_tokens)
        r.cached_tokens = cached
        s = self.stats.get(r.key)
        if s is None:
            return
        s.reported += 1
        s.reported_prompt_blocks += r.prompt_blocks
        s.reported_predicted_blocks += min(r.chosen_overlap, r.prompt_blocks)
        s.funnel[3] += min(cached // r.block_size, r.prompt_blocks)
        s.reported_predicted_tokens += r.predicted_cached_tokens
        s.reported_cached_tokens += cached
        s.observed_hit_rate.observe(hit_rate(cached, r.isl_tokens))
        s.prediction_error.observe(r.predicted_cached_tokens - cached)

    def kv_checked(self, r: Receipt, predicted: int, still_held: int) -> None:
        """The chosen rank stored the rest of the prompt holding ``still_held`` of the
        ``predicted`` blocks (first time only)."""
        if r.kv_predicted_blocks is not None:
            return
        r.kv_predicted_blocks, r.kv_still_held_blocks = predicted, still_held
        s = self.stats.get(r.key)
        if s is not None:
            s.kv_checked += 1
            s.kv_predicted_blocks += predicted
            s.kv_still_held_blocks += still_held

    # -- reads -----------------------------------------------------------------------------

    def summaries(self) -> list[dict[str, Any]]:
        """Every partition's ``DecisionStats.summary``, sorted by partition."""
        return [
            {"model_name": key[0], "routing_group": key[1], **s.summary()}
            for key, s in sorted(self.stats.items())
        ]

    def newest(self, where: ReceiptFilter, limit: int) -> list[Receipt]:
        """Up to ``limit`` receipts matching ``where``, newest first (O(ring) at worst)."""
        out: list[Receipt] = []
        if limit <= 0:
            return out
        for r in reversed(self._by_id.values()):
            if where.matches(r):
                out.append(r)
                if len(out) >= limit:
                    break
        return out

    def __iter__(self) -> Iterator[Receipt]:
        return iter(self._by_id.values())
