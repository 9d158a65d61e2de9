"""Pending selections: picks made by ``/select`` with a ``selection_id``, waiting to be booked.

Why: a caller may select first and book later (``POST /reservations`` with only the id), and the
booking must land exactly where the selection pointed, with the prefill tokens computed then
(SELECTION.md §6). Entries are keyed by partition and id, as in the reference: the latest select
of an id in a partition wins, the same id may wait in several partitions, and a replay consumes
the entry of its partition only (single use).

Bounded three times, as the reference's ``--selection-cache-*`` options bound it: by count (the
oldest entry is evicted when a new one would exceed ``max_entries``), by approximate bytes (the
oldest entries are evicted while the resident entries' ``entry_bytes`` exceed ``max_bytes``; an
entry larger than the whole budget is not kept) and by age (an entry unclaimed for ``ttl_ns`` is
gone). Entries are kept in write order, so every eviction pops from the head: a write costs O(1)
amortised and nothing ever scans the whole cache. Evictions and expiries are counted. Time is
integer nanoseconds passed in by the caller.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..types import WorkerWithDpRank

# The reference's default ``--selection-cache-max-bytes``.
DEFAULT_MAX_BYTES = 256 * 1024 * 1024

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


def entry_bytes(key: PendingKey, entry: PendingSelection) -> int:
    """An entry's size as the reference counts it against ``--selection-cache-max-bytes``: 8 bytes
    per sequence hash and per block hash, and the bytes of the model name, routing group and
    selection id (measured on the reference: 16 bytes per block of a prompt given as both hash
    lists, plus those three strings, the rest of the entry not counted)."""
    model, group, sid = key
    return (
        8 * (len(entry.sequence_hashes) + len(entry.block_hashes or ()))
        + len(model.encode())
        + len(group.encode())
        + len(sid.encode())
    )


class PendingSelections:
    def __init__(self, max_entries: int, ttl_ns: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be > 0")
        if ttl_ns <= 0:
            raise ValueError("ttl_ns must be > 0")
        if max_bytes <= 0:
            raise ValueError("max_bytes must be > 0")
        self.max_entries = max_entries
        self.ttl_ns = ttl_ns
        self.max_bytes = max_bytes
        self._entries: OrderedDict[PendingKey, tuple[int, PendingSelection]] = OrderedDict()
        self.bytes = 0
        """``entry_bytes`` of the resident entries."""
        self.evicted = 0
        """Entries dropped because the cache was full, by count or bytes (never reset)."""
        self.expired = 0
        """Entries dropped unclaimed after ``ttl_ns`` (never reset)."""

    def put(self, selection_id: str, entry: PendingSelection, now_ns: int) -> None:
        """Cache ``entry`` under its partition and ``selection_id`` (replacing an earlier one)
        until ``now + ttl``; one larger than ``max_bytes`` alone is evicted at once."""
        key = (entry.model_name, entry.routing_group, selection_id)
        self.discard(key)
        self.expire(now_ns)
        size = entry_bytes(key, entry)
        if size > self.max_bytes:
            self.evicted += 1
            return
        entries = self._entries
        entries[key] = (now_ns + self.ttl_ns, entry)
        self.bytes += size
        while len(entries) > self.max_entries or self.bytes > self.max_bytes:
            self._pop_oldest()
            self.evicted += 1

    def _pop_oldest(self) -> None:
        key, (_, entry) = self._entries.popitem(last=False)
        self.bytes -= entry_bytes(key, entry)

    def get(self, key: PendingKey, now_ns: int) -> PendingSelection | None:
        """The live entry of ``(model, group, id)``, or ``None`` (expired entries count as
        absent)."""
        found = self._entries.get(key)
        if found is None or found[0] <= now_ns:
            return None
        return found[1]

    def discard(self, key: PendingKey) -> bool:
        found = self._entries.pop(key, None)
        if found is None:
            return False
        self.bytes -= entry_bytes(key, found[1])
        return True

    def expire(self, now_ns: int) -> int:
        """Drop every entry older than the TTL; returns how many were dropped."""
        entries = self._entries
        n = 0
        while entries:
            expires, _ = next(iter(entries.values()))
            if expires > now_ns:
                break
            self._pop_oldest()
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
        self.bytes = sum(entry_bytes(k, e) for k, (_, e) in self._entries.items())

    def __len__(self) -> int:
        """Resident entries, including expired ones not yet dropped."""
        return len(self._entries)
