"""Decision statistics: per partition, how well the selections routed, counted as they happen.

Why it exists: a receipt tells one decision; the metrics need every decision of a partition at
once (how many took a rank with the most cached prefix, why the others did not, the blocks given
up, the cache-loss funnel, the predicted and observed hit rates and the prediction error). The
receipt ring (``receipt_ring``) counts each decision and outcome into its partition's
``DecisionStats`` as it keeps the receipt, so a scrape reads plain counters and histograms and
walks no receipts. The statistics are never reset and, as the receipts, local to the instance
that decided.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

from .receipts import REASONS, hit_rate

FUNNEL = ("prompt", "indexed_any", "chosen", "reported_cached")
"""The cache-loss funnel's stages, in blocks: the prompt's blocks, the most of them cached on
any rank, cached on the chosen rank, and reported cached by the client (where it reports)."""

HIT_RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
ERROR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096)
"""Prediction error in tokens (predicted minus reported cached tokens): negative when the engine
had more cached than the router counted on."""


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
