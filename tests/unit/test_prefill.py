"""Prefill load tracker: SPEC §3.7 worked examples and §9.2 scenarios P01-P16.

Tests are named after the upstream ``prefill_tracker.rs`` tests the SPEC cites (the version with
the anchor credit, ``shift_anchor_forward``). Every reading goes through both the live tracker and
an immutable snapshot, which must agree.
"""

from __future__ import annotations

import pytest

from kv_slot_tracker.core.errors import MissingExpectedDuration
from kv_slot_tracker.core.prefill import (
    AnchoredPrefillSnapshot,
    PrefillLoadSnapshot,
    PrefillLoadState,
    PrefillLoadTracker,
)
from kv_slot_tracker.core.types import NS_PER_MS, NS_PER_S, PrefillTokenDeltas, WorkerWithDpRank
from tests.fakes import FakeClock
from tests.support.prefill import active_tokens_at, prefill_order, tokens_for

E = FakeClock.START_NS  # the epoch; every instant below is E + some offset


def at(seconds: float) -> int:
    """The instant ``E + seconds`` in integer nanoseconds."""
    return E + round(seconds * NS_PER_S)


def p(tokens: int, seconds: float) -> PrefillLoadState:
    """A modeled prefill of ``seconds`` seconds."""
    return PrefillLoadState(tokens, round(seconds * NS_PER_S))


def p_ms(tokens: int, ms: float) -> PrefillLoadState:
    return PrefillLoadState(tokens, round(ms * NS_PER_MS))


def u(tokens: int) -> PrefillLoadState:
    """An unmodeled prefill."""
    return PrefillLoadState(tokens, None)


def insert(tracker: PrefillLoadTracker, rid: str, state: PrefillLoadState, now: int) -> None:
    tracker.insert(rid, state, now)
    tracker.assert_consistent()


def remove(tracker: PrefillLoadTracker, rid: str, now: int) -> PrefillLoadState | None:
    removed = tracker.remove(rid, now)
    tracker.assert_consistent()
    return removed


def tokens(tracker: PrefillLoadTracker, now: int) -> int:
    value = tracker.active_tokens(now)
    assert active_tokens_at(tracker.snapshot(), now) == value, "snapshot and tracker disagree"
    return value


def modeled(tracker: PrefillLoadTracker, now: int) -> int:
    """Modeled remaining ms; raises MissingExpectedDuration like the tracker does."""
    snap_value: int | MissingExpectedDuration
    try:
        snap_value = tracker.snapshot().modeled_remaining_prefill_time_ms(now)
    except MissingExpectedDuration as e:
        snap_value = e
    try:
        value = tracker.modeled_remaining_prefill_time_ms(now)
    except MissingExpectedDuration:
        assert isinstance(snap_value, MissingExpectedDuration), "snapshot and tracker disagree"
        raise
    assert snap_value == value, "snapshot and tracker disagree"
    return value


# --------------------------------------------------------------------------------------------
# SPEC §3.7 worked examples about a single tracker (E7-E17), upstream test names
# --------------------------------------------------------------------------------------------


def test_snapshot_without_anchor_reports_zero_active_tokens() -> None:
    tracker = PrefillLoadTracker()
    assert tracker.snapshot() == PrefillLoadSnapshot(0, None, 0)
    assert tokens(tracker, E) == 0


def test_modeled_remaining_snapshot_without_anchor_reports_zero() -> None:
    tracker = PrefillLoadTracker()
    assert modeled(tracker, E) == 0
    assert modeled(tracker, at(1000)) == 0


def test_snapshot_only_decays_oldest_prefill() -> None:
    """E7 / P01: only the anchor decays; elapsed time beyond its duration spills over."""
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), E)
    insert(tracker, "r2", p(60, 6), at(2))
    assert tracker.anchor_rid == "r1" and tracker.anchor_since == E
    assert tracker.full_sum == 160

    snapshot = tracker.snapshot()
    assert active_tokens_at(snapshot, at(2)) == 140
    assert active_tokens_at(snapshot, at(5)) == 110
    assert active_tokens_at(snapshot, at(12)) == 40
    assert [tokens(tracker, at(s)) for s in (2, 5, 12)] == [140, 110, 40]


