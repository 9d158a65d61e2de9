"""The per-rank cost (logit) of sending one prompt to one worker rank, and the load projections.

Why it is separate from the picking: the cost is plain arithmetic on a few numbers per rank, and the
HTTP projections (/potential_loads, the select response) reuse its pieces. The operation order
follows the reference's ``DefaultWorkerScorer::worker_logit`` so that exact ties (which decide a
coin flip) are ties here too:

    raw      = (P + max(isl, k*bs)) / bs                    # P + uncached + cached tokens
                                                            # (P = 0 when prefill is untracked)
    decay    = 1 / (1 + DECAY * (P - min P) / bs / ceil(isl/bs))   if tracking and DECAY > 0
    prefill  = SCALE * max(0, raw - CREDIT * decay * k)
    logit    = prefill + (D + new) + W * A

``max(isl, k*bs)`` equals SELECTION.md's ``isl`` whenever the cached prefix fits in the prompt; it
differs only for a hash prompt whose ``isl_tokens`` is shorter than its blocks, where the
reference's "legacy operation order" adds the cached tokens back in full.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from ..types import WorkerWithDpRank
from .config import RouterConfig


class RankInput(NamedTuple):
    """What the cost function needs to know about one candidate rank for one prompt.

    A named tuple rather than a dataclass: one is built per candidate rank on every selection,
    and a tuple is several times cheaper to build. Construct it with keywords.
    """

    worker: WorkerWithDpRank
    active_prefill_tokens: int
    """P: prefill tokens still pending on the rank (``/loads.potential_prefill_tokens``)."""
    potential_decode_blocks: int
    """D + new: active blocks plus the prompt blocks not yet active on the rank."""
    active_requests: int
    """A: requests booked on the rank."""
    overlap_blocks: int
    """k: leading prompt blocks the approximate cache holds on the rank (device tier)."""


def request_blocks(isl_tokens: int, block_size: int) -> int:
    """RB = ceil(isl / bs): the blocks the prompt occupies, counting a partial tail block."""
    return -(-isl_tokens // block_size)


def effective_prefill_tokens(isl_tokens: int, overlap_blocks: int, block_size: int) -> int:
    """Prompt tokens the rank still has to prefill: ``isl - min(isl, k*bs)`` (never credit-scaled)."""
    return isl_tokens - min(isl_tokens, overlap_blocks * block_size)


def potential_prefill_tokens(rank: RankInput, isl_tokens: int, block_size: int) -> int:
    """``/potential_loads.potential_prefill_tokens``: ``P + isl - min(isl, k*bs)``."""
    return rank.active_prefill_tokens + effective_prefill_tokens(
        isl_tokens, rank.overlap_blocks, block_size
    )


def response_decode_blocks(
    rank: RankInput, isl_tokens: int, block_size: int, num_sequence_hashes: int
) -> int:
    """The select response's ``potential_decode_blocks``: D + new + the uncovered tail blocks."""
    tail = request_blocks(isl_tokens, block_size) - num_sequence_hashes
    return rank.potential_decode_blocks + max(0, tail)


def _rust_max(a: float, b: float) -> float:
    """``f64::max``: a NaN operand yields the other one."""
    if a != a:
        return b
    if b != b:
        return a
    return a if a >= b else b


def rank_logit(
    rank: RankInput,
    *,
    isl_tokens: int,
    block_size: int,
    config: RouterConfig,
    min_prefill_tokens: int,
) -> float:
    """The cost of ``rank`` (lower is better); ``min_prefill_tokens`` = min P over the candidates.

    ``config`` is the router config with the request's override already applied.
    """
    bs = float(block_size)
    k = rank.overlap_blocks
    cached = k * block_size
    # untracked prefill is no load: the rank's pending tokens do not count (the reference)
    active = rank.active_prefill_tokens if config.track_prefill_tokens else 0
    raw_prefill_tokens = active + (isl_tokens - min(isl_tokens, cached)) + cached
    raw_prefill_blocks = raw_prefill_tokens / bs
    decay = 1.0
    if config.track_prefill_tokens and config.overlap_score_credit_decay > 0.0:
        excess = max(0, rank.active_prefill_tokens - min_prefill_tokens) / bs
        rb = request_blocks(isl_tokens, block_size)
        # IEEE division as in the reference: an empty prompt gives inf (or NaN for 0/0).
        normalised = excess / rb if rb else (math.inf if excess else math.nan)
        decay = 1.0 / (1.0 + config.overlap_score_credit_decay * normalised)
    overlap_credit_blocks = config.overlap_score_credit * decay * float(k)
    adjusted = _rust_max(raw_prefill_blocks - overlap_credit_blocks, 0.0)
    prefill_cost = config.prefill_load_scale * adjusted
    active_request_cost = config.decode_active_request_weight * float(rank.active_requests)
    return prefill_cost + float(rank.potential_decode_blocks) + active_request_cost


