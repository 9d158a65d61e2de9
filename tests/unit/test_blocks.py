"""``BlockTracker`` refcounts and Rust ``f64::round() as usize`` rounding (SPEC §2.1-§2.2)."""

from __future__ import annotations

import math

import pytest

from kv_slot_tracker.core.blocks import BlockTracker
from kv_slot_tracker.core.types import U64_MAX, round_half_away_from_zero_usize
from tests.support.blocks import set_fraction

# --------------------------------------------------------------------------------------------
# round_half_away_from_zero_usize
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "expected"),
    [
        (2.5, 3),
        (1.5, 2),
        (0.5, 1),
        (3.5, 4),
        (4.5, 5),
        (0.0, 0),
        (1.0, 1),
        (2.4, 2),
        (2.6, 3),
        (2.4999999999999996, 2),
        # floor(x + 0.5) would give 1 here: x + 0.5 rounds up to 1.0 in binary64
        (0.49999999999999994, 0),
        # the largest double below 2^52 with a .5 fraction
        (4503599627370495.5, 4503599627370496),
        (2.0**53, 2**53),
    ],
)
def test_round_half_away_from_zero(x: float, expected: int) -> None:
    assert round_half_away_from_zero_usize(x) == expected


@pytest.mark.parametrize("x", [-0.0, -0.4, -0.5, -1.5, -2.5, -1e300, -math.inf])
def test_round_negative_becomes_zero(x: float) -> None:
    assert round_half_away_from_zero_usize(x) == 0


def test_round_nan_becomes_zero() -> None:
    assert round_half_away_from_zero_usize(math.nan) == 0


@pytest.mark.parametrize("x", [math.inf, 2.0**64, 1e20, 1e300])
def test_round_saturates_at_usize_max(x: float) -> None:
    """Rust's ``as usize`` saturates: anything at or above 2^64 becomes ``u64::MAX``."""
    assert round_half_away_from_zero_usize(x) == U64_MAX


def test_round_returns_int_not_python_round() -> None:
    assert round(2.5) == 2  # the banker's rounding the tracker must not use
    result = round_half_away_from_zero_usize(2.5)
    assert type(result) is int and result == 3


# --------------------------------------------------------------------------------------------
# BlockTracker
# --------------------------------------------------------------------------------------------


def test_touch_reports_became_present_only_for_first_reference() -> None:
    bt = BlockTracker()
    assert bt.touch(7) is True
    assert bt.touch(7) is False
    assert bt.touch(8) is True
    assert bt.count(7) == 2
    assert bt.count(8) == 1
    assert bt.count(9) == 0
    assert bt.active_hashes() == {7, 8}
    assert bt.active_blocks() == 2


def test_release_removes_only_on_last_reference() -> None:
    bt = BlockTracker()
    bt.touch(7)
    bt.touch(7)
    assert bt.release_and_try_remove(7) is False
    assert bt.count(7) == 1
    assert bt.active_blocks() == 1
    assert bt.release_and_try_remove(7) is True
    assert bt.count(7) == 0
    assert bt.active_hashes() == set()
    assert bt.active_blocks() == 0
    assert bt.is_empty()


def test_duplicate_hash_in_one_prompt_is_one_unique_block() -> None:
    """SPEC §2.1 / §10 D3: ``[7,7,7]`` is one block with refcount 3."""
    bt = BlockTracker()
    assert [bt.touch(h) for h in (7, 7, 7)] == [True, False, False]
    assert bt.active_blocks() == 1
    assert bt.refcount == {7: 3}
    assert [bt.release_and_try_remove(h) for h in (7, 7, 7)] == [False, False, True]
    assert bt.is_empty()


def test_fractional_active_blocks_are_rounded_half_away_from_zero() -> None:
    bt = BlockTracker()
    for h in (1, 2, 3):
        bt.touch(h)
    set_fraction(bt, 1, 0.5)
    assert bt.active_blocks() == 3  # 2 + 0.5 = 2.5 -> 3
    set_fraction(bt, 2, 0.5)
    assert bt.active_blocks() == 2  # 1 + 1.0
    set_fraction(bt, 3, 0.5)
    assert bt.active_blocks() == 2  # 1.5 -> 2
    set_fraction(bt, 3, 0.0)
    assert bt.active_blocks() == 1  # 1.0
    set_fraction(bt, 2, 0.0)
    assert bt.active_blocks() == 1  # 0.5 -> 1
    set_fraction(bt, 1, 0.25)
    assert bt.active_blocks() == 0  # 0.25 -> 0


