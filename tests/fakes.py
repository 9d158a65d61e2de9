"""Test doubles shared across test directories."""

from __future__ import annotations

NS_PER_SECOND = 1_000_000_000


class FakeClock:
    """A manually advanced monotonic clock reading integer nanoseconds.

    Tests advance it instead of sleeping, so decay and expiry are exact and instant.
    """

    START_NS = 1_000_000_000_000

    def __init__(self, start_ns: int = START_NS) -> None:
        self._now_ns = start_ns

    def now(self) -> int:
        return self._now_ns

    def advance(self, seconds: float) -> int:
        """Move forward by ``seconds`` (rounded to whole nanoseconds); returns the new reading."""
        return self.advance_ns(round(seconds * NS_PER_SECOND))

    def advance_ns(self, ns: int) -> int:
        """Move forward by ``ns`` nanoseconds; returns the new reading."""
        if ns < 0:
            raise ValueError(f"a monotonic clock cannot go back ({ns} ns)")
        self._now_ns += ns
        return self._now_ns

    def set(self, ns: int) -> None:
        """Jump to an absolute reading (may go back, for tests that need that explicitly)."""
        self._now_ns = ns