def rank_logits(
    prefill: Sequence[int],
    decode: Sequence[int],
    requests: Sequence[int],
    overlap: Sequence[int],
    *,
    isl_tokens: int,
    block_size: int,
    config: RouterConfig,
    min_prefill_tokens: int,
    lower_credit: Sequence[float] | None = None,
) -> list[float]:
    """``rank_logit`` of every rank given as columns (P, D + new, A, k), in one loop: the hot
    path of a selection.

    The arithmetic is ``rank_logit``'s, operation for operation, so the costs are bit-identical
    (a test compares them); only the per-rank objects, calls and attribute lookups are saved.

    ``lower_credit`` (KV events on): per rank, the prefill blocks its host and disk extensions
    save (``host_cache_hit_weight * host_ext + disk_cache_hit_weight * disk_ext``), subtracted
    with the device credit as the reference does; ``None`` when no rank has any.
    """
    if lower_credit is not None:
        return _rank_logits_tiered(
            prefill, decode, requests, overlap, lower_credit,
            isl_tokens=isl_tokens, block_size=block_size, config=config,
            min_prefill_tokens=min_prefill_tokens,
        )  # fmt: skip
    bs = float(block_size)
    credit = config.overlap_score_credit
    scale = config.prefill_load_scale
    weight = config.decode_active_request_weight
    decay_rate = config.overlap_score_credit_decay
    with_decay = config.track_prefill_tokens and decay_rate > 0.0
    rb = request_blocks(isl_tokens, block_size)
    isl = isl_tokens
    out: list[float] = []
    append = out.append
    # Mixed int/float arithmetic converts the int exactly as float() would (counts < 2^53), so
    # the explicit conversions of rank_logit are left out here.
    if not config.track_prefill_tokens:  # untracked prefill is no load (see rank_logit)
        prefill = [0] * len(prefill)
    if not with_decay:  # the usual case, without the decay's branch per rank
        for p, d, a, k in zip(prefill, decode, requests, overlap, strict=True):
            cached = k * block_size
            adjusted = (p + (isl - (isl if isl < cached else cached)) + cached) / bs - credit * k
            if not adjusted >= 0.0:
                adjusted = 0.0
            append(scale * adjusted + d + weight * a)
        return out
    for p, d, a, k in zip(prefill, decode, requests, overlap, strict=True):
        cached = k * block_size
        raw = (p + (isl - (isl if isl < cached else cached)) + cached) / bs
        if with_decay:
            excess = max(0, p - min_prefill_tokens) / bs
            normalised = excess / rb if rb else (math.inf if excess else math.nan)
            adjusted = raw - credit * (1.0 / (1.0 + decay_rate * normalised)) * k
        else:
            adjusted = raw - credit * k
        if not adjusted >= 0.0:  # f64::max(x, 0.0): NaN and negatives give 0
            adjusted = 0.0
        append(scale * adjusted + d + weight * a)
    return out


def _rank_logits_tiered(
    prefill: Sequence[int],
    decode: Sequence[int],
    requests: Sequence[int],
    overlap: Sequence[int],
    lower: Sequence[float],
    *,
    isl_tokens: int,
    block_size: int,
    config: RouterConfig,
    min_prefill_tokens: int,
) -> list[float]:
    """``rank_logits`` with each rank's host/disk credit subtracted (rare: lower tiers cached)."""
    bs = float(block_size)
    credit = config.overlap_score_credit
    decay_rate = config.overlap_score_credit_decay
    with_decay = config.track_prefill_tokens and decay_rate > 0.0
    rb = request_blocks(isl_tokens, block_size)
    isl = isl_tokens
    if not config.track_prefill_tokens:
        prefill = [0] * len(prefill)
    out = []
    for p, d, a, k, low in zip(prefill, decode, requests, overlap, lower, strict=True):
        cached = k * block_size
        raw = (p + (isl - (isl if isl < cached else cached)) + cached) / bs
        decay = 1.0
        if with_decay:
            excess = max(0, p - min_prefill_tokens) / bs
            normalised = excess / rb if rb else (math.inf if excess else math.nan)
            decay = 1.0 / (1.0 + decay_rate * normalised)
        adjusted = raw - (credit * decay * k + low)
        if not adjusted >= 0.0:
            adjusted = 0.0
        out.append(
            config.prefill_load_scale * adjusted + d + config.decode_active_request_weight * a
        )
    return out


def lower_credit_tokens(credit_blocks: float, block_size: int) -> int:
    """Prompt tokens the host/disk extensions count as cached for ``effective_prefill_tokens``
    (their weighted blocks in tokens, truncated)."""
    return int(credit_blocks * block_size)
