"""The reservation ids of the selection service: which id holds which rank's request, and the
lingering-id rule after a worker delete (SELECTION.md §6).

``Reservations`` is the index the service holds: the ids and their partition, rank and instant,
the per-``(partition, lingering)`` tally kept as they change (for metrics) and the ids of each
worker (to mark them lingering when the worker leaves). It reads the trackers to tell whether an
id still holds its request; an id that no longer does (freed elsewhere, or lingering) is dropped
on the way, as the service's own derived state (no replicated change: every instance derives it
from state it already shares). The bookings themselves (``bookings.py``) go through
``SelectionService.commit``.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, Mapping

from kv_slot_tracker.core.selection.errors import ReservationConflict, ReservationReleased
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.registry import TrackerRegistry
from kv_slot_tracker.service.selection.tombstones import ReservationTombstones
from kv_slot_tracker.service.selection.types import Reservation


class Reservations:
    def __init__(self, registry: TrackerRegistry, tombstones: ReservationTombstones) -> None:
        self._registry = registry
        self.tombstones = tombstones
        """Released ids, refused as bookings while their tombstone lasts."""
        self._by_id: dict[str, Reservation] = {}
        self._held: dict[tuple[Key, bool], int] = {}
        self._of_worker: dict[int, set[str]] = {}  # worker id -> its active reservation ids
        self.lingering_dropped = 0
        """Lingering reservation ids dropped by the sweep after the request expiry (counted)."""
        self.stale_dropped = 0
        """Reservation ids whose request was freed elsewhere (slot routes, expiry), dropped."""

    # -- reads -----------------------------------------------------------------------------

    def get(self, sid: str) -> Reservation | None:
        return self._by_id.get(sid)

    def __contains__(self, sid: object) -> bool:
        return sid in self._by_id

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def items(self) -> ItemsView[str, Reservation]:
        return self._by_id.items()

    @property
    def held(self) -> Mapping[tuple[Key, bool], int]:
        """Reservation ids per ``(partition, lingering)``, kept as they change."""
        return self._held

    def partitions_held(self) -> set[Key]:
        """The partitions some reservation id is held in (active or lingering)."""
        return {key for key, _ in self._held}

    def live(self, sid: str) -> Reservation | None:
        """The reservation of ``sid`` if it still holds its request; a lingering or stale id is
        forgotten on the way."""
        res = self._by_id.get(sid)
        if res is None:
            return None
        if not res.lingering:
            t = self._registry.find(res.key)
            if t is not None and t.worker_for(sid) == res.worker:
                return res
            self.stale_dropped += 1
        self.forget(sid)
        return None

    def released(self, sid: str, now: int) -> bool:
        """Whether ``sid``'s reservation was released lately (its tombstone lasts)."""
        return self.tombstones.get(sid, now) is not None

    def check_free(self, sid: str, key: Key, now: int) -> None:
        """409 when the id is reserved anywhere (a lingering id included), when it was released
        lately (``ReservationReleased``), or when the partition's tracker already holds a
        request of that id (slot-tracker routes)."""
        if self.tombstones.get(sid, now) is not None:
            self.tombstones.counters.refused += 1
            raise ReservationReleased(sid)
        res = self._by_id.get(sid)
        if res is not None:
            if res.lingering:
                raise ReservationConflict(sid)
            if self.live(sid) is not None:
                raise ReservationConflict(sid)
        t = self._registry.find(key)
        if t is not None and t.has_request(sid):
            raise ReservationConflict(sid)

    # -- changes ---------------------------------------------------------------------------

    def hold(self, sid: str, res: Reservation) -> None:
        """Record the reservation ``sid`` (replacing an earlier one of that id)."""
        self.forget(sid)
        self._by_id[sid] = res
        self._of_worker.setdefault(res.worker.worker_id, set()).add(sid)
        self._count(res, 1)

    def release(self, sid: str, released_at: int, now: int) -> Reservation | None:
        """A release of ``sid`` (here or on a peer, at ``released_at``): drop its reservation
        and remember the id as released; returns the reservation it held, if any."""
        res = self._by_id.get(sid)
        self.forget(sid)
        self.tombstones.put(sid, res.key if res is not None else None, released_at, now)
        return res

    def forget(self, sid: str) -> bool:
        """Drop ``sid``; whether it was held."""
        res = self._by_id.pop(sid, None)
        if res is None:
            return False
        self._count(res, -1)
        ids = self._of_worker.get(res.worker.worker_id)
        if ids is not None:
            ids.discard(sid)
            if not ids:
                del self._of_worker[res.worker.worker_id]
        return True

    def orphan(self, worker_id: int, ranks: set[int] | None) -> None:
        """Mark the reservations of ``worker_id`` (on ``ranks``, or all) as lingering."""
        ids = self._of_worker.get(worker_id)
        if not ids:
            return
        for sid in list(ids):
            res = self._by_id[sid]
            if ranks is None or res.worker.dp_rank in ranks:
                self._count(res, -1)
                res.lingering = True
                self._count(res, 1)
                ids.discard(sid)
        if not ids:
            del self._of_worker[worker_id]

    def sweep(self, now: int) -> int:
        """Drop the lingering ids older than the request expiry and the ids that hold no
        request any more, and the tombstones past their ttl; returns how many ids went."""
        self.tombstones.prune(now)
        expiry = self._registry.expiry_ns
        horizon = now - (expiry or 0)
        n = 0
        for sid, res in list(self._by_id.items()):
            if res.lingering:
                if expiry and res.created_at < horizon:
                    self.lingering_dropped += 1
                    self.forget(sid)
                    n += 1
            elif self.live(sid) is None:
                n += 1
        return n

    def restore(self, reservations: dict[str, Reservation]) -> None:
        """Replace every reservation (a snapshot's); the tallies are recounted."""
        self._by_id = reservations
        self._of_worker = {}
        self._held = {}
        for sid, res in reservations.items():
            self._count(res, 1)
            if not res.lingering:
                self._of_worker.setdefault(res.worker.worker_id, set()).add(sid)

    def _count(self, res: Reservation, delta: int) -> None:
        held = self._held
        k = (res.key, res.lingering)
        n = held.get(k, 0) + delta
        if n:
            held[k] = n
        else:
            del held[k]