def test_modeled_remaining_subtracts_elapsed_from_total_modeled_duration() -> None:
    """E8 / P02."""
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), E)
    insert(tracker, "r2", p(60, 6), at(2))
    assert tracker.total_modeled_ms() == 16_000

    assert modeled(tracker, at(2)) == 14_000
    assert modeled(tracker, at(12)) == 4_000
    assert modeled(tracker, at(17)) == 0


def test_modeled_remaining_zero_duration_prefill_contributes_no_time() -> None:
    """E9 / P03 (modeled part)."""
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p_ms(100, 0), E)
    insert(tracker, "r2", p(60, 6), E)

    assert modeled(tracker, E) == 6_000
    assert modeled(tracker, at(3)) == 3_000
    assert modeled(tracker, at(7)) == 0


def test_active_tokens_zero_duration_anchor_only_completes_anchor() -> None:
    """E9 / P03 (token part): a zero-duration anchor completes exactly its own tokens."""
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p_ms(100, 0), E)
    insert(tracker, "r2", p(60, 6), E)

    assert tokens(tracker, E) == 60
    assert tokens(tracker, at(3)) == 60


def test_active_tokens_with_unmodeled_prefills_use_anchor_only_decay() -> None:
    """E10 / P04: with an unmodeled prefill present only the anchor decays, capped at 0."""
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), E)
    insert(tracker, "r2", u(60), E)

    assert tokens(tracker, at(12)) == 60
    assert tokens(tracker, at(5)) == 110  # 60 + ceil(100 * 0.5)


def test_modeled_remaining_mixed_modeled_and_unmodeled_prefills_return_error() -> None:
    """E10 / P04."""
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), E)
    insert(tracker, "r2", u(60), E)

    assert tracker.total_modeled_ms() is None
    with pytest.raises(MissingExpectedDuration):
        modeled(tracker, at(2))


def test_modeled_remaining_no_aic_prefill_returns_missing_duration_error() -> None:
    """E10 / P04: a single unmodeled ``u(100)``."""
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", u(100), E)

    with pytest.raises(MissingExpectedDuration):
        modeled(tracker, E)
    assert tokens(tracker, at(1000)) == 100  # an unmodeled anchor never decays


def test_modeled_remaining_single_prefill_clips_at_zero() -> None:
    """E11 / P05."""
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), E)

    assert modeled(tracker, at(15)) == 0
    assert tokens(tracker, at(15)) == 0


def test_removing_anchored_prefill_reanchors_front_and_resets_decay() -> None:
    """E12 / P06."""
    tracker = PrefillLoadTracker()
    p1, p2 = p(100, 10), p(40, 8)
    insert(tracker, "r1", p1, E)
    insert(tracker, "r2", p2, E)

    assert remove(tracker, "r1", at(3)) == p1
    assert list(prefill_order(tracker)) == ["r2"]
    assert tracker.anchor_rid == "r2"
    assert tracker.anchor_since == at(3)

    snapshot = tracker.snapshot()
    assert snapshot.anchored_prefill == AnchoredPrefillSnapshot(40, 8 * NS_PER_S, at(3))
    assert tokens(tracker, at(3)) == 40
    assert tokens(tracker, at(5)) == 30
    assert modeled(tracker, at(5)) == 6_000


def test_nonfront_modeled_removal_caps_anchor_shift_at_removal_time() -> None:
    """E13 / P07: the credit (4 s) is capped at the removal instant (E+2)."""
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), E)
    insert(tracker, "r2", p(40, 4), E)

    assert remove(tracker, "r2", at(2)) == p(40, 4)
    assert tracker.anchor_rid == "r1"
    assert tracker.anchor_since == at(2)

    assert tokens(tracker, at(2)) == 100
    assert modeled(tracker, at(2)) == 10_000
    assert tokens(tracker, at(3)) == 90
    assert modeled(tracker, at(3)) == 9_000


