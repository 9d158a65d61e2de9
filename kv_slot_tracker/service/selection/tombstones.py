"""Released reservation ids (tombstones): a freed ``selection_id`` cannot be booked again while
its tombstone lasts, on any instance.

Why: a booking call may reach an instance late, after its reservation was booked elsewhere
(the client retried), used and freed: a paused process resumes and runs the stale call, or a
booking applied while Redis was down reaches the stream after the free. Without a memory of the
free, the late booking would hold the id again, on one instance or on all. So every release
leaves a tombstone here, on the instance that frees and on every instance that applies its
release record, and while it lasts:

* a local booking of the id (select_and_reserve, replay, explicit) is refused with 409
  (``ReservationReleased``), before anything changes;
* a peer's booking of the id, its request's add record and its selection record, is dropped
  (``kv_slot_tracker.service.replica``: counted with the reason ``released``, logged
  rate-limited);
* a lifecycle call (prefill completion, output block, delete) answers 404 as for any unknown
  reservation.

Reservation ids are global across partitions (SELECTION.md §6), so a tombstone is kept by id;
it remembers the partition its reservation was in when that was known, for the logs.

Bounded like the slot tracker's tombstones (``kv_slot_tracker.service.early_calls``): at most
``capacity`` entries and ``max_bytes`` of ids and names (each up to the API's length limits),
oldest dropped first (counted), and each lasts ``ttl_ns`` after the release. Times are the
service's monotonic instants (a peer's release at its producer's instant); the store is pure
and travels in the selection part of snapshots, as wall-clock times. Every operation is O(1)
(amortised: pruning pops from the oldest end).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

from kv_slot_tracker.service.commands import Key

DEFAULT_CAPACITY = 100_000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(slots=True)
class TombstoneCounters:
    created: int = 0  # releases remembered (local and peers')
    refused: int = 0  # local bookings of a released id answered 409
    dropped: int = 0  # tombstones dropped by age or by the capacity / bytes bound


class Tombstone(NamedTuple):
    key: Key | None  # the partition the reservation was in, when known
    released_at: int  # the instant of the release (the producer's, for a peer's)


def _bytes(sid: str, key: Key | None) -> int:
    return len(sid) + (len(key[0]) + len(key[1]) if key is not None else 0)


class ReservationTombstones:
    def __init__(
        self,
        ttl_ns: int,
        capacity: int = DEFAULT_CAPACITY,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        if ttl_ns <= 0 or capacity <= 0 or max_bytes <= 0:
            raise ValueError("reservation tombstones need a positive ttl, capacity and max_bytes")
        self.ttl_ns = ttl_ns
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        self.counters = TombstoneCounters()
        # oldest remembered first; an OrderedDict, whose first entry is found in O(1) however
        # many went before it (a plain dict scans the holes its deletions left at the front).
        # Never replaced: a hot path may keep it to test for no tombstone at all without a call.
        self.entries: OrderedDict[str, Tombstone] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, sid: str, now: int) -> Tombstone | None:
        """The tombstone of ``sid`` if it still lasts at ``now``."""
        entry = self.entries.get(sid)
        if entry is None or entry.released_at <= now - self.ttl_ns:
            return None  # none, or too old (pruned soon)
        return entry

    def put(self, sid: str, key: Key | None, released_at: int, now: int) -> None:
        """Remember the release of ``sid`` (the newest release of an id wins; a partition
        already known is kept when this one is not)."""
        entries = self.entries
        old = entries.pop(sid, None)
        if old is not None:
            self.bytes -= _bytes(sid, old.key)
            released_at = max(released_at, old.released_at)
            if key is None:
                key = old.key
        else:
            self.counters.created += 1
        entries[sid] = Tombstone(key, released_at)
        self.bytes += _bytes(sid, key)
        self.prune(now)

    def prune(self, now: int) -> None:
        """Drop the oldest entries beyond the capacity or the bytes, and those past the ttl."""
        entries = self.entries
        horizon = now - self.ttl_ns
        while entries:
            sid = next(iter(entries))
            entry = entries[sid]
            if (
                len(entries) <= self.capacity
                and self.bytes <= self.max_bytes
                and entry.released_at > horizon
            ):
                break
            entries.popitem(last=False)
            self.bytes -= _bytes(sid, entry.key)
            self.counters.dropped += 1

    # -- snapshots -------------------------------------------------------------------------

    def export(self, wall_offset: int, now: int) -> list[list[Any]]:
        """``[sid, model_name | None, routing_group | None, released_at as wall time]`` rows of
        the tombstones lasting at ``now``, oldest first."""
        horizon = now - self.ttl_ns
        return [
            [sid, *(e.key if e.key is not None else (None, None)), e.released_at + wall_offset]
            for sid, e in self.entries.items()
            if e.released_at > horizon
        ]

    def restore(self, entries: dict[str, Tombstone], now: int) -> None:
        """Replace every entry (a snapshot's, decoded and checked by the caller)."""
        self.entries.clear()
        self.entries.update(entries)
        self.bytes = sum(_bytes(sid, e.key) for sid, e in entries.items())
        self.prune(now)
