"""The receipt store: the newest routing receipts of this instance, bounded, and their outcomes.

``ReceiptRing`` keeps the newest receipts (``receipts.Receipt``), bounded by count and by an
estimate of their bytes (an upper bound of what a receipt holds alive, checked against
``tracemalloc`` in the tests); it follows each to its outcome (booked, prefill done, freed, the
cached tokens the client reported, the blocks the chosen rank still held) and counts decisions
and outcomes into their partition's ``DecisionStats`` as they happen. ``ReceiptFilter`` selects
the receipts a listing reads. Receipts are local to the instance that decided: they are not
replicated.

Pure: no clock is read here; times are passed in (``at``: wall-clock seconds, for the operator;
``now_ns``: the service's monotonic clock, for durations).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .decision_stats import DecisionStats
from .receipts import BOOKED, FREED, LOAD, SELECTED, Receipt, hit_rate

# Byte estimate of one receipt, an upper bound checked with tracemalloc in the tests: the object,
# its id and the ring's entry, and per candidate rank what it keeps alive (four packed numbers
# and a cost, at most 45 bytes, and the rank list when the tracker no longer shares it: 8 bytes
# and a rank object). Kept from when the columns were Python objects (170-185 bytes a rank).
RECEIPT_BASE_BYTES = 1536
RECEIPT_RANK_BYTES = 200


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