def test_nonfront_modeled_removal_preserves_time_and_token_continuity() -> None:
    """E14 / P08 (E2 at tracker level): removing r2 at E+5 changes neither reading."""
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), E)
    insert(tracker, "r2", p(40, 4), E)

    assert tokens(tracker, at(5)) == 90
    assert modeled(tracker, at(5)) == 9_000

    remove(tracker, "r2", at(5))
    assert tracker.anchor_rid == "r1"
    assert tracker.anchor_since == at(4)
    assert tracker.full_sum == 100

    assert tokens(tracker, at(5)) == 90
    assert modeled(tracker, at(5)) == 9_000


def test_nonfront_unmodeled_removal_does_not_shift_anchor() -> None:
    """E15 / P09."""
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), E)
    insert(tracker, "r2", u(40), E)
    assert tokens(tracker, at(5)) == 90  # anchor-only path: 40 + ceil(100 * 0.5)

    remove(tracker, "r2", at(5))
    assert tracker.anchor_rid == "r1"
    assert tracker.anchor_since == E
    assert tokens(tracker, at(5)) == 50  # now all-modeled: 100 - 50
    assert modeled(tracker, at(5)) == 5_000


def test_removing_nonfront_modeled_prefill_shifts_existing_anchor() -> None:
    """E16 / P10."""
    tracker = PrefillLoadTracker()
    p1, p2 = p(30, 6), p(20, 4)
    insert(tracker, "r1", p1, E)
    insert(tracker, "r2", p2, E)

    assert remove(tracker, "r2", at(2)) == p2
    assert list(prefill_order(tracker)) == ["r1"]
    assert tracker.anchor_rid == "r1"
    assert tracker.anchor_since == at(2)

    assert tokens(tracker, at(2)) == 30
    assert tokens(tracker, at(4)) == 20


def test_duplicate_cleanup_is_idempotent() -> None:
    """E17 / P11."""
    tracker = PrefillLoadTracker()
    p1, p2 = p(50, 10), p(30, 10)
    insert(tracker, "r1", p1, E)
    insert(tracker, "r2", p2, E)

    assert remove(tracker, "r1", E) == p1
    assert remove(tracker, "r1", E) is None
    assert tracker.full_sum == 30
    assert list(prefill_order(tracker)) == ["r2"]

    assert remove(tracker, "r2", E) == p2
    assert remove(tracker, "r2", E) is None
    assert tracker.full_sum == 0
    assert not prefill_order(tracker)
    assert not tracker.prefills
    assert tracker.anchor_rid is None
    assert tracker.snapshot() == PrefillLoadSnapshot()


# --------------------------------------------------------------------------------------------
# Multi-worker examples E1, E4, E5 reduced to the one tracker they read
# --------------------------------------------------------------------------------------------


def test_e1_half_decayed_prefill_at_tracker_level() -> None:
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), E)
    assert tokens(tracker, at(5)) == 50
    assert modeled(tracker, at(5)) == 5_000


def test_e4_mark_completed_reanchors_later_prefill_at_tracker_level() -> None:
    """E4, worker A: 11000 ms at E+3, re-anchor at E+3, 2000 ms at E+5."""
    tracker = PrefillLoadTracker()
    insert(tracker, "a-oldest", p(100, 10), E)
    insert(tracker, "a-later", p(60, 4), at(1))
    assert tracker.anchor_since == E

    assert modeled(tracker, at(3)) == 11_000
    assert tokens(tracker, at(3)) == 130

    remove(tracker, "a-oldest", at(3))
    assert tracker.anchor_rid == "a-later"
    assert tracker.anchor_since == at(3)
    assert modeled(tracker, at(5)) == 2_000
    assert tokens(tracker, at(5)) == 30


def test_e5_modeled_time_clears_at_tracker_level() -> None:
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(12, 10), E)
    assert modeled(tracker, E) == 10_000
    remove(tracker, "r1", E)
    assert modeled(tracker, E) == 0
    insert(tracker, "r2", p(12, 6), E)
    assert modeled(tracker, E) == 6_000
    remove(tracker, "r2", E)
    assert modeled(tracker, E) == 0


# --------------------------------------------------------------------------------------------
# SPEC §9.2 derived scenarios P12-P16
# --------------------------------------------------------------------------------------------


