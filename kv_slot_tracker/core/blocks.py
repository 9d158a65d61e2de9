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

A decaying request sets the fraction of every block it alone holds at each of its output
blocks (SPEC §2.2). Writing them one by one would cost the request's whole length per output
block, so those blocks are *members* of the request's ``FractionGroup`` instead: they all have
the group's one fraction, and changing it moves the sum by ``size * (new - old)`` at once. A
member is held exactly once (``refcount`` 1); one that gets a second hold keeps the group's
value as a fraction of its own (fractions are sticky) and leaves the group. Which positions
of the request are its exclusive ones is ``ActiveSequences``' business; it joins them here, and
freezes the members whose positions other prompts started to share at the request's next decay
or free (the group's value has not changed in between, so they keep the value they had then).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, TypeVar

from .types import U64_MAX, round_half_away_from_zero_usize

if TYPE_CHECKING:
    _K = TypeVar("_K")

    def count_elements(mapping: dict[_K, int], elements: Iterable[_K], /) -> None:
        """Counter.update's C helper: ``mapping[h] = mapping.get(h, 0) + 1`` per element."""

else:  # the C helper itself, which typeshed does not list
    from collections import _count_elements as count_elements

_SCALE_BITS = 1074  # 2^-1074 is the smallest positive double
_ONE = 1 << _SCALE_BITS


def _scaled(fraction: float) -> int:
    """``fraction * 2^1074`` exactly (an int), for a finite double."""
    num, den = fraction.as_integer_ratio()  # den is a power of two <= 2^1074
    return num << (_SCALE_BITS + 1 - den.bit_length())


class FractionGroup:
    """The blocks of one decaying request that follow its latest fraction.

    ``BlockTracker`` keeps ``value`` and ``size`` (how many members, each counted in the sum at
    ``value``). The positions are the request's: its prompt from ``lo`` on and its first ``out``
    output blocks have been joined (each is a member, or in ``watch`` when it was held more
    than once); ``watch`` maps such a hash to its prompt position (-1: an output block, None:
    not known yet), and ``ready`` lists the watched hashes that have since dropped to one hold.
    """

    __slots__ = ("value", "scaled", "finite", "size", "lo", "out", "watch", "ready")

    def __init__(self, lo: int) -> None:
        self.value = 0.0
        self.scaled = 0  # ``_scaled(value)`` when finite
        self.finite = True
        self.size = 0
        self.lo = lo
        self.out = 0
        self.watch: dict[int, int | None] = {}
        self.ready: list[int] = []


class BlockTracker:
    __slots__ = (
        "refcount",
        "_more",
        "_fraction",
        "_frac_sum",
        "_nonfinite",
        "_member",
        "_watchers",
    )

    def __init__(self) -> None:
        self.refcount: dict[int, int] = {}  # holds per present hash (read it, never write it)
        self._more: set[int] = set()  # the hashes held twice or more
        self._fraction: dict[int, float] = {}  # fractions of their own (sticky)
        self._frac_sum = 0  # sum of the finite fractions, scaled by 2^1074
        self._nonfinite = 0  # how many fractions are NaN or infinite
        self._member: dict[int, FractionGroup] = {}  # the hashes whose fraction is a group's
        self._watchers: dict[int, list[FractionGroup]] = {}  # groups waiting for one hold

    @property
    def fraction(self) -> dict[int, float]:
        """Every fractional block with its fraction (a copy: a full walk, for checks and
        tests; change them through a group)."""
        out = dict(self._fraction)
        out.update({h: g.value for h, g in self._member.items()})
        return out

    def hold(self, hashes: Sequence[int]) -> None:
        """Take one hold per element of ``hashes``."""
        refcount = self.refcount
        n = len(refcount)
        count_elements(refcount, hashes)
        if len(refcount) - n != len(hashes):  # some were held already, or repeat in ``hashes``
            repeated = [h for h in hashes if refcount[h] > 1]
            self._more.update(repeated)
            if self._member:
                self._leave_groups(repeated)

    def unhold(self, hashes: Sequence[int]) -> None:
        """Drop one hold per element of ``hashes`` (each held); a hash whose last hold goes
        loses its fraction."""
        more = self._more
        if not more or more.isdisjoint(hashes):
            # each held once (a repeat in ``hashes`` would be in ``more``): all of them go
            deque(map(self.refcount.pop, hashes), maxlen=0)  # in C, the results dropped
            if self._fraction and not self._fraction.keys().isdisjoint(hashes):
                drop_fraction = self.drop_fraction
                for h in hashes:
                    drop_fraction(h)
            if self._member:
                self._drop_members(hashes)
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
            if h in self._member:
                self._leave_groups((h,))
        return not c

    def release_and_try_remove(self, h: int) -> bool:
        """Drop one hold; True when it was the last one (the hash and its fraction go)."""
        refcount = self.refcount
        c = refcount[h] - 1
        if c:
            refcount[h] = c
            if c == 1:
                self._more.discard(h)
                if self._watchers:
                    for waiting in self._watchers.pop(h, ()):
                        waiting.ready.append(h)
            return False
        del refcount[h]
        if self._fraction:
            self.drop_fraction(h)
        if self._member:
            g = self._member.pop(h, None)
            if g is not None:
                self._resize(g, -1)
        return True

    def count(self, h: int) -> int:
        return self.refcount.get(h, 0)

    # -- groups ----------------------------------------------------------------------------

    def _resize(self, g: FractionGroup, k: int) -> None:
        """``k`` members join ``g`` (leave it, if negative), counted at its value."""
        g.size += k
        if g.finite:
            self._frac_sum += k * g.scaled
        else:
            self._nonfinite += k

    def set_group_value(self, g: FractionGroup, fraction: float) -> None:
        """Give every member of ``g`` the fraction ``fraction``: O(1)."""
        size = g.size
        self._resize(g, -size)
        g.value = fraction
        g.finite = math.isfinite(fraction)
        g.scaled = _scaled(fraction) if g.finite else 0
        self._resize(g, size)

    def watch(self, g: FractionGroup, h: int, pos: int | None) -> None:
        """Tell ``g`` (through ``ready``) when ``h``, held more than once, drops to one hold."""
        g.watch[h] = pos
        waiting = self._watchers.setdefault(h, [])
        if g not in waiting:
            waiting.append(g)

    def join(self, g: FractionGroup, hashes: Sequence[int], start: int) -> None:
        """Make the held-once hashes of a run of the group's positions members (a fraction of
        their own is replaced); the others are watched. ``start`` is the prompt position of
        ``hashes[0]``, or -1 for output blocks. Members already in ``g`` stay as they are."""
        more, fraction, member = self._more, self._fraction, self._member
        if not more or more.isdisjoint(hashes):  # each held once: all in C but the old ones
            if fraction and not fraction.keys().isdisjoint(hashes):
                drop_fraction = self.drop_fraction
                for h in hashes:
                    drop_fraction(h)
            n = len(member)
            member.update(dict.fromkeys(hashes, g))
            self._resize(g, len(member) - n)
            return
        for i, h in enumerate(hashes):
            if h in more:
                self.watch(g, h, -1 if start < 0 else start + i)
            elif member.get(h) is not g:
                self.drop_fraction(h)
                member[h] = g
                self._resize(g, 1)

    def join_one(self, g: FractionGroup, h: int) -> None:
        """``h`` (held once, by the group's request) follows ``g`` from now on."""
        if self._member.get(h) is not g:
            self.drop_fraction(h)
            self._member[h] = g
            self._resize(g, 1)

    def freeze(self, g: FractionGroup, hashes: Iterable[int]) -> None:
        """The members of ``g`` among ``hashes`` keep ``g``'s value as a fraction of their
        own (they stopped being the request's alone). The sum does not change."""
        member = self._member
        mine = dict.fromkeys([h for h in hashes if member.get(h) is g], g.value)
        if mine:
            deque(map(member.pop, mine), maxlen=0)
            self._fraction.update(mine)
            g.size -= len(mine)

    def _leave_groups(self, hashes: Iterable[int]) -> None:
        """Members that just got a second hold keep their group's value as their own
        fraction; their group watches them, to take them back when they are alone again."""
        member = self._member
        for h in hashes:
            g = member.pop(h, None)
            if g is not None:
                self._fraction[h] = g.value
                g.size -= 1
                self.watch(g, h, None)

    def _drop_members(self, hashes: Iterable[int]) -> None:
        """Forget the members among ``hashes`` (they stopped being present), in C but for
        one step per group."""
        per_group: dict[FractionGroup, int] = {}
        count_elements(per_group, filter(None, map(self._member.pop, hashes, repeat(None))))
        for g, k in per_group.items():
            self._resize(g, -k)

    def disband(self, g: FractionGroup) -> None:
        """The group's request is gone: its members went with it (``unhold`` and
        ``release_and_try_remove`` dropped them) or were frozen first; stop its watches."""
        assert g.size == 0, "a group was disbanded with members left"
        watchers = self._watchers
        for h in g.watch:
            waiting = watchers.get(h)
            if waiting is not None and g in waiting:
                waiting.remove(g)
                if not waiting:
                    del watchers[h]
        g.watch.clear()
        g.ready.clear()

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
        fractional = len(self._fraction) + len(self._member)
        present = len(self.refcount)
        if not fractional:
            return present
        if self._nonfinite:
            count = float(present)
            for frac in self._fraction.values():  # every fractional hash is present
                count = count - 1.0 + frac
            for g in self._member.values():
                count = count - 1.0 + g.value
            return round_half_away_from_zero_usize(count)
        # every fractional hash is present, so it replaces its 1 in the count by its fraction
        total = ((present - fractional) << _SCALE_BITS) + self._frac_sum
        if total <= 0:
            return 0
        whole, rest = divmod(total, _ONE)
        if rest << 1 >= _ONE:
            whole += 1
        return whole if whole <= U64_MAX else U64_MAX

    def assert_consistent(self) -> None:
        fractions = list(self.fraction.values())
        more = {h for h, c in self.refcount.items() if c > 1}
        assert self._more == more, "the set of hashes held more than once is off"
        assert set(self._fraction) <= self.active_hashes(), "a fraction outlived its hash"
        assert self._fraction.keys().isdisjoint(self._member), "a member has its own fraction"
        assert all(self.refcount.get(h) == 1 for h in self._member), "a member is held twice"
        sizes: dict[FractionGroup, int] = {}
        count_elements(sizes, self._member.values())
        assert all(g.size == k for g, k in sizes.items()), "a group's size is off"
        for g in sizes:
            assert g.finite == math.isfinite(g.value)
            assert not g.finite or g.scaled == _scaled(g.value)
        for h, waiting in self._watchers.items():
            assert waiting and all(h in g.watch for g in waiting), "a stale watch"
        assert self._nonfinite == sum(1 for f in fractions if not math.isfinite(f))
        assert self._frac_sum == sum(_scaled(f) for f in fractions if math.isfinite(f))

    def active_hashes(self) -> set[int]:
        return set(self.refcount)

    def is_empty(self) -> bool:
        return not (self.refcount or self._fraction or self._member or self._watchers)
