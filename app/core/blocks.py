"""Block counts of one worker rank, with fractional (decaying) blocks.

A hash is *present* while at least one hold keeps it: a position of a prompt node the rank
holds (``ActiveSequences``) or an output block of an active request, duplicates counted.
``active_blocks`` counts present hashes, each weighted by its sticky decay fraction if it has
one, rounded half away from zero like Rust's ``f64::round``.

Almost every hash is held exactly once (lineage-consistent hashes never repeat, and a prefix
the rank already holds is not held again), so those live in a set and only the others in a
count map: taking or dropping the holds of a run of hashes that none of the others touch is one
set operation, done in C, instead of a Python step per hash.

``active_blocks`` runs after every lifecycle call, so it must not walk the fractional blocks: the
tracker keeps the sum of all fractions as one exact integer (every finite double is a whole
multiple of 2^-1074) and updates it as fractions come and go. The result is the exactly rounded
weighted count; it equals Rust's sequential floating-point sum whenever that sum is exact, which
is the case SPEC §2.2 calls order-independent (for other fractions Rust's own result depends on
its hash-map order). A non-finite fraction (NaN or infinity, never validated) switches back to
the literal floating-point loop while it is present.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from .types import U64_MAX, round_half_away_from_zero_usize

_SCALE_BITS = 1074  # 2^-1074 is the smallest positive double
_ONE = 1 << _SCALE_BITS


def _scaled(fraction: float) -> int:
    """``fraction * 2^1074`` exactly (an int), for a finite double."""
    num, den = fraction.as_integer_ratio()  # den is a power of two <= 2^1074
    return num << (_SCALE_BITS + 1 - den.bit_length())


class BlockTracker:
    __slots__ = ("_once", "_more", "_fraction", "_frac_sum", "_nonfinite")

    def __init__(self) -> None:
        self._once: set[int] = set()  # hashes held exactly once
        self._more: dict[int, int] = {}  # hash -> holds, for hashes held twice or more
        self._fraction: dict[int, float] = {}
        self._frac_sum = 0  # sum of the finite fractions, scaled by 2^1074
        self._nonfinite = 0  # how many fractions are NaN or infinite

    @property
    def refcount(self) -> dict[int, int]:
        """Holds per present hash (a copy, for checks and tests)."""
        out = dict.fromkeys(self._once, 1)
        out.update(self._more)
        return out

    @property
    def fraction(self) -> Mapping[int, float]:
        """Read-only view of the fractional blocks (change them through ``set_fraction``)."""
        return MappingProxyType(self._fraction)

    def hold(self, hashes: Sequence[int]) -> None:
        """Take one hold per element of ``hashes``."""
        once, more = self._once, self._more
        if once.isdisjoint(hashes) and (not more or more.keys().isdisjoint(hashes)):
            n = len(once)
            once.update(hashes)
            if len(once) - n == len(hashes):
                return
            once.difference_update(hashes)  # a hash repeats in ``hashes``: count them one by one
        touch = self.touch
        for h in hashes:
            touch(h)

    def unhold(self, hashes: Sequence[int]) -> None:
        """Drop one hold per element of ``hashes`` (each held); a hash whose last hold goes
        loses its fraction."""
        more = self._more
        if not more or more.keys().isdisjoint(hashes):
            # all held once: a repeat in ``hashes`` would have put its hash in ``more``
            self._once.difference_update(hashes)
            if self._fraction:
                drop_fraction = self.drop_fraction
                for h in hashes:
                    drop_fraction(h)
            return
        release = self.release_and_try_remove
        for h in hashes:
            release(h)

    def touch(self, h: int) -> bool:
        """Take one hold; True when the hash became present."""
        once = self._once
        if h in once:
            once.remove(h)
            self._more[h] = 2
            return False
        c = self._more.get(h)
        if c is None:
            once.add(h)
            return True
        self._more[h] = c + 1
        return False

    def release_and_try_remove(self, h: int) -> bool:
        """Drop one hold; True when it was the last one (the hash and its fraction go)."""
        more = self._more
        c = more.get(h)
        if c is None:
            self._once.remove(h)
            if self._fraction:
                self.drop_fraction(h)
            return True
        if c == 2:
            del more[h]
            self._once.add(h)
        else:
            more[h] = c - 1
        return False

    def count(self, h: int) -> int:
        return 1 if h in self._once else self._more.get(h, 0)

    def __contains__(self, h: object) -> bool:
        return h in self._once or h in self._more

    def first_absent(self, hashes: Sequence[int]) -> int:
        """Index of the first hash of ``hashes`` that is not present, or -1."""
        once, more = self._once, self._more
        for i, h in enumerate(hashes):
            if h not in once and h not in more:
                return i
        return -1

    def set_fraction(self, h: int, fraction: float) -> None:
        self.drop_fraction(h)
        self._fraction[h] = fraction
        if math.isfinite(fraction):
            self._frac_sum += _scaled(fraction)
        else:
            self._nonfinite += 1

    def has_fractions(self) -> bool:
        return bool(self._fraction)

    def drop_fraction(self, h: int) -> None:
        """Forget the fraction of ``h`` (if any); for a hash that just stopped being present."""
        old = self._fraction.pop(h, None)
        if old is None:
            return
        if math.isfinite(old):
            self._frac_sum -= _scaled(old)
        else:
            self._nonfinite -= 1

    def active_blocks(self) -> int:
        fractions = self._fraction
        present = len(self._once) + len(self._more)
        if not fractions:
            return present
        if self._nonfinite:
            count = float(present)
            for frac in fractions.values():  # every fractional hash is present (see release)
                count = count - 1.0 + frac
            return round_half_away_from_zero_usize(count)
        # every fractional hash is present, so it replaces its 1 in the count by its fraction
        total = ((present - len(fractions)) << _SCALE_BITS) + self._frac_sum
        if total <= 0:
            return 0
        whole, rest = divmod(total, _ONE)
        if rest << 1 >= _ONE:
            whole += 1
        return whole if whole <= U64_MAX else U64_MAX

    def assert_consistent(self) -> None:
        fractions = self._fraction.values()
        assert self._once.isdisjoint(self._more), "a hash is counted in both tiers"
        assert all(c >= 2 for c in self._more.values()), "a hash held once sits in the map"
        assert set(self._fraction) <= self.active_hashes(), "a fraction outlived its hash"
        assert self._nonfinite == sum(1 for f in fractions if not math.isfinite(f))
        assert self._frac_sum == sum(_scaled(f) for f in fractions if math.isfinite(f))

    def active_hashes(self) -> set[int]:
        return self._once | self._more.keys()

    def is_empty(self) -> bool:
        return not self._once and not self._more and not self._fraction
