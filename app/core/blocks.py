"""Block reference counts of one worker rank, with fractional (decaying) blocks.

A hash is *present* while at least one reference (a prompt or output block of an active request,
duplicates counted) holds it. ``active_blocks`` counts present hashes, each weighted by its sticky
decay fraction if it has one, rounded half away from zero like Rust's ``f64::round``.

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
from collections.abc import Mapping
from types import MappingProxyType

from .types import U64_MAX, round_half_away_from_zero_usize

_SCALE_BITS = 1074  # 2^-1074 is the smallest positive double
_ONE = 1 << _SCALE_BITS


def _scaled(fraction: float) -> int:
    """``fraction * 2^1074`` exactly (an int), for a finite double."""
    num, den = fraction.as_integer_ratio()  # den is a power of two <= 2^1074
    return num << (_SCALE_BITS + 1 - den.bit_length())


class BlockTracker:
    __slots__ = ("refcount", "_fraction", "_frac_sum", "_nonfinite")

    def __init__(self) -> None:
        self.refcount: dict[int, int] = {}
        self._fraction: dict[int, float] = {}
        self._frac_sum = 0  # sum of the finite fractions, scaled by 2^1074
        self._nonfinite = 0  # how many fractions are NaN or infinite

    @property
    def fraction(self) -> Mapping[int, float]:
        """Read-only view of the fractional blocks (change them through ``set_fraction``)."""
        return MappingProxyType(self._fraction)

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
        if self._fraction:
            self.drop_fraction(h)
        return True

    def count(self, h: int) -> int:
        return self.refcount.get(h, 0)

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
        if not fractions:
            return len(self.refcount)
        if self._nonfinite:
            count = float(len(self.refcount))
            for frac in fractions.values():  # every fractional hash is present (see release)
                count = count - 1.0 + frac
            return round_half_away_from_zero_usize(count)
        # every fractional hash is present, so it replaces its 1 in the count by its fraction
        total = ((len(self.refcount) - len(fractions)) << _SCALE_BITS) + self._frac_sum
        if total <= 0:
            return 0
        whole, rest = divmod(total, _ONE)
        if rest << 1 >= _ONE:
            whole += 1
        return whole if whole <= U64_MAX else U64_MAX

    def assert_consistent(self) -> None:
        fractions = self._fraction.values()
        assert set(self._fraction) <= set(self.refcount), "a fraction outlived its hash"
        assert self._nonfinite == sum(1 for f in fractions if not math.isfinite(f))
        assert self._frac_sum == sum(_scaled(f) for f in fractions if math.isfinite(f))

    def active_hashes(self) -> set[int]:
        return set(self.refcount)

    def is_empty(self) -> bool:
        return not self.refcount and not self._fraction
