"""Lifecycle calls that arrived before their add: tombstones (frees) and pending marks (prefill
completions), bounded in number and age.

With several instances behind a load balancer, a ``/free`` or ``/prefill_complete`` may reach an
instance before the add's replica record does (the add is still in a peer's outbox, or Redis
stalls). After a bounded wait (``kv_slot_tracker.service.consistency``) the call is kept here and replicated
to every instance, including the one holding the add:

* a **tombstone** cancels an add of the id whose producer time is not after the tombstone's
  (a later add of the same id, a legitimate re-use, is kept) and frees a copy already active;
* a **pending mark** completes the prefill of such an add when it arrives (or of the copy
  already active).

A free supersedes a mark of the same id. Entries are dropped oldest first beyond ``capacity``,
beyond ``max_bytes`` of keys (a client chooses the names and ids, each up to the API's length
limit) and after ``ttl_ns`` of producer time (all counted): an add arriving later than a request's
expiry after it was made is expired on arrival anyway, so a ttl of at least ``expiry_seconds``
loses nothing. The store is pure (times are arguments) and travels in snapshots.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

FREE = "free"
PREFILL_COMPLETE = "prefill_complete"
OPS = (FREE, PREFILL_COMPLETE)

EarlyKey = tuple[str, str, str]  # (model_name, routing_group, request_id)


@dataclass(slots=True)
class EarlyCounters:
    tombstones_created: int = 0  # frees of ids unknown after the wait, here
    tombstones_applied: int = 0  # adds cancelled and active copies freed by a tombstone
    marks_created: int = 0  # prefill completions of ids unknown after the wait, here
    marks_applied: int = 0  # prefills completed by a pending mark
    # peers' frees and prefill completions of ids not active here, kept as tombstones and
    # marks: their add may come later in a stream re-built out of order (``ReplicaRecords``)
    out_of_order: int = 0
    dropped: int = 0  # entries dropped by age or capacity before any add came


@dataclass(slots=True)
class Early:
    op: str  # FREE (a tombstone) or PREFILL_COMPLETE (a pending mark)
    ts: int  # the producer's wall-clock ns when the call was made


def key_bytes(key: EarlyKey) -> int:
    """What an entry counts against ``max_bytes``: its model name, routing group and id."""
    return len(key[0]) + len(key[1]) + len(key[2])


class EarlyCalls:
    def __init__(self, capacity: int, ttl_ns: int, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.capacity = capacity
        self.ttl_ns = ttl_ns
        self.max_bytes = max_bytes
        self.bytes = 0  # ``key_bytes`` of the entries kept
        self.counters = EarlyCounters()
        # oldest first (insertion order); an OrderedDict, whose first key is found in O(1) where
        # a dict's follows the holes its deletions leave at the front (each prune deletes there)
        self._entries: OrderedDict[EarlyKey, Early] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def tombstones(self) -> int:
        return sum(1 for e in self._entries.values() if e.op == FREE)

    def get(self, key: EarlyKey, wall_now: int) -> Early | None:
        entry = self._entries.get(key)
        if entry is not None and entry.ts < wall_now - self.ttl_ns:
            return None  # too old to matter; pruned soon
        return entry

    def put(self, key: EarlyKey, op: str, ts: int, wall_now: int) -> None:
        """Remember an early call (a free supersedes a mark, never the other way round)."""
        old = self._entries.pop(key, None)
        if old is None:
            self.bytes += key_bytes(key)
        if old is not None and old.op == FREE and op != FREE:
            op, ts = FREE, old.ts
        elif old is not None and old.op == op:
            ts = max(ts, old.ts)
        self._entries[key] = Early(op, ts)
        self.prune(wall_now)

    def discard(self, key: EarlyKey) -> None:
        if self._entries.pop(key, None) is not None:
            self.bytes -= key_bytes(key)

    def prune(self, wall_now: int) -> None:
        """Drop entries beyond the capacity or the bytes and those older than the ttl (from
        the oldest)."""
        entries = self._entries
        horizon = wall_now - self.ttl_ns
        while entries:
            key = next(iter(entries))
            if (
                len(entries) <= self.capacity
                and self.bytes <= self.max_bytes
                and entries[key].ts >= horizon
            ):
                break
            del entries[key]
            self.bytes -= key_bytes(key)
            self.counters.dropped += 1

    # -- snapshots -----------------------------------------------------------------------

    def export(self) -> list[list[Any]]:
        return [[m, g, rid, e.op, e.ts] for (m, g, rid), e in self._entries.items()]

    def restore(self, rows: list[list[Any]], wall_now: int) -> None:
        """Replace every entry by those of an ``export`` (all or nothing)."""
        entries: OrderedDict[EarlyKey, Early] = OrderedDict()
        for model, group, rid, op, ts in rows:
            if op not in OPS or type(ts) is not int:
                raise ValueError(f"invalid early call {op!r} at {ts!r}")
            entries[(model, group, rid)] = Early(op, ts)
        self._entries = entries
        self.bytes = sum(map(key_bytes, entries))
        self.prune(wall_now)
