"""The process's resident memory, for the memory budget (``TrackerRegistry.admit_memory``).

Reading it costs a system call and a parse (``/proc/self/statm``, a few microseconds), so a
call that grows the state reads a value at most ``interval`` (0.25 s) old, and adds consult it
at most every ``registry.MEMORY_CHECK_NS`` (0.25 s) while under the budget: the budget check
stays O(1) and the memory budget is enforced within half a second of being passed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from kv_slot_tracker.gc_tuning import release_free_memory

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_resident_bytes() -> int:
    """Resident set size of this process in bytes (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def machine_memory_bytes() -> int:
    """Physical memory of the machine (the limit when the container has none)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 34


class MemoryWatch:
    """Resident memory in bytes, read at most every ``interval`` seconds.

    Past the budget, ``after_trim`` gives the C heap's free pages back (glibc's
    ``malloc_trim``, at most every ``trim_interval`` seconds: one costs ~14 ms on a 100 MB heap)
    and reads again: memory freed by shrinking calls is otherwise kept mapped by the allocator,
    and an instance back under its count budgets would go on refusing growing calls with
    nothing but a restart to end it."""

    __slots__ = ("read", "clock", "interval", "trim", "trim_interval", "trims", "_value",
                 "_next", "_next_trim")  # fmt: skip

    def __init__(
        self,
        read: Callable[[], int] = read_resident_bytes,
        clock: Callable[[], float] = time.monotonic,
        interval: float = 0.25,
        trim: Callable[[], bool] = release_free_memory,
        trim_interval: float = 5.0,
    ) -> None:
        self.read, self.clock, self.interval = read, clock, interval
        self.trim, self.trim_interval = trim, trim_interval
        self.trims = 0
        self._value = 0
        self._next = float("-inf")
        self._next_trim = float("-inf")

    def after_trim(self) -> int:
        """Resident memory after giving free heap pages back (the last reading when a trim
        was made less than ``trim_interval`` seconds ago)."""
        now = self.clock()
        if now < self._next_trim:
            return self._value
        self._next_trim = now + self.trim_interval
        if self.trim():
            self.trims += 1
        self._value = self.read()
        self._next = now + self.interval
        return self._value

    def __call__(self) -> int:
        now = self.clock()
        if now >= self._next:
            self._value = self.read()
            self._next = now + self.interval
        return self._value
