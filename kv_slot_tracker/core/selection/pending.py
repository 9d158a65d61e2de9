"""Pending selections: picks made by ``/select`` with a ``selection_id``, waiting to be booked.

Why: a caller may select first and book later (``POST /reservations`` with only the id), and the
booking must land exactly where the selection pointed, with the prefill tokens computed then
(SELECTION.md §6). Entries are keyed by partition and id, as in the reference: the latest select
of an id in a partition wins, the same id may wait in several partitions, and a replay consumes
the entry of its partition only (single use).

Bounded twice, as the reference's ``--selection-cache-*`` options bound it: by count (the oldest
entry is evicted when a new one would exceed ``max_entries``) and by age (an entry unclaimed for
``ttl_ns`` is gone). Entries are kept in write order, so both evictions pop from the head: a write
costs O(1) amortised and nothing ever scans the whole cache. Evictions and expiries are counted.
Time is integer nanoseconds passed in by the caller.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..types import WorkerWithDpRank

PendingKey = tuple[str, str, str]
"""``(model_name, routing_group, selection_id)``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingSelection:
    """What a later replay books: the pick and the prompt as normalised at selection time."""

    model_name: str
    routing_group: str
    worker: WorkerWithDpRank
    sequence_hashes: tuple[int, ...]
    block_hashes: tuple[int, ...] | None
    isl_tokens: int
    effective_prefill_tokens: int
    track_prefill_tokens: bool
    expected_output_tokens: int | None = None
    lora_name: str | None = None
    from_tokens: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.model_name, self.routing_group)


class PendingSelections:
    def __init__(self, max_entries: int, ttl_ns: int) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be > 0")
        if ttl_ns <= 0:
            raise ValueError("ttl_ns must be > 0")
        self.max_entries = max_entries
        self.ttl_ns = ttl_ns
        self._entries: OrderedDict[PendingKey, tuple[int, PendingSelection]] = OrderedDict()
        self.evicted = 0
        """Entries dropped because the cache was full (never reset)."""
        self.expired = 0
        """Entries dropped unclaimed after ``ttl_ns`` (never reset)."""

    def put(self, selection_id: str, entry: PendingSelection, now_ns: int) -> None:
        """Cache ``entry`` under its partition and ``selection_id`` (replacing an earlier one)
        until ``now + ttl``."""
        entries = self._entries
        key = (entry.model_name, entry.routing_group, selection_id)
        entries.pop(key, None)
        self.expire(now_ns)
        entries[key] = (now_ns + self.ttl_ns, entry)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
            self.evicted += 1

    def get(self, key: PendingKey, now_ns: int) -> PendingSelection | None:
        """The live entry of ``(model, group, id)``, or ``None`` (expired entries count as
        absent)."""
        found = self._entries.get(key)
        if found is None or found[0] <= now_ns:
            return None
        return found[1]

    def discard(self, key: PendingKey) -> bool:
        return self._entries.pop(key, None) is not None

    def expire(self, now_ns: int) -> int:
        """Drop every entry older than the TTL; returns how many were dropped."""
        entries = self._entries
        n = 0
        while entries:
            expires, _ = next(iter(entries.values()))
            if expires > now_ns:
                break
            entries.popitem(last=False)
            n += 1
        self.expired += n
        return n

    def entries(self) -> list[tuple[str, int, PendingSelection]]:
        """Every resident entry, oldest first, as ``(selection_id, expires_at, entry)``."""
        return [(key[2], expires, entry) for key, (expires, entry) in self._entries.items()]

    def restore(self, entries: list[tuple[str, int, PendingSelection]]) -> None:
        """Replace the content by ``entries`` (as ``entries`` lists them; counters are kept)."""
        self._entries = OrderedDict(
            ((e.model_name, e.routing_group, sid), (expires, e)) for sid, expires, e in entries
        )

    def __len__(self) -> int:
        """Resident entries, including expired ones not yet dropped."""
        return len(self._entries)
