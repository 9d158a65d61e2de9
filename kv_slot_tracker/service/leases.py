"""Worker leases: a worker that is not renewed within ``worker_ttl_seconds`` is removed.

Off by default (ttl 0), as in the reference, where a worker stays registered until it is
unregistered. With a ttl, registering or upserting a worker and ``POST /heartbeat`` renew its
lease; the service's lease sweep unregisters a worker whose lease ran out, as an unregister call
would (so the removal is replicated like any other change). Peers renew from the records of
those calls at the producer's instant, so every instance holds the same deadlines.

Deadlines sit in a heap with lazy deletion: a renewal pushes a new entry and the stale one is
skipped when it surfaces. Renewals, removals and the sweep cost O(log n) per worker concerned,
never a scan of every worker.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.service.commands import Key

LeaseId = tuple[Key, int]  # (tracker key, worker id)


class Leases:
    def __init__(self, ttl_ns: int) -> None:
        self.ttl_ns = ttl_ns
        self._deadlines: dict[LeaseId, int] = {}
        self._heap: list[tuple[int, Key, int]] = []

    @property
    def enabled(self) -> bool:
        return self.ttl_ns > 0

    def __len__(self) -> int:
        return len(self._deadlines)

    def renew(self, key: Key, worker_id: int, at: int) -> None:
        """The worker's lease now runs until ``at + ttl`` (no-op when leases are off)."""
        if self.ttl_ns <= 0:
            return
        deadline = at + self.ttl_ns
        lease = (key, worker_id)
        if self._deadlines.get(lease, -1) >= deadline:
            return  # a renewal replayed late never shortens a lease
        self._deadlines[lease] = deadline
        heapq.heappush(self._heap, (deadline, key, worker_id))

    def deadline(self, key: Key, worker_id: int) -> int | None:
        return self._deadlines.get((key, worker_id))

    def forget(self, key: Key, worker_id: int) -> None:
        self._deadlines.pop((key, worker_id), None)

    def due(self, now: int) -> list[LeaseId]:
        """The leases that ran out by ``now``, each once, removed from the book."""
        out: list[LeaseId] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, key, worker_id = heapq.heappop(heap)
            lease = (key, worker_id)
            if self._deadlines.get(lease) == deadline:
                del self._deadlines[lease]
                out.append(lease)
        if not self._deadlines:
            heap.clear()  # only stale entries left
        return out


def renew_listed(
    leases: Leases,
    key: Key,
    workers: Iterable[tuple[int, int, int]],
    removed: list[WorkerWithDpRank],
    at: int,
) -> None:
    """After a reconcile: the listed workers are renewed, the removed ones forgotten."""
    listed = {w[0] for w in workers}
    for w in listed:
        leases.renew(key, w, at)
    for r in removed:
        if r.worker_id not in listed:
            leases.forget(key, r.worker_id)
