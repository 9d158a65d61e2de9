"""Session affinity's bookkeeping: binding, expiry after the last request, the size bound."""

from __future__ import annotations

import pytest

from kv_slot_tracker.core.selection.sessions import SessionAffinity

S = 1_000_000_000


def test_bound_until_ttl_after_the_last_request() -> None:
    s = SessionAffinity(2 * S)
    assert s.bound("a", 0) is None
    s.bind("a", 7, 0)
    assert s.bound("a", 2 * S - 1) == 7
    s.touch("a", 1 * S)
    assert s.bound("a", 3 * S - 1) == 7
    assert s.bound("a", 3 * S) is None
    assert len(s) == 0


def test_rebinding_moves_the_session_and_the_oldest_goes_when_full() -> None:
    s = SessionAffinity(10 * S, max_entries=2)
    s.bind("a", 1, 0)
    s.bind("b", 2, 1)
    s.bind("a", 3, 2)  # a is now the most recent
    s.bind("c", 4, 3)
    assert (s.bound("a", 4), s.bound("b", 4), s.bound("c", 4)) == (3, None, 4)
    assert s.evicted == 1


def test_expired_sessions_are_dropped_as_new_ones_bind() -> None:
    s = SessionAffinity(S)
    for i in range(100):
        s.bind(f"s{i}", i, 0)
    s.bind("late", 1, S)
    assert len(s) == 1 and s.evicted == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        SessionAffinity(0)
