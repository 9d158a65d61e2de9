"""Prefill-token load of one worker rank: anchored linear decay of the oldest prefill.

Only the oldest tracked prefill (the *anchor*) decays with time; every later prefill counts in
full until it becomes the anchor. When every prefill has a modeled duration, time elapsed beyond
the anchor's own duration keeps completing later prefills' tokens ("spillover"). Freeing a
non-anchor modeled prefill credits its duration to the anchor (``shift_anchor_forward``), capped
at the removal time. Removing the anchor re-anchors the next prefill at the removal time.

Every operation costs O(1) (amortized), however many prefills a rank holds. The prefills live
in one insertion-ordered dict (its order is prefill order); a queue of their ids finds the next
anchor without walking the dict. Completing a prefill in the middle of the queue only counts its
id as stale; stale ids are skipped when they reach the head, and the queue is rebuilt from the
dict once they outnumber the live ones.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping
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


# One tracked prefill: its token count alone when unmodeled (most are), else the full state.
# A bare int is no container, so the common entry costs no object of its own.
_Entry = int | PrefillLoadState


def _state(entry: _Entry) -> PrefillLoadState:
    return PrefillLoadState(entry, None) if isinstance(entry, int) else entry


class _PrefillsView(Mapping[str, PrefillLoadState]):
    """Read-only ``request id -> PrefillLoadState`` view, in prefill order."""

    __slots__ = ("_entries",)

    def __init__(self, entries: dict[str, _Entry]) -> None:
        self._entries = entries

    def __getitem__(self, request_id: str) -> PrefillLoadState:
        return _state(self._entries[request_id])

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class PrefillLoadTracker:
    """Tracks the prefill load of one worker rank (SPEC §3)."""

    __slots__ = (
        "_entries",
        "_queue",
        "_stale",
        "full_sum",
        "unmodeled_count",
        "modeled_ms_sum",
        "anchor_rid",
        "anchor_since",
    )

    def __init__(self) -> None:
        # insertion order is prefill order: the first key is the anchor
        self._entries: dict[str, _Entry] = {}
        # the ids in prefill order, plus stale copies of ids completed while not at the head
        self._queue: deque[str] = deque()
        self._stale: dict[str, int] = {}  # id -> stale copies in the queue (all before a live one)
        self.full_sum = 0
        self.unmodeled_count = 0
        self.modeled_ms_sum = 0  # sum of whole-millisecond modeled durations
        self.anchor_rid: str | None = None
        self.anchor_since = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def prefills(self) -> Mapping[str, PrefillLoadState]:
        """The tracked prefills by request id, oldest (the anchor) first (read-only)."""
        return _PrefillsView(self._entries)

    def insert(self, request_id: str, state: PrefillLoadState, decay_now: int) -> None:
        self.add(request_id, state.tokens, state.duration_ns, decay_now)

    def add(self, request_id: str, tokens: int, duration_ns: int | None, decay_now: int) -> None:
        """Track a prefill of ``tokens`` (modeled to take ``duration_ns``, if given)."""
        entries = self._entries
        if request_id in entries:
            raise ValueError(f"prefill of {request_id!r} is already tracked")
        if duration_ns is None:
            entries[request_id] = tokens
            self.unmodeled_count += 1
        else:
            entries[request_id] = PrefillLoadState(tokens, duration_ns)
            self.modeled_ms_sum += duration_ns // NS_PER_MS
        self._queue.append(request_id)
        self.full_sum += tokens
        if self.anchor_rid is None:
            self.anchor_rid = request_id
            self.anchor_since = decay_now

    def remove(self, request_id: str, decay_now: int) -> PrefillLoadState | None:
        """Stop tracking a prefill; returns its state (None when it was not tracked)."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        self.discard(request_id, decay_now)
        return _state(entry)

    def discard(self, request_id: str, decay_now: int) -> None:
        """``remove`` without building the returned state (the lifecycle hot path)."""
        entries = self._entries
        entry = entries.pop(request_id, None)
        if entry is None:
            return
        if isinstance(entry, int):
            tokens, duration = entry, None
            self.unmodeled_count -= 1
        else:
            tokens, duration = entry.tokens, entry.duration_ns
            # an entry is a PrefillLoadState exactly when it is modeled: its duration is set
            assert duration is not None
            self.modeled_ms_sum -= duration // NS_PER_MS
        self.full_sum -= tokens
        queue = self._queue
        if request_id == self.anchor_rid:
            if entries:
                # the next oldest live prefill becomes the anchor, starting now
                queue.popleft()
                stale = self._stale
                head = queue[0]
                while head in stale:
                    n = stale.pop(head)
                    if n > 1:
                        stale[head] = n - 1
                    queue.popleft()
                    head = queue[0]
                self.anchor_rid = head
                self.anchor_since = decay_now
            else:
                queue.clear()
                self._stale.clear()
                self.anchor_rid = None
                self.anchor_since = 0
            return
        stale = self._stale
        stale[request_id] = stale.get(request_id, 0) + 1
        if len(queue) > 2 * len(entries) + 32:
            # mostly stale: rebuild from the dict, whose order is prefill order
            self._queue = deque(entries)
            stale.clear()
        if duration is not None:
            # Anchor credit: the freed prefill's modeled time no longer needs to elapse.
            since = self.anchor_since + duration
            self.anchor_since = since if since < decay_now else decay_now

    def entries(self) -> list[tuple[str, int, int | None]]:
        """``(request_id, tokens, duration_ns)`` of every tracked prefill, oldest first."""
        return [(rid, st.tokens, st.duration_ns) for rid, st in self.prefills.items()]

    def restore(self, entries: list[tuple[str, int, int | None]], anchor_since: int) -> None:
        """Refill an empty tracker from ``entries()``; the anchor started at ``anchor_since``."""
        for rid, tokens, duration_ns in entries:
            self.insert(rid, PrefillLoadState(tokens, duration_ns), anchor_since)

    def anchored(self) -> AnchoredPrefillSnapshot | None:
        if self.anchor_rid is None:
            return None
        st = _state(self._entries[self.anchor_rid])
        return AnchoredPrefillSnapshot(st.tokens, st.duration_ns, self.anchor_since)

    def total_modeled_ms(self) -> int | None:
        if self.unmodeled_count:
            return None
        return min(self.modeled_ms_sum, U64_MAX)

    def active_tokens(self, now: int) -> int:
        rid = self.anchor_rid
        if rid is None:
            return 0
        st = self._entries[rid]
        if type(st) is not PrefillLoadState:  # an int: the tokens of an unmodeled prefill
            return self.full_sum  # the unmodeled anchor counts in full, as does everything else
        tokens, dur = st.tokens, st.duration_ns
        if self.unmodeled_count == 0:
            # all-modeled fast path (no allocation); the general rule lives in _active_tokens
            if not dur:
                completed = tokens
            else:
                elapsed = now - self.anchor_since
                completed = (tokens * elapsed) // dur if elapsed > 0 else 0
            return self.full_sum - completed if self.full_sum > completed else 0
        return _active_tokens(
            AnchoredPrefillSnapshot(tokens, dur, self.anchor_since),
            self.full_sum,
            False,
            now,
        )

    def static_tokens(self) -> int | None:
        """``active_tokens`` when it does not depend on the time (no anchor, an unmodeled
        anchor, or one modeled to take no time), else None: the load columns keep such a rank's
        value until the rank changes."""
        rid = self.anchor_rid
        if rid is None:
            return 0
        st = self._entries[rid]
        if type(st) is not PrefillLoadState:
            return self.full_sum
        if st.duration_ns == 0:
            return self.active_tokens(self.anchor_since)
        return None

    def modeled_remaining_prefill_time_ms(self, now: int) -> int:
        return self.snapshot().modeled_remaining_prefill_time_ms(now)

    def snapshot(self) -> PrefillLoadSnapshot:
        return PrefillLoadSnapshot(self.full_sum, self.anchored(), self.total_modeled_ms())

    def assert_consistent(self) -> None:
        states = [_state(e) for e in self._entries.values()]
        assert all(
            s.duration_ns is not None for s in self._entries.values() if not isinstance(s, int)
        )
        assert self.full_sum == sum(s.tokens for s in states)
        assert self.unmodeled_count == sum(1 for s in states if s.duration_ns is None)
        assert self.modeled_ms_sum == sum(
            s.duration_ns // NS_PER_MS for s in states if s.duration_ns is not None
        )
        assert (self.anchor_rid is None) == (not self._entries)
        if self._entries:
            assert self.anchor_rid == next(iter(self._entries)), "the oldest prefill is the anchor"
            assert self._queue[0] == self.anchor_rid, "the queue starts at the anchor"
        stale = dict(self._stale)
        live = []
        for rid in self._queue:
            if stale.get(rid):
                stale[rid] -= 1
            else:
                live.append(rid)
        assert not any(stale.values()), "a stale count without its copy in the queue"
        assert live == list(self._entries), "the queue's live ids must follow prefill order"