def test_fraction_is_sticky_while_shared_and_dropped_with_the_hash() -> None:
    bt = BlockTracker()
    bt.touch(1)
    bt.touch(2)
    set_fraction(bt, 1, 0.0)
    assert bt.active_blocks() == 1
    bt.touch(1)  # now shared: the fraction stays
    assert bt.fraction == {1: 0.0}
    assert bt.active_blocks() == 1
    assert bt.release_and_try_remove(1) is False
    assert bt.fraction == {1: 0.0}
    assert bt.release_and_try_remove(1) is True
    assert bt.fraction == {}
    assert bt.active_blocks() == 1
    bt.touch(1)  # present again, without its old fraction
    assert bt.active_blocks() == 2


def test_set_fraction_overwrites() -> None:
    bt = BlockTracker()
    bt.touch(1)
    set_fraction(bt, 1, 0.2)
    set_fraction(bt, 1, 0.9)
    assert bt.fraction == {1: 0.9}
    assert bt.active_blocks() == 1  # 0.9 -> 1


def test_negative_or_nan_fraction_counts_as_zero_blocks() -> None:
    """SPEC §2.2: fractions are not validated; a negative or NaN total becomes 0."""
    bt = BlockTracker()
    bt.touch(1)
    set_fraction(bt, 1, -5.0)
    assert bt.active_blocks() == 0
    bt.touch(2)
    bt.touch(3)
    assert bt.active_blocks() == 0  # 2 - 5 = -3
    set_fraction(bt, 1, math.nan)
    assert bt.active_blocks() == 0


def test_is_empty_tracks_references() -> None:
    bt = BlockTracker()
    assert bt.is_empty()
    assert bt.active_blocks() == 0
    bt.touch(5)
    assert not bt.is_empty()
    set_fraction(bt, 5, 0.5)
    bt.release_and_try_remove(5)
    assert bt.is_empty()


def test_hold_and_unhold_a_run_of_fresh_hashes() -> None:
    bt = BlockTracker()
    bt.hold((1, 2, 3))
    assert bt.refcount == {1: 1, 2: 1, 3: 1}
    bt.hold((4, 5))
    assert bt.active_blocks() == 5
    bt.unhold((1, 2, 3))
    assert bt.refcount == {4: 1, 5: 1}
    bt.unhold((4, 5))
    assert bt.is_empty()


def test_hold_counts_repeats_inside_the_run_and_across_runs() -> None:
    bt = BlockTracker()
    bt.hold((7, 8, 7))  # a repeat inside one run
    assert bt.refcount == {7: 2, 8: 1}
    bt.hold((8, 9))  # 8 already held once
    assert bt.refcount == {7: 2, 8: 2, 9: 1}
    assert bt.active_blocks() == 3
    bt.unhold((8, 9))
    assert bt.refcount == {7: 2, 8: 1}
    bt.unhold((7, 8, 7))
    assert bt.is_empty()
    bt.assert_consistent()


def test_unhold_drops_the_fractions_of_the_hashes_that_go() -> None:
    bt = BlockTracker()
    bt.hold((1, 2))
    bt.hold((2, 3))
    set_fraction(bt, 1, 0.5)
    set_fraction(bt, 2, 0.25)
    bt.unhold((1, 2))  # 1 goes, 2 stays (held by the other run) and keeps its fraction
    assert bt.refcount == {2: 1, 3: 1}
    assert bt.fraction == {2: 0.25}
    bt.assert_consistent()
    bt.unhold((2, 3))  # the fast path (no hash held twice) drops fractions too
    assert bt.fraction == {} and bt.is_empty()
    bt.assert_consistent()


def test_hold_and_touch_make_hashes_present() -> None:
    bt = BlockTracker()
    bt.hold((1, 2))
    bt.touch(2)
    assert 2 in bt.refcount and 1 in bt.refcount and 3 not in bt.refcount
    assert bt.refcount == {1: 1, 2: 2}
    bt.assert_consistent()
