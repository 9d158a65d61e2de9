"""Block reference counts of one worker rank, with fractional (decaying) blocks.

A hash is *present* while at least one reference (a prompt or output block of an active request,
duplicates counted) holds it. ``active_blocks`` counts present hashes, each weighted by its sticky
decay fraction if it has one, rounded half away from zero like Rust's ``f64::round``.
"""

from __future__ import annotations

from .types import round_half_away_from_zero_usize


class BlockTracker:
    __slots__ = ("refcount", "fraction")

    def __init__(self) -> None:
        self.refcount: dict[int, int] = {}
        self.fraction: dict[int, float] = {}

    def touch(self, h: int) -> bool:
        """Take one reference; True when the hash became present."""
        rc = self.refcount.get(h, 0)
        self.refcount[h] = rc + 1
        return rc == 0

    def release_and_try_remove(self, h: int) -> bool:
        """Drop one reference; True when it was the last one (the hash and its fraction go)."""
        rc = self.refcount[h] - 1
        if rc:
            self.refcount[h] = rc
            return False
        del self.refcount[h]
        self.fraction.pop(h, None)
        return True

    def count(self, h: int) -> int:
        return self.refcount.get(h, 0)

    def set_fraction(self, h: int, fraction: float) -> None:
        self.fraction[h] = fraction

    def active_blocks(self) -> int:
        if not self.fraction:
            return len(self.refcount)
        count = float(len(self.refcount))
        for frac in self.fraction.values():  # every fractional hash is present (see release)
            count = count - 1.0 + frac
        return round_half_away_from_zero_usize(count)

    def active_hashes(self) -> set[int]:
        return set(self.refcount)

    def is_empty(self) -> bool:
        return not self.refcount and not self.fraction