def test_p12_rounding_paths() -> None:
    """The all-modeled path floors completed tokens; the anchor-only path ceils remaining."""
    a = PrefillLoadTracker()
    insert(a, "r1", p(100, 10), E)
    assert tokens(a, at(0.05)) == 100  # 100 - floor(0.5)
    assert tokens(a, at(0.45)) == 96  # 100 - floor(4.5)

    b = PrefillLoadTracker()
    insert(b, "r1", p(100, 10), E)
    insert(b, "r2", u(60), E)
    assert tokens(b, at(0.05)) == 160  # 60 + ceil(99.5)
    assert tokens(b, at(0.45)) == 156  # 60 + ceil(95.5)


def test_p13_stale_anchor_spillover() -> None:
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), E)

    insert(tracker, "r2", p(40, 4), at(200))
    assert tracker.anchor_since == E  # a later insert never moves the anchor
    assert tokens(tracker, at(200)) == 0  # max(0, 140 - 2000)
    assert modeled(tracker, at(200)) == 0

    insert(tracker, "r3", u(60), at(200))
    assert tokens(tracker, at(200)) == 100  # (200 - 100) + 0
    with pytest.raises(MissingExpectedDuration):
        modeled(tracker, at(200))

    remove(tracker, "r1", at(200))
    assert tracker.anchor_rid == "r2"
    assert tracker.anchor_since == at(200)
    assert tokens(tracker, at(201)) == 90  # 60 + ceil(40 * 0.75)
    assert tokens(tracker, at(204)) == 60


def test_p14_millisecond_truncation() -> None:
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", PrefillLoadState(10, 1_999_999), E)  # 1.999999 ms
    insert(tracker, "r2", p_ms(10, 2.5), E)
    assert tracker.total_modeled_ms() == 3  # 1 + 2, each truncated before summing

    assert modeled(tracker, E) == 3
    assert modeled(tracker, E + 1_500_000) == 2  # 3 - floor(1.5)


def test_p15_read_before_the_anchor_time() -> None:
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), at(10))
    assert tokens(tracker, at(5)) == 100  # elapsed clamps to 0
    assert modeled(tracker, at(5)) == 10_000


def test_p15_read_before_the_anchor_time_on_anchor_only_path() -> None:
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), at(10))
    insert(tracker, "r2", u(7), at(10))
    assert tokens(tracker, at(5)) == 107


def test_p16_deltas() -> None:
    w10, w20 = WorkerWithDpRank(1, 0), WorkerWithDpRank(2, 0)

    deltas = PrefillTokenDeltas.new(16, {w10: 8})
    assert tokens_for(deltas, w10) == 8
    assert tokens_for(deltas, w20) == 16

    assert tokens_for(PrefillTokenDeltas.uniform(5), w10) == 5
    assert tokens_for(PrefillTokenDeltas.uniform(5), WorkerWithDpRank(7, 3)) == 5
    assert tokens_for(PrefillTokenDeltas.none(), w10) == 0
    assert tokens_for(PrefillTokenDeltas.none(), w20) == 0


# --------------------------------------------------------------------------------------------
# Further §3 rules
# --------------------------------------------------------------------------------------------


def test_snapshot_is_unaffected_by_later_mutations() -> None:
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), E)
    snapshot = tracker.snapshot()

    insert(tracker, "r2", u(50), E)
    remove(tracker, "r1", at(1))

    assert active_tokens_at(snapshot, at(5)) == 50
    assert snapshot.modeled_remaining_prefill_time_ms(at(5)) == 5_000
    assert tokens(tracker, at(5)) == 50  # the live tracker holds only the unmodeled r2


def test_credit_applies_whatever_the_anchor_type() -> None:
    """SPEC §3.3 notes: the credit is applied even when the anchor itself is unmodeled."""
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", u(100), E)
    insert(tracker, "r2", p(40, 4), E)
    remove(tracker, "r2", at(10))
    assert tracker.anchor_since == at(4)  # min(E + 4, E + 10)
    assert tokens(tracker, at(10)) == 100


