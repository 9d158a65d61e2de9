"""Block counts of one worker rank, with fractional (decaying) blocks.

A hash is *present* while at least one hold keeps it: a position of a prompt node the rank
holds (``ActiveSequences``) or an output block of an active request, duplicates counted.
``active_blocks`` counts present hashes, each weighted by its sticky decay fraction if it has
one, rounded half away from zero like Rust's ``f64::round``.

Almost every hash is held exactly once (lineage-consistent hashes never repeat, and a prefix
the rank already holds is not held again). The tracker keeps the few held more than once in a
small set beside the counts, so taking or dropping the holds of a run of hashes that none of
those touch runs in C (Counter's counting helper; ``dict.pop`` mapped over the run) instead of
a Python step per hash. (A set of the hashes held once would be as fast, but a set's table
takes about twice a dict's memory for the same keys.)

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
from collections import _count_elements as count_elements  # type: ignore[attr-defined]
from collections import deque
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
    __slots__ = ("refcount", "_more", "_fraction", "_frac_sum", "_nonfinite")

    def __init__(self) -> None:
        self.refcount: dict[int, int] = {}  # holds per present hash (read it, never write it)
        self._more: set[int] = set()  # the hashes held twice or more
        self._fraction: dict[int, float] = {}
        self._frac_sum = 0  # sum of the finite fractions, scaled by 2^1074
        self._nonfinite = 0  # how many fractions are NaN or infinite

    @property
    def fraction(self) -> Mapping[int, float]:
        """Read-only view of the fractional blocks (change them through ``set_fraction``)."""
        return MappingProxyType(self._fraction)

    def hold(self, hashes: Sequence[int]) -> None:
        """Take one hold per element of ``hashes``."""
        refcount = self.refcount
        n = len(refcount)
        count_elements(refcount, hashes)
        if len(refcount) - n != len(hashes):  # some were held already, or repeat in ``hashes``
            self._more.update([h for h in hashes if refcount[h] > 1])

    def unhold(self, hashes: Sequence[int]) -> None:
        """Drop one hold per element of ``hashes`` (each held); a hash whose last hold goes
        loses its fraction."""
        more = self._more
        if not more or more.isdisjoint(hashes):
            # each held once (a repeat in ``hashes`` would be in ``more``): all of them go
            deque(map(self.refcount.pop, hashes), maxlen=0)  # in C, the results dropped
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
        refcount = self.refcount
        c = refcount.get(h, 0)
        refcount[h] = c + 1
        if c:
            self._more.add(h)
        return not c

    def release_and_try_remove(self, h: int) -> bool:
        """Drop one hold; True when it was the last one (the hash and its fraction go)."""
        refcount = self.refcount
        c = refcount[h] - 1
        if c:
            refcount[h] = c
            if c == 1:
                self._more.discard(h)
            return False
        del refcount[h]
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
        present = len(self.refcount)
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
        more = {h for h, c in self.refcount.items() if c > 1}
        assert self._more == more, "the set of hashes held more than once is off"
        assert set(self._fraction) <= self.active_hashes(), "a fraction outlived its hash"
        assert self._nonfinite == sum(1 for f in fractions if not math.isfinite(f))
        assert self._frac_sum == sum(_scaled(f) for f in fractions if math.isfinite(f))

    def active_hashes(self) -> set[int]:
        return set(self.refcount)

    def is_empty(self) -> bool:
        return not self.refcount and not self._fraction
