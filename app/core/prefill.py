"""Prefill-token load of one worker rank: anchored linear decay of the oldest prefill.

Only the oldest tracked prefill (the *anchor*) decays with time; every later prefill counts in
full until it becomes the anchor. When every prefill has a modeled duration, time elapsed beyond
the anchor's own duration keeps completing later prefills' tokens ("spillover"). Freeing a
non-anchor modeled prefill credits its duration to the anchor (``shift_anchor_forward``), capped
at the removal time. Removing the anchor re-anchors the next prefill at the removal time.

Every operation costs O(1), however many prefills a rank holds: the prefills live in one
insertion-ordered map with O(1) removal anywhere (``OrderedDict``, a linked list in C), so its
first key is always the anchor and completing a prefill in the middle of the queue scans nothing.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import KeysView
from dataclasses import dataclass

from .errors import MissingExpectedDuration
from .types import NS_PER_MS, NS_PER_S, U64_MAX


@dataclass(slots=True)
class PrefillLoadState:
    tokens: int
    duration_ns: int | None = None


@dataclass(frozen=True, slots=True)
class AnchoredPrefillSnapshot:
    tokens: int
    duration_ns: int | None
    since_ns: int


@dataclass(frozen=True, slots=True)
class PrefillLoadSnapshot:
    """An immutable reading of a prefill tracker that can answer token/time queries later."""

    prefill_full_tokens_sum: int = 0
    anchored_prefill: AnchoredPrefillSnapshot | None = None
    total_modeled_ms: int | None = 0

    def active_tokens_at(self, now: int) -> int:
        return _active_tokens(
            self.anchored_prefill,
            self.prefill_full_tokens_sum,
            self.total_modeled_ms is not None,
            now,
        )

    def modeled_remaining_prefill_time_ms(self, now: int) -> int:
        """Milliseconds of modeled prefill left; raises MissingExpectedDuration if unknown."""
        total = self.total_modeled_ms
        if total is None:
            raise MissingExpectedDuration()
        anchor = self.anchored_prefill
        if anchor is None:
            return total
        if anchor.duration_ns is None:
            raise MissingExpectedDuration()
        elapsed_ms = max(0, now - anchor.since_ns) // NS_PER_MS
        return max(0, total - elapsed_ms)


def _as_secs_f64(ns: int) -> float:
    """Rust ``Duration::as_secs_f64``: whole seconds plus nanos / 1e9 (bit-exact)."""
    return ns // NS_PER_S + (ns % NS_PER_S) / 1e9


def _active_tokens(
    anchor: AnchoredPrefillSnapshot | None, full_sum: int, all_modeled: bool, now: int
) -> int:
    if anchor is None:
        return 0
    elapsed = now - anchor.since_ns
    if elapsed < 0:
        elapsed = 0
    a_tok, a_dur = anchor.tokens, anchor.duration_ns
    if all_modeled:
        completed = a_tok if not a_dur else (a_tok * elapsed) // a_dur
        return full_sum - completed if full_sum > completed else 0
    if a_dur is None:
        remaining = a_tok
    elif a_dur == 0:
        remaining = 0
    else:
        frac = 1.0 - _as_secs_f64(elapsed) / _as_secs_f64(a_dur)
        frac = 0.0 if frac < 0.0 else (1.0 if frac > 1.0 else frac)
        remaining = math.ceil(a_tok * frac)
    return max(0, full_sum - a_tok) + remaining


class PrefillLoadTracker:
    """Tracks the prefill load of one worker rank (SPEC §3)."""

    __slots__ = (
        "prefills",
        "full_sum",
        "unmodeled_count",
        "modeled_ms_sum",
        "anchor_rid",
        "anchor_since",
    )

    def __init__(self) -> None:
        # insertion order is prefill order: the first key is the anchor
        self.prefills: OrderedDict[str, PrefillLoadState] = OrderedDict()
        self.full_sum = 0
        self.unmodeled_count = 0
        self.modeled_ms_sum = 0  # sum of whole-millisecond modeled durations
        self.anchor_rid: str | None = None
        self.anchor_since = 0

    def __len__(self) -> int:
        return len(self.prefills)

    @property
    def order(self) -> KeysView[str]:
        """The tracked request ids, oldest (the anchor) first."""
        return self.prefills.keys()

    def insert(self, request_id: str, state: PrefillLoadState, decay_now: int) -> None:
        self.prefills[request_id] = state
        self.full_sum += state.tokens
        if state.duration_ns is None:
            self.unmodeled_count += 1
        else:
            self.modeled_ms_sum += state.duration_ns // NS_PER_MS
        if self.anchor_rid is None:
            self.anchor_rid = request_id
            self.anchor_since = decay_now

    def remove(self, request_id: str, decay_now: int) -> PrefillLoadState | None:
        prefills = self.prefills
        state = prefills.pop(request_id, None)
        if state is None:
            return None
        self.full_sum -= state.tokens
        duration = state.duration_ns
        if duration is None:
            self.unmodeled_count -= 1
        else:
            self.modeled_ms_sum -= duration // NS_PER_MS
        if request_id == self.anchor_rid:
            # the next oldest prefill becomes the anchor, starting now
            if prefills:
                self.anchor_rid = next(iter(prefills))
                self.anchor_since = decay_now
            else:
                self.anchor_rid = None
                self.anchor_since = 0
        elif duration is not None:
            # Anchor credit: the freed prefill's modeled time no longer needs to elapse.
            since = self.anchor_since + duration
            self.anchor_since = since if since < decay_now else decay_now
        return state

    def anchored(self) -> AnchoredPrefillSnapshot | None:
        if self.anchor_rid is None:
            return None
        st = self.prefills[self.anchor_rid]
        return AnchoredPrefillSnapshot(st.tokens, st.duration_ns, self.anchor_since)

    def total_modeled_ms(self) -> int | None:
        if self.unmodeled_count:
            return None
        return min(self.modeled_ms_sum, U64_MAX)

    def active_tokens(self, now: int) -> int:
        rid = self.anchor_rid
        if rid is None:
            return 0
        st = self.prefills[rid]
        if self.unmodeled_count == 0:
            # all-modeled fast path (no allocation); the general rule lives in _active_tokens
            dur = st.duration_ns
            if not dur:
                completed = st.tokens
            else:
                elapsed = now - self.anchor_since
                completed = (st.tokens * elapsed) // dur if elapsed > 0 else 0
            return self.full_sum - completed if self.full_sum > completed else 0
        if st.duration_ns is None:
            return self.full_sum  # the unmodeled anchor counts in full, as does everything else
        return _active_tokens(
            AnchoredPrefillSnapshot(st.tokens, st.duration_ns, self.anchor_since),
            self.full_sum,
            False,
            now,
        )

    def modeled_remaining_prefill_time_ms(self, now: int) -> int:
        return self.snapshot().modeled_remaining_prefill_time_ms(now)

    def snapshot(self) -> PrefillLoadSnapshot:
        return PrefillLoadSnapshot(self.full_sum, self.anchored(), self.total_modeled_ms())

    def assert_consistent(self) -> None:
        assert self.full_sum == sum(s.tokens for s in self.prefills.values())
        unmodeled = [s for s in self.prefills.values() if s.duration_ns is None]
        assert self.unmodeled_count == len(unmodeled)
        assert self.modeled_ms_sum == sum(
            s.duration_ns // NS_PER_MS for s in self.prefills.values() if s.duration_ns is not None
        )
        assert (self.anchor_rid is None) == (not self.prefills)
        if self.prefills:
            assert self.anchor_rid == next(iter(self.prefills)), "the oldest prefill is the anchor"