def test_removal_before_anchor_time_can_move_anchor_backwards() -> None:
    """SPEC §3.3 notes: ``min(since + duration, decay_now)`` with decay_now < since."""
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), at(10))
    insert(tracker, "r2", p(40, 4), at(10))
    remove(tracker, "r2", at(5))
    assert tracker.anchor_since == at(5)
    assert tokens(tracker, at(10)) == 50


def test_removing_last_prefill_clears_the_anchor_and_next_insert_anchors_anew() -> None:
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", p(100, 10), E)
    remove(tracker, "r1", at(3))
    assert tracker.anchor_rid is None
    assert tracker.anchored() is None

    insert(tracker, "r2", p(100, 10), at(7))
    assert tracker.anchor_rid == "r2"
    assert tracker.anchor_since == at(7)
    assert tokens(tracker, at(8)) == 90


def test_removing_middle_prefill_keeps_order() -> None:
    tracker = PrefillLoadTracker()
    for rid in ("r1", "r2", "r3"):
        insert(tracker, rid, u(10), E)
    remove(tracker, "r2", at(1))
    assert list(prefill_order(tracker)) == ["r1", "r3"]
    assert tracker.anchor_since == E  # unmodeled: no credit
    remove(tracker, "r1", at(2))
    assert tracker.anchor_rid == "r3"
    assert tracker.anchor_since == at(2)
    assert len(tracker) == 1


# --------------------------------------------------------------------------------------------
# Storage: O(1) removal anywhere, compact entries
# --------------------------------------------------------------------------------------------


def test_prefill_completed_mid_queue_and_added_again_goes_to_the_back() -> None:
    """The queue skips a stale copy of an id whose new prefill sits further back."""
    tracker = PrefillLoadTracker()
    insert(tracker, "a", u(10), E)
    insert(tracker, "b", u(20), E)
    insert(tracker, "c", u(30), E)
    assert remove(tracker, "b", at(1)) == u(20)
    insert(tracker, "b", u(40), at(2))
    assert list(prefill_order(tracker)) == ["a", "c", "b"]
    assert remove(tracker, "a", at(3)) == u(10)
    assert tracker.anchor_rid == "c" and tracker.anchor_since == at(3)
    assert remove(tracker, "c", at(4)) == u(30)
    assert tracker.anchor_rid == "b" and tracker.anchor_since == at(4)
    assert tokens(tracker, at(4)) == 40


def test_stale_queue_entries_stay_bounded_by_the_live_prefills() -> None:
    tracker = PrefillLoadTracker()
    tracker.insert("anchor", u(1), E)
    for i in range(1000):
        tracker.insert(f"r{i}", u(2), E)
    longest = 0
    for i in range(1000):
        tracker.remove(f"r{i}", E)
        longest = max(longest, len(tracker._queue))
        assert len(tracker._queue) <= 2 * len(tracker) + 33
    assert longest == 1001  # the first rebuild waits until stale ids outnumber live ones
    tracker.assert_consistent()
    assert len(tracker._queue) == 31  # the anchor and 30 stale ids since the last rebuild
    assert tracker._queue[0] == "anchor"
    assert tracker.anchor_rid == "anchor" and tracker.full_sum == 1


def test_unmodeled_prefills_are_kept_as_bare_token_counts() -> None:
    tracker = PrefillLoadTracker()
    insert(tracker, "u", u(60), E)
    insert(tracker, "m", p(100, 10), E)
    assert tracker._entries == {"u": 60, "m": p(100, 10)}
    assert dict(tracker.prefills) == {"u": u(60), "m": p(100, 10)}
    assert "u" in tracker.prefills and "x" not in tracker.prefills
    with pytest.raises(TypeError):
        tracker.prefills["x"] = u(1)  # type: ignore[index]


def test_inserting_a_tracked_prefill_again_is_refused_and_changes_nothing() -> None:
    tracker = PrefillLoadTracker()
    insert(tracker, "r1", u(60), E)
    with pytest.raises(ValueError, match="already tracked"):
        tracker.insert("r1", u(5), at(1))
    tracker.assert_consistent()
    assert tracker.full_sum == 60 and list(prefill_order(tracker)) == ["r1"]
